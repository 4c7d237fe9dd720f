"""Every sentence-transformers Pooling mode, alone and combined, against sentence-transformers.

Each case is a MiniLM folder (``make_minilm_folder``) whose ``1_Pooling/config.json`` selects
the mode(s), usually followed by a seeded Dense module (written here, so that a combination's
Dense can take ``n_modes * 384`` inputs) and, in about half the cases, a Normalize module. The
reference is ``SentenceTransformer(folder).encode`` on the same folder: on a mixed-length batch
and on each text alone. Also the folders refused at load: unknown pooling settings and modes,
``include_prompt=false``, a Dense of the wrong width, and prompt configs that name no prompt.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch

import poolrunner
from poolrunner import InvalidRequestError, ModelLoadError
from tests.helpers import MIN_COSINE, cosine_rows, normalized

TRANSFORMER = ("Transformer", "")
POOLING = ("Pooling", "1_Pooling")
DENSE = ("Dense", "2_Dense")
SBERT_256 = {"max_seq_length": 256, "do_lower_case": False}
MAX_ABS_DIFF = 1e-4
ST_MODES = "['cls', 'max', 'mean', 'mean_sqrt_len_tokens', 'weightedmean', 'lasttoken']"
ST_SETTINGS = (
    "['word_embedding_dimension', 'embedding_dimension', 'pooling_mode', 'include_prompt', 'pooling_mode_cls_token', "
    "'pooling_mode_max_tokens', 'pooling_mode_mean_tokens', 'pooling_mode_mean_sqrt_len_tokens', "
    "'pooling_mode_weightedmean_tokens', 'pooling_mode_lasttoken']"
)


@attrs.frozen
class Case:
    """One folder: its Pooling config, the pooling_type poolrunner should read from it, the
    Dense layer written after pooling (``None``: no Dense) and whether Normalize follows."""

    name: str
    pooling: dict[str, Any]
    pooling_type: str
    dense: dict[str, Any] | None
    normalize: bool


TANH = "torch.nn.modules.activation.Tanh"
IDENTITY = "torch.nn.modules.linear.Identity"
CASES = [
    Case("cls", {"pooling_mode": "cls"}, "CLS", {"out": 64, "act": TANH}, True),
    Case("mean", {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, "MEAN",
         {"out": 96, "act": IDENTITY, "bias": False}, False),
    Case("max", {"pooling_mode": "max"}, "MAX", {"out": 64, "act": TANH}, False),
    Case("lasttoken", {"pooling_mode_lasttoken": True}, "LAST", {"out": 48, "act": TANH}, True),
    Case("weightedmean", {"pooling_mode_weightedmean_tokens": True, "pooling_mode_mean_tokens": False},
         "WEIGHTEDMEAN", {"out": 96, "act": IDENTITY}, False),
    Case("mean_sqrt_len_tokens", {"pooling_mode": ["mean_sqrt_len_tokens"]}, "MEAN_SQRT_LEN",
         {"out": 64, "act": TANH}, True),
    # Legacy flags concatenate in sentence-transformers' fixed order: max before mean.
    Case("mean+max", {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}, "MAX+MEAN",
         {"out": 64, "act": TANH}, True),
    # A pooling_mode list concatenates in its own order, repeats included.
    Case("list_order", {"pooling_mode": ["lasttoken", "weightedmean", "cls", "mean_sqrt_len_tokens", "mean"]},
         "LAST+WEIGHTEDMEAN+CLS+MEAN_SQRT_LEN+MEAN", {"out": 80, "act": IDENTITY}, False),
    Case("max_cls_plain", {"pooling_mode": ["max", "cls"]}, "MAX+CLS", None, False),
]


def write_dense(folder: Path, in_features: int, out_features: int, *, activation: str, bias: bool = True,
                seed: int = 0) -> None:
    """A sentence-transformers Dense module folder with seeded weights (any ``in_features``)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    weights = {"linear.weight": torch.randn(out_features, in_features, generator=generator) * 0.1}
    if bias:
        weights["linear.bias"] = torch.randn(out_features, generator=generator) * 0.1
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "in_features": in_features, "out_features": out_features, "bias": bias, "activation_function": activation,
    }), encoding="utf-8")
    save_file(weights, folder / "model.safetensors")


def build(make_minilm_folder, case: Case) -> Path:
    modules = [TRANSFORMER, POOLING] + ([DENSE] if case.dense else [])
    if case.normalize:
        modules.append(("Normalize", f"{len(modules)}_Normalize"))
    folder = make_minilm_folder(f"pool_{case.name}", modules=modules, pooling=case.pooling, sbert_config=SBERT_256)
    if case.dense:
        width = 384 * len(case.pooling_type.split("+"))
        write_dense(folder / DENSE[1], width, case.dense["out"], activation=case.dense["act"],
                    bias=case.dense.get("bias", True), seed=len(case.name))
    return folder


def load_st(folder: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu")


def assert_close(vectors: np.ndarray, reference: np.ndarray) -> None:
    assert vectors.shape == reference.shape
    assert vectors.dtype == np.float32
    cosines = cosine_rows(vectors, reference)
    assert cosines.min() >= MIN_COSINE, cosines
    assert np.abs(vectors.astype(np.float64) - reference).max() <= MAX_ABS_DIFF


@pytest.fixture(scope="module")
def texts(lee_docs, hf_tokenizer) -> list[str]:
    # Stripped already (sentence-transformers strips; poolrunner does not), every length differs.
    batch = [lee_docs[3], "Short text.", lee_docs[11], "What is the capital of Australia?", lee_docs[24][:300], "Hi."]
    lengths = [len(ids) for ids in hf_tokenizer(batch)["input_ids"]]
    assert len(set(lengths)) == len(batch) and max(lengths) <= 256, lengths
    return batch


@pytest.fixture(scope="module")
def built(make_minilm_folder):
    """``built(case_name)``: the case's folder, built once per module."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = build(make_minilm_folder, next(case for case in CASES if case.name == name))
        return cache[name]

    return get


@pytest.fixture(scope="module", params=CASES, ids=[case.name for case in CASES])
def served(request, built, texts):
    """One case: its folder, poolrunner's runtime and sentence-transformers' references."""
    case = request.param
    folder = built(case.name)
    st = load_st(folder)
    batch = st.encode(texts, convert_to_numpy=True)
    alone = np.concatenate([st.encode([text], convert_to_numpy=True) for text in texts])
    return case, folder, poolrunner.Runtime(folder, dtype="float32"), batch, alone


def test_model_config(served):
    case, _, rt, batch, _ = served
    config = rt.model_config
    n_modes = len(case.pooling_type.split("+"))
    assert (config.pooling_type, config.normalize) == (case.pooling_type, case.normalize)
    assert config.pooling_modes == tuple(case.pooling_type.split("+"))
    assert config.embedding_size == (case.dense["out"] if case.dense else 384 * n_modes) == batch.shape[1]
    assert [d.in_features for d in config.dense_layers] == ([384 * n_modes] if case.dense else [])


def test_batch_matches_sentence_transformers(served, texts):
    _, _, rt, batch, _ = served
    assert_close(rt.embed(texts), batch)


def test_each_text_alone_matches_sentence_transformers(served, texts):
    _, _, rt, _, alone = served
    assert_close(np.concatenate([rt.embed([text]) for text in texts]), alone)


def test_per_request_normalize(served, texts):
    # The other normalization than the folder's: pool -> Dense -> normalize holds either way.
    case, _, rt, batch, _ = served
    if case.normalize:
        np.testing.assert_allclose(np.linalg.norm(rt.embed(texts), axis=1), 1.0, atol=1e-5)
        assert not np.allclose(np.linalg.norm(rt.embed(texts, normalize=False), axis=1), 1.0, atol=1e-3)
    else:
        assert_close(rt.embed(texts, normalize=True), normalized(batch.astype(np.float64)))


# --------------------------------------------------------------------------- Matryoshka, overrides


def test_matryoshka_slice_of_a_combination(built, texts):
    # Slice after pooling (and Dense), then normalize; the slice crosses the two modes' boundary.
    folder = built("max_cls_plain")
    reference = load_st(folder).encode(texts, convert_to_numpy=True)
    rt = poolrunner.Runtime(folder, dtype="float32", is_matryoshka=True)
    assert rt.model_config.embedding_size == 768
    sliced = rt.embed(texts, dimensions=500, normalize=True)
    assert_close(sliced, normalized(reference[:, :500].astype(np.float64)))


@pytest.mark.parametrize(("pooling_type", "st_mode"), [("WEIGHTEDMEAN", "weightedmean")])
def test_pooling_type_override_with_a_new_mode(make_minilm_folder, runtime, texts, pooling_type, st_mode):
    # The default model is a MEAN + Normalize folder; the override replaces its pooling.
    rt = poolrunner.Runtime(pooling_type=pooling_type, normalize=False, dtype="float32")
    assert (rt.model_config.pooling_type, rt.model_config.embedding_size) == (pooling_type, 384)
    folder = make_minilm_folder(f"override_{st_mode}", modules=[TRANSFORMER, POOLING],
                                pooling={"pooling_mode": st_mode}, sbert_config=SBERT_256)
    vectors = rt.embed(texts)
    assert_close(vectors, load_st(folder).encode(texts, convert_to_numpy=True))
    # The guard: really another pooling than the model's own MEAN.
    assert np.abs(vectors - runtime.embed(texts, normalize=False)).max() > 1e-2


def test_a_combination_is_no_override():
    with pytest.raises(ValueError, match=r"^pooling_type must be one of \['CLS', 'MEAN', 'LAST', 'MAX', "
                                         r"'WEIGHTEDMEAN', 'MEAN_SQRT_LEN', 'ALL', 'STEP'\], got 'MEAN\+MAX'$"):
        poolrunner.Runtime(pooling_type="MEAN+MAX")


def test_model_config_accepts_only_sequence_combinations(runtime):
    config = runtime.model_config
    assert attrs.evolve(config, pooling_type="MEAN+MEAN").pooling_modes == ("MEAN", "MEAN")
    for bad in ("MEAN+ALL", "MEAN+", "mean", "MAX+STEP"):
        with pytest.raises(InvalidRequestError, match=re.escape(
            "pooling_type must be one of ['CLS', 'MEAN', 'LAST', 'MAX', 'WEIGHTEDMEAN', 'MEAN_SQRT_LEN', 'ALL', "
            "'STEP'], or two or more of ['CLS', 'MEAN', 'LAST', 'MAX', 'WEIGHTEDMEAN', 'MEAN_SQRT_LEN'] joined "
            f"by '+', got {bad!r}"
        )):
            attrs.evolve(config, pooling_type=bad)


# --------------------------------------------------------------------------- refused at load


def pooling_error(folder: Path, message: str) -> str:
    return "^" + re.escape(f"{folder / '1_Pooling' / 'config.json'}: {message}") + "$"


@pytest.mark.parametrize(("pooling", "message"), [
    ({"pooling_mode_mean_tokens": True, "pooling_mode_attention_tokens": True},
     f"unsupported pooling setting(s) ['pooling_mode_attention_tokens']; supported settings: {ST_SETTINGS} "
     f"with the pooling modes {ST_MODES}"),
    # Even false, and whatever the key: sentence-transformers refuses any key it does not know.
    ({"pooling_mode": "mean", "pooling_mode_attention_tokens": False, "pooling_scale": 2},
     f"unsupported pooling setting(s) ['pooling_mode_attention_tokens', 'pooling_scale']; supported settings: "
     f"{ST_SETTINGS} with the pooling modes {ST_MODES}"),
    ({"pooling_mode": ["mean", "attention"]},
     f"pooling mode 'attention' is not supported; supported modes: {ST_MODES}"),
    ({"pooling_mode": "MEAN"}, f"pooling mode 'MEAN' is not supported; supported modes: {ST_MODES}"),
    ({"pooling_mode": []}, f"pooling_mode must be one of {ST_MODES} or a non-empty list of them, got []"),
    ({"pooling_mode": "mean", "include_prompt": False}, "include_prompt=false is not supported"),
])
def test_pooling_config_refused(make_minilm_folder, pooling, message):
    folder = make_minilm_folder("bad_pooling", modules=[TRANSFORMER, POOLING], pooling=pooling)
    with pytest.raises(ModelLoadError, match=pooling_error(folder, message)):
        poolrunner.Runtime(folder, dtype="float32")


def test_dense_of_the_wrong_width_is_refused(make_minilm_folder, built):
    # A combination's Dense must take n_modes * hidden_size inputs, as in sentence-transformers;
    # overriding the pooling of a folder whose Dense fits a combination is refused the same way.
    folder = make_minilm_folder("narrow_dense", modules=[TRANSFORMER, POOLING, DENSE],
                                pooling={"pooling_mode": ["mean", "max"]}, dense={"out_features": 16})
    with pytest.raises(ModelLoadError, match="^" + re.escape(
        f"pooling_type 'MEAN+MAX' gives 768 values per input, but the first Dense layer ({folder / '2_Dense'}) "
        "takes 384"
    ) + "$"):
        poolrunner.Runtime(folder, dtype="float32")
    wide = built("mean+max")
    with pytest.raises(ModelLoadError, match="^" + re.escape(
        f"pooling_type 'MEAN' gives 384 values per input, but the first Dense layer ({wide / '2_Dense'}) takes 768"
    ) + "$"):
        poolrunner.Runtime(wide, pooling_type="MEAN", dtype="float32")


# --------------------------------------------------------------------------- prompt config


def prompt_error(folder: Path, message: str) -> str:
    return "^" + re.escape(f"{folder / 'config_sentence_transformers.json'}: {message}") + "$"


@pytest.mark.parametrize(("st_config", "message"), [
    ({"prompts": {"query": "q: "}, "default_prompt_name": "passage"},
     "default_prompt_name 'passage' names no prompt in prompts; defined prompts: ['query']"),
    ({"default_prompt_name": "query"}, "default_prompt_name 'query' names no prompt in prompts; defined prompts: []"),
    ({"prompts": {"query": "q: "}, "default_prompt_name": ""},
     "default_prompt_name '' names no prompt in prompts; defined prompts: ['query']"),
    ({"prompts": {"query": "q: ", "passage": "p: "}, "default_prompt_name": ["query"]},
     "default_prompt_name ['query'] names no prompt in prompts; defined prompts: ['passage', 'query']"),
    ({"prompts": {"query": "q: ", "passage": 5}},
     "prompt 'passage' is 5, not a string; defined prompts: ['passage', 'query']"),
    ({"prompts": {"query": ["q: "]}, "default_prompt_name": "query"},
     "prompt 'query' is ['q: '], not a string; defined prompts: ['query']"),
    ({"prompts": ["query: "]}, "prompts must map prompt names to strings, got ['query: ']"),
    (["query: "], "expected a JSON object, got ['query: ']"),
])
def test_prompt_config_refused(make_minilm_folder, st_config, message):
    folder = make_minilm_folder("bad_prompts", modules=[TRANSFORMER, POOLING], pooling={"pooling_mode": "mean"},
                                st_config=st_config)
    with pytest.raises(ModelLoadError, match=prompt_error(folder, message)):
        poolrunner.Runtime(folder, dtype="float32")


def test_null_prompt_is_the_empty_prompt(make_minilm_folder, texts):
    # sentence-transformers reads a null prompt as "" (and so may a default name point at it).
    st_config = {"prompts": {"query": "query: ", "none": None}, "default_prompt_name": "none"}
    folder = make_minilm_folder("null_prompt", modules=[TRANSFORMER, POOLING], pooling={"pooling_mode": "max"},
                                sbert_config=SBERT_256, st_config=st_config)
    rt = poolrunner.Runtime(folder, dtype="float32")
    assert dict(rt.model_config.prompts) == {"query": "query: ", "none": ""}
    st = load_st(folder)
    assert_close(rt.embed(texts), st.encode(texts, convert_to_numpy=True))
    assert_close(rt.embed(texts, prompt_name="query"), st.encode(texts, prompt_name="query", convert_to_numpy=True))
