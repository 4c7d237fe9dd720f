"""Weight files beside the backbone (a Dense layer, a token-weight head) are read without running
any code from them: a pickle that torch will not read safely refuses the load with one
``ModelLoadError`` naming the file and the fix, and a well-formed file loads (the same Dense layer
as safetensors and as a pickled state dict give sentence-transformers' vectors)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from poolrunner import Runtime
from poolrunner.core import ModelLoadError, load_weights
from tests.helpers import MIN_COSINE, cosine_rows

TEXTS = ["A cat sits outside.", "Stocks fell on Monday."]
MODULES = [("Transformer", ""), ("Pooling", "1_Pooling"), ("Dense", "2_Dense")]


class Payload:
    """What a hostile pickle would build: torch's safe reader refuses any such global."""

    def __reduce__(self):
        return (os.getcwd, ())


@pytest.fixture(scope="module")
def dense_folder(make_minilm_folder):
    return make_minilm_folder("dense_pickle", modules=MODULES, pooling={"pooling_mode_mean_tokens": True},
                              dense={"out_features": 16})


def _as_pickle(folder, state) -> None:
    (folder / "2_Dense" / "model.safetensors").unlink()
    torch.save(state, folder / "2_Dense" / "pytorch_model.bin")


def test_a_pickled_dense_layer_loads_as_its_safetensors_would(dense_folder, tmp_path):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(dense_folder), device="cpu").encode(TEXTS)
    state = load_file(dense_folder / "2_Dense" / "model.safetensors")
    pickled = tmp_path / "pickled"
    shutil.copytree(dense_folder, pickled, symlinks=True)
    _as_pickle(pickled, state)
    vectors = Runtime(str(pickled), dtype="float32", load_entrypoints=False).embed(TEXTS, normalize=False)
    assert cosine_rows(vectors, reference).min() >= MIN_COSINE


def test_a_pickle_torch_refuses_is_a_model_load_error_naming_the_file(dense_folder, tmp_path):
    hostile = tmp_path / "hostile"
    shutil.copytree(dense_folder, hostile, symlinks=True)
    _as_pickle(hostile, {"linear.weight": Payload()})
    path = hostile / "2_Dense" / "pytorch_model.bin"
    with pytest.raises(ModelLoadError) as refused:
        Runtime(str(hostile), dtype="float32", load_entrypoints=False)
    assert str(refused.value) == (
        f"{path}: torch refuses to read this pickled weight file safely (Trying to load unsupported GLOBAL "
        "posix.getcwd whose module posix is blocked.); poolrunner never runs code from a weight file: convert it "
        "to safetensors")


@pytest.mark.parametrize(("content", "message"), [
    (b"", "cannot read the weight file: "),
    (b"not a zip and not a pickle", "torch refuses to read this pickled weight file safely \\(Unsupported operand"),
])
def test_an_unreadable_weight_file_is_named(tmp_path, content, message):
    path = tmp_path / "head.pt"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=f"^{path}: {message}"):
        load_weights(path)
    torch.save([1, 2], path)
    with pytest.raises(ModelLoadError, match=f"^{path}: expected a state dict \\(names to tensors\\), found list$"):
        load_weights(path)
