"""sentence-transformers CLIP folders (issue 28): texts and images encoded as sentence-transformers
encodes them.

A tiny seeded CLIP (:func:`~poolrunner.core.testing.tiny_models.tiny_clip_folder`) saved by
sentence-transformers 6.2 as ``SentenceTransformer(modules=[CLIPModel(folder)])`` does, the layout
``SentenceTransformer("clip-ViT-B-32").save`` writes: ``modules.json`` naming its ``CLIPModel``
module at the folder itself, whose sentence embedding is ``get_text_features`` /
``get_image_features``' pooled output, *not* normalized; with a ``Normalize`` module after it,
normalized. The reference is ``SentenceTransformer(folder).encode`` of the texts and of the PIL
images (one call per modality: sentence-transformers refuses mixed batches); poolrunner's
``embed`` must give it (cosine >= 0.9999, max abs <= 1e-4).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import assert_parity

TEXTS = ["w1 w2 w3", "w5 w900 w7 w8 w9 w10 w11 w12 w13", "w4"]
PHOTOS = ("astronaut", "chelsea", "page")


@pytest.fixture(scope="module", params=["clip", "clip+normalize"])
def folder(request, tmp_path_factory):
    """A CLIP folder as sentence-transformers saves it (with a Normalize module for ``+normalize``)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize
    from sentence_transformers.sentence_transformer.modules import CLIPModel

    from poolrunner.core.testing.tiny_models import tiny_clip_folder

    root = tmp_path_factory.mktemp(request.param.replace("+", "-"))
    modules = [CLIPModel(str(tiny_clip_folder(root / "clip")))]
    if request.param.endswith("normalize"):
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(root / "st"))
    return root / "st"


@pytest.fixture(scope="module")
def photos():
    import skimage.data
    from PIL import Image

    return [Image.fromarray(getattr(skimage.data, name)()) for name in PHOTOS]


def test_texts_and_images_equal_sentence_transformers(folder, photos):
    from sentence_transformers import SentenceTransformer

    from poolrunner import Runtime

    reference = SentenceTransformer(str(folder), device="cpu")
    runtime = Runtime(str(folder), dtype="float32", load_entrypoints=False)
    normalized = folder.parent.name.startswith("clip-normalize")
    assert (runtime.model_config.architecture, runtime.model_config.normalize) == ("CLIPModel", normalized)
    assert_parity(runtime.embed(TEXTS), reference.encode(TEXTS), f"{folder.parent.name}/texts")
    assert_parity(runtime.embed(photos), reference.encode(photos), f"{folder.parent.name}/images")
    norms = np.linalg.norm(runtime.embed(TEXTS + photos), axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5) is normalized  # CLIPModel alone does not normalize


def test_other_modules_after_clip_are_refused(folder, tmp_path):
    """A Pooling after CLIPModel's sentence embedding is refused at load, naming the module."""
    import json
    import shutil

    from poolrunner import ModelLoadError, Runtime

    copy = tmp_path / "st"
    shutil.copytree(folder, copy)
    modules = json.loads((copy / "modules.json").read_text())
    (copy / "1_Pooling").mkdir(exist_ok=True)
    (copy / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}))
    pooling = {"idx": 1, "name": "pooling", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    modules.insert(1, pooling)
    (copy / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError) as info:
        Runtime(str(copy), dtype="float32", load_entrypoints=False)
    assert str(info.value) == (f"{copy}: a Pooling module after CLIPModel's text-image features is not supported "
                               "(only a Normalize may follow them)")
