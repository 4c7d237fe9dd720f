"""SigLIP and SigLIP2 (issue 28): texts and images through each family's own towers and scores.

The reference is transformers' ``SiglipModel`` / ``Siglip2Model`` of the same seeded tiny folder
(:func:`~poolrunner.core.testing.tiny_models.tiny_siglip_folder`, ``tiny_siglip2_folder``), fp32,
eval, each input alone: ``get_text_features`` of the text tokenized as transformers'
zero-shot-image-classification pipeline tokenizes SigLIP text (``padding="max_length",
max_length=64, truncation=True``, the tokenizer's own mask when it returns one) and
``get_image_features`` of the folder's own processor output (SigLIP2: NaFlex patches, their
mask and grid), L2-normalized (``text_embeds`` / ``image_embeds``). poolrunner must give it
(cosine >= 0.9999, max abs <= 1e-4) for texts and scikit-image's real photographs, mixed in one
call and in any step layout. ``score`` of a (text, image) pair is ``torch.sigmoid`` of the
model's own ``logits_per_text``, and equals the zero-shot pipeline's scores.

The two folders cover both tokenizer layouts: SigLIP's pads on the right without a mask (pads
attend), SigLIP2's (Gemma's) on the left with a mask. Every parity test prints its measured
deviation (``pytest -s``).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import assert_parity, image_features

ATOL = 1e-4
TEXTS = ["w1 w2 w3", "w5 w900 w7 w8 w9 w10 w11 w12 w13", "w4", "w17 w17 w17 w300"]
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "page", "text")
FAMILIES = ("siglip", "siglip2")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def folder(family, tmp_path_factory):
    from poolrunner.core.testing import tiny_models

    return getattr(tiny_models, f"tiny_{family}_folder")(tmp_path_factory.mktemp(family))


@pytest.fixture(scope="module")
def runtime(folder):
    from poolrunner import Runtime

    return Runtime(str(folder), dtype="float32", load_entrypoints=False)


@pytest.fixture(scope="module")
def reference(family, folder):
    import transformers

    model_class = transformers.SiglipModel if family == "siglip" else transformers.Siglip2Model
    model = model_class.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    processor = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")  # poolrunner's backend
    return model, tokenizer, processor


@pytest.fixture(scope="module")
def photos():
    """scikit-image's bundled photographs and scans in RGB (SigLIP's processors take RGB only;
    poolrunner converts every image to RGB first, so the grayscale scans are their RGB copies)."""
    import skimage.data
    from PIL import Image

    return [Image.fromarray(getattr(skimage.data, name)()).convert("RGB") for name in PHOTOS]


def text_inputs(reference, texts: list[str]):
    """The pipeline's tokenization of SigLIP text (transformers' zero_shot_image_classification)."""
    return reference[1](texts, padding="max_length", max_length=64, truncation=True, return_tensors="pt")


def text_features(reference, text: str) -> np.ndarray:
    import torch

    with torch.inference_mode():
        features = reference[0].get_text_features(**text_inputs(reference, [text])).pooler_output
    return torch.nn.functional.normalize(features, dim=-1)[0].numpy()


def features(reference, item) -> np.ndarray:
    return text_features(reference, item) if isinstance(item, str) else image_features(reference, item)


def tag(runtime, name: str) -> str:
    return f"{runtime.model_config.model_type}/{name}"


def logits_per_text(reference, texts: list[str], images: list) -> np.ndarray:
    """``SiglipModel(...).logits_per_text``: ``[texts, images]``, the pipeline's tokenization."""
    import torch

    model, _, processor = reference
    with torch.inference_mode():
        out = model(**text_inputs(reference, texts), **processor(images=images, return_tensors="pt"))
    return out.logits_per_text.numpy()


def sigmoid(logits: np.ndarray) -> np.ndarray:
    import torch

    return torch.sigmoid(torch.tensor(logits)).numpy()


def test_loads_with_the_family_layout(family, runtime):
    from poolrunner.core.types import TextPadding

    config = runtime.model_config
    architecture = {"siglip": "SiglipModel", "siglip2": "Siglip2Model"}[family]
    assert (config.architecture, config.hidden_size, config.embedding_size) == (architecture, 32, 32)
    assert config.image_positions == 16  # SigLIP: (32 / 8) ** 2 patches, no class position; SigLIP2: max_num_patches
    assert (config.max_model_len, runtime.task, runtime.frontend.tasks) == (64, "embed", frozenset({"embed"}))
    assert config.text_padding == {
        "siglip": TextPadding(length=64, pad_token_id=1, left=False, attention_mask=False),
        "siglip2": TextPadding(length=64, pad_token_id=0, left=True, attention_mask=True)}[family]


def test_texts_equal_get_text_features(runtime, reference):
    assert_parity(runtime.embed(TEXTS), np.stack([text_features(reference, t) for t in TEXTS]), tag(runtime, "texts"))


def test_photos_equal_get_image_features(runtime, reference, photos):
    want = np.stack([image_features(reference, photo) for photo in photos])
    assert_parity(runtime.embed(photos), want, tag(runtime, "photos"))


def test_image_features_equal_the_processor(family, runtime, reference, photos):
    """Every processor output (SigLIP2: patches, their mask and grid) is the folder's processor's."""
    processor = reference[2]
    for index, photo in enumerate(photos):
        want = processor(images=photo, return_tensors="pt")
        got = runtime.frontend.images.features(photo, index)
        assert set(got) == set(want), (set(got), set(want))
        for name, value in want.items():
            np.testing.assert_array_equal(got[name].numpy(), value[0].numpy(), err_msg=f"{family} {name} {index}")


def test_texts_and_images_mixed_in_one_call(runtime, reference, photos):
    inputs = [TEXTS[0], photos[0], photos[4], TEXTS[1], TEXTS[2], photos[1]]
    assert_parity(runtime.embed(inputs), np.stack([features(reference, item) for item in inputs]),
                  tag(runtime, "mixed"))


def test_step_layouts_do_not_change_results(folder, runtime, reference, photos):
    """Budgets that put each image alone, or images and texts together, in a step."""
    from poolrunner import Runtime
    from poolrunner.core.testing.steps import record_steps

    inputs = [photos[0], TEXTS[0], photos[1], TEXTS[1], photos[5]]
    want = np.stack([features(reference, item) for item in inputs])
    for budget in (16, 40):
        budgeted = Runtime(str(folder), dtype="float32", load_entrypoints=False, max_num_batched_tokens=budget)
        with record_steps(budgeted) as log:
            got = budgeted.embed(inputs)
        assert_parity(got, want, tag(runtime, f"budget{budget}"))
        assert max(sum(step.num_scheduled_tokens) for step in log.steps) <= budget  # an image counts 16
        assert any(len(step.num_scheduled_tokens) > 1 for step in log.steps) is (budget == 40)


def test_score_is_the_sigmoid_of_logits_per_text(runtime, reference, photos):
    """``score(text, images)`` and ``score(images, texts)``: ``torch.sigmoid(logits_per_text)``."""
    scores = runtime.score(TEXTS[0], photos[:3])
    want = sigmoid(logits_per_text(reference, [TEXTS[0]], photos[:3]))[0]
    print(f"deviation {runtime.model_config.model_type}/score: max abs {np.abs(scores - want).max():.2e}")
    np.testing.assert_allclose(scores, want, atol=ATOL)
    assert scores.shape == (3,) and scores.dtype == np.float32
    reverse = runtime.score([photos[0], photos[1]], [TEXTS[0], TEXTS[1]])  # N:N, images as queries
    logits = logits_per_text(reference, TEXTS[:2], photos[:2])
    np.testing.assert_allclose(reverse, sigmoid(np.diag(logits)), atol=ATOL)


def test_pairs_of_one_kind_score_the_cosine(runtime, reference, photos):
    """(image, image) and (text, text) pairs have no SigLIP logit: they score the cosine."""
    images = runtime.score(photos[0], photos[1:3])
    want = [float(image_features(reference, photos[0]) @ image_features(reference, photo)) for photo in photos[1:3]]
    np.testing.assert_allclose(images, want, atol=ATOL)
    texts = runtime.score(TEXTS[0], TEXTS[1:3])
    want = [float(text_features(reference, TEXTS[0]) @ text_features(reference, text)) for text in TEXTS[1:3]]
    np.testing.assert_allclose(texts, want, atol=ATOL)


def test_pairs_of_both_kinds_are_refused(runtime, reference, photos):
    from poolrunner import InvalidRequestError

    with pytest.raises(InvalidRequestError) as info:
        runtime.score(TEXTS[0], [photos[0], TEXTS[1]])
    architecture = runtime.model_config.architecture
    assert str(info.value) == (
        "documents[1] makes a pair of one kind and documents[0] a (text, image) pair: "
        f"{architecture} scores a (text, image) pair sigmoid(cosine * exp(logit_scale) + logit_bias) and a pair "
        "of one kind (text, text or image, image) by the cosine; score them in separate requests")
    np.testing.assert_allclose(runtime.score(TEXTS[0], [photos[0]]),
                               sigmoid(logits_per_text(reference, [TEXTS[0]], [photos[0]]))[0], atol=ATOL)


def test_zero_shot_recipe_equals_the_pipeline(folder, runtime, reference, photos):
    """The documented zero-shot recipe, ``score(image, label prompts)``, gives transformers'
    zero-shot-image-classification pipeline's scores for the same folder."""
    import transformers

    labels = ["w1 w2", "w7", "w300 w301 w302"]
    pipe = transformers.pipeline("zero-shot-image-classification", model=str(folder), image_processor=reference[2])
    for photo in photos[:2]:
        want = {item["label"]: item["score"] for item in pipe(photo, candidate_labels=labels,
                                                              hypothesis_template="w9 {}")}
        got = runtime.score(photo, [f"w9 {label}" for label in labels])
        np.testing.assert_allclose(got, [want[label] for label in labels], atol=ATOL)


def test_a_prompt_over_64_tokens_is_refused(runtime, reference):
    """The text tower takes 64 positions; a longer prompt is refused, and the next one served."""
    from poolrunner import InvalidRequestError

    with pytest.raises(InvalidRequestError) as info:
        runtime.embed(["w1 " * 70])
    assert "64" in str(info.value) and "input 0" in str(info.value), str(info.value)
    assert_parity(runtime.embed(TEXTS[2]), text_features(reference, TEXTS[2]), tag(runtime, "after-long"))


SERVED = "CLIPModel ('clip'), SiglipModel ('siglip'), Siglip2Model ('siglip2')"


@pytest.mark.parametrize(("config_class", "architecture", "message"), [
    ("ViTConfig", "ViTModel", f"ViTModel (model_type 'vit') is a vision model; poolrunner embeds images only with the "
                              f"text-image families {SERVED}, each with both towers, and pages with "
                              "ColPaliForRetrieval, ColQwen2ForRetrieval, and serves no other vision or audio model"),
    ("SiglipVisionConfig", "SiglipVisionModel",
     f"SiglipVisionModel (model_type 'siglip_vision_model') is a vision model; poolrunner embeds images only with "
     f"the text-image families {SERVED}, each with both towers, and pages with ColPaliForRetrieval, "
     "ColQwen2ForRetrieval, and serves no other vision or audio model"),
    ("WhisperConfig", "WhisperModel",
     f"WhisperModel (model_type 'whisper') is an audio model; poolrunner embeds images only with the text-image "
     f"families {SERVED}, each with both towers, and pages with ColPaliForRetrieval, ColQwen2ForRetrieval, and "
     "serves no other vision or audio model"),
    ("SiglipConfig", "SiglipForImageClassification",
     "SiglipForImageClassification (model_type 'siglip') is a composite model whose config holds text_config, "
     f"vision_config; of the composite families poolrunner serves only {SERVED}, ColPaliForRetrieval ('colpali'), "
     "ColQwen2ForRetrieval ('colqwen2'); other multimodal models "
     "(vision-language, audio, other heads of these families) are refused until it implements them"),
    ("SiglipTextConfig", "SiglipTextModel",
     "SiglipTextModel (model_type 'siglip_text_model') is the text tower of a text-image family; its embedding is "
     "the family's own pooled output (CLIP's: the EOS row, then text_projection), which poolrunner serves only "
     f"from the whole model's folder (text-image families: {SERVED}), so the folder is refused rather than pooled "
     "another way"),
])
def test_other_vision_and_audio_models_are_refused_naming_the_served_families(config_class, architecture, message,
                                                                                tmp_path):
    import transformers

    from poolrunner import ModelLoadError, Runtime

    getattr(transformers, config_class)(architectures=[architecture]).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        Runtime(str(tmp_path), load_entrypoints=False)
    assert str(info.value) == f"{tmp_path}: {message}"


def test_data_urls_over_http_equal_the_python_api(runtime, photos):
    """``/v1/embeddings`` ``input`` data URLs are images (SigLIP2's patches, mask and grid included)."""
    import base64
    import io

    import httpx

    from poolrunner.core.testing.server import ServerThread

    buffer = io.BytesIO()
    photos[1].save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    with ServerThread(runtime) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        answer = client.post("/v1/embeddings", json={"input": [TEXTS[0], url]})
        assert answer.status_code == 200, answer.text
        got = np.array([item["embedding"] for item in answer.json()["data"]], dtype=np.float32)
        assert_parity(got, runtime.embed([TEXTS[0], photos[1]]), tag(runtime, "http"))
