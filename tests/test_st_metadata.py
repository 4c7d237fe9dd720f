"""sentence-transformers folder layouts: poolrunner reads them as sentence-transformers runs them.

Folders are built in tmp from the MiniLM files with one variation each; the reference is
``SentenceTransformer(folder).encode`` on the same folder (loaded offline), or transformers
for a plain Hugging Face folder (which sentence-transformers would pool differently).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import poolrunner
from poolrunner import InvalidRequestError, ModelLoadError
from tests.helpers import MIN_COSINE, cosine_rows

TRANSFORMER = ("Transformer", "")
POOLING = ("Pooling", "1_Pooling")
MEAN = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False}
SBERT_256 = {"max_seq_length": 256, "do_lower_case": False}


def load_st(folder):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu")


@pytest.fixture(scope="module")
def texts(lee_docs) -> list[str]:
    return [lee_docs[2], "Short text.", lee_docs[17], "What is the capital of Australia?"]


def assert_matches_st(folder, texts, *, exact: bool = False, **embed_kwargs):
    rt = poolrunner.Runtime(folder, dtype="float32")
    st = load_st(folder)
    vectors = rt.embed(texts, **embed_kwargs)
    reference = st.encode(texts, convert_to_numpy=True)
    assert vectors.shape == reference.shape
    assert cosine_rows(vectors, reference).min() >= MIN_COSINE
    if exact:
        np.testing.assert_allclose(vectors, reference, rtol=1e-4, atol=1e-5)
    return rt, vectors


# --------------------------------------------------------------------------- plain HF folder


def test_plain_hf_folder_defaults_to_cls_normalized(make_minilm_folder, hf_tokenizer, hf_hidden, texts,
                                                     text_with_tokens):
    folder = make_minilm_folder("plain")
    rt = poolrunner.Runtime(folder, dtype="float32")
    config = rt.model_config
    assert (config.pooling_type, config.normalize, config.max_model_len) == ("CLS", True, 512)
    assert config.dense_layers == () and config.embedding_size == 384
    long_text = text_with_tokens(400, seed=21)  # beyond the default model's 256, within 512
    batch = [*texts, long_text]
    ids = [list(row) for row in hf_tokenizer(batch)["input_ids"]]
    states, _ = hf_hidden(ids)
    reference = states[:, 0].double().numpy()
    vectors = rt.embed(batch)
    assert cosine_rows(vectors, reference).min() >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    with pytest.raises(InvalidRequestError, match=r"^input 0 has 513 tokens, more than the maximum of 512 "):
        rt.embed(text_with_tokens(513, seed=22))
    assert cosine_rows(rt.embed(texts[:1]), reference[:1])[0] >= MIN_COSINE


# --------------------------------------------------------------------------- pooling modes


def test_cls_pooling_module(make_minilm_folder, texts):
    folder = make_minilm_folder("cls", modules=[TRANSFORMER, POOLING, ("Normalize", "2_Normalize")],
                                pooling={"pooling_mode": "cls"}, sbert_config=SBERT_256)
    rt, vectors = assert_matches_st(folder, texts)
    assert (rt.model_config.pooling_type, rt.model_config.normalize) == ("CLS", True)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_lasttoken_pooling_module(make_minilm_folder, texts):
    folder = make_minilm_folder("lasttoken", modules=[TRANSFORMER, POOLING],
                                pooling={"pooling_mode_lasttoken": True}, sbert_config=SBERT_256)
    rt, _ = assert_matches_st(folder, texts, exact=True)
    assert (rt.model_config.pooling_type, rt.model_config.normalize) == ("LAST", False)


def test_include_prompt_false_is_refused(make_minilm_folder):
    folder = make_minilm_folder("noprompt", modules=[TRANSFORMER, POOLING],
                                pooling={"pooling_mode": "mean", "include_prompt": False})
    with pytest.raises(ModelLoadError, match=r"1_Pooling/config\.json: include_prompt=false is not supported$"):
        poolrunner.Runtime(folder, dtype="float32")


def test_unsupported_module_type(make_minilm_folder):
    folder = make_minilm_folder("layernorm", modules=[TRANSFORMER, POOLING, ("LayerNorm", "2_LayerNorm")],
                                pooling=MEAN)
    with pytest.raises(ModelLoadError,
                       match=r"sentence-transformers module 'sentence_transformers\.models\.LayerNorm' is not "
                             r"supported \(supported: Transformer, Pooling, Dense, Normalize\)$"):
        poolrunner.Runtime(folder, dtype="float32")


# --------------------------------------------------------------------------- Dense and Normalize


def test_dense_then_normalize(make_minilm_folder, texts):
    folder = make_minilm_folder(
        "dense_norm", modules=[TRANSFORMER, POOLING, ("Dense", "2_Dense"), ("Normalize", "3_Normalize")],
        pooling=MEAN, dense={"out_features": 128, "seed": 1}, sbert_config=SBERT_256,
    )
    rt, vectors = assert_matches_st(folder, texts, exact=True)
    config = rt.model_config
    assert (config.embedding_size, config.hidden_size, config.normalize) == (128, 384, True)
    assert [(d.in_features, d.out_features, d.activation) for d in config.dense_layers] == [(384, 128, "Tanh")]
    assert vectors.shape == (len(texts), 128)


def test_dense_without_normalize(make_minilm_folder, texts):
    folder = make_minilm_folder(
        "dense_raw", modules=[TRANSFORMER, POOLING, ("Dense", "2_Dense")], pooling=MEAN,
        dense={"out_features": 96, "seed": 2, "activation": "torch.nn.modules.linear.Identity", "bias": False},
        sbert_config=SBERT_256,
    )
    rt, vectors = assert_matches_st(folder, texts, exact=True)
    assert rt.model_config.normalize is False
    assert not np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3)
    # Matryoshka slicing applies after the Dense projection.
    sliced = poolrunner.Runtime(folder, is_matryoshka=True, dtype="float32").embed(texts, dimensions=32, normalize=True)
    np.testing.assert_allclose(sliced, vectors[:, :32] / np.linalg.norm(vectors[:, :32], axis=1, keepdims=True),
                               atol=1e-5)


def test_normalize_module_decides_the_default(make_minilm_folder, texts, st_model):
    without = make_minilm_folder("mean_raw", modules=[TRANSFORMER, POOLING], pooling=MEAN, sbert_config=SBERT_256)
    rt, raw = assert_matches_st(without, texts, exact=True)
    assert rt.model_config.normalize is False
    norms = np.linalg.norm(raw, axis=1)
    assert norms.min() > 1.5  # clearly unnormalized MiniLM means
    # The per-request switch gives the normalized pipeline's output.
    normed = rt.embed(texts, normalize=True)
    np.testing.assert_allclose(normed, st_model.encode(texts), atol=2e-5)
    # And the override at load time flips the default.
    assert poolrunner.Runtime(without, normalize=True, dtype="float32").model_config.normalize is True


@pytest.mark.parametrize("activation", ["os.system", "builtins.eval", "mypackage.nn.Tanh"])
def test_untrusted_activation_path(make_minilm_folder, activation):
    folder = make_minilm_folder("evil", modules=[TRANSFORMER, POOLING, ("Dense", "2_Dense")], pooling=MEAN,
                                dense={"out_features": 16, "activation": activation})
    with pytest.raises(ModelLoadError,
                       match=rf"2_Dense: Dense activation '{activation}' is not a torch\.nn class; "
                             r"refusing to load it$"):
        poolrunner.Runtime(folder, dtype="float32")


def test_activation_that_is_not_a_module_class(make_minilm_folder):
    folder = make_minilm_folder("fn_act", modules=[TRANSFORMER, POOLING, ("Dense", "2_Dense")], pooling=MEAN,
                                dense={"out_features": 16, "activation": "torch.nn.functional.relu"})
    with pytest.raises(ModelLoadError, match=r"2_Dense: activation 'relu' is not a torch\.nn module$"):
        poolrunner.Runtime(folder, dtype="float32")


def test_dense_after_normalize_is_refused(make_minilm_folder):
    # sentence-transformers would project the normalized vector; poolrunner normalizes last.
    folder = make_minilm_folder(
        "norm_dense", modules=[TRANSFORMER, POOLING, ("Normalize", "2_Normalize"), ("Dense", "3_Dense")],
        pooling=MEAN, dense={"out_features": 64, "path": "3_Dense"},
    )
    with pytest.raises(ModelLoadError, match=r"a Dense module after Normalize is not supported"):
        poolrunner.Runtime(folder, dtype="float32")


# --------------------------------------------------------------------------- lengths and prompts


def test_max_seq_length_caps_max_model_len(make_minilm_folder, lee_long_docs, text_with_tokens):
    folder = make_minilm_folder("len128", modules=[TRANSFORMER, POOLING, ("Normalize", "2_Normalize")],
                                pooling=MEAN, sbert_config={"max_seq_length": 128})
    rt = poolrunner.Runtime(folder, dtype="float32")
    assert rt.model_config.max_model_len == 128
    with pytest.raises(InvalidRequestError, match=r"^input 0 has 129 tokens, more than the maximum of 128 "):
        rt.embed(text_with_tokens(129, seed=31))
    st = load_st(folder)
    assert st.max_seq_length == 128
    texts = [lee_long_docs[1], "short"]
    vectors = rt.embed(texts, truncate_prompt_tokens=-1)
    assert cosine_rows(vectors, st.encode(texts)).min() >= MIN_COSINE


def test_prompts_from_the_config(make_minilm_folder, texts):
    folder = make_minilm_folder(
        "prompts", modules=[TRANSFORMER, POOLING, ("Normalize", "2_Normalize")], pooling=MEAN,
        sbert_config=SBERT_256,
        st_config={"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": "query"},
    )
    rt = poolrunner.Runtime(folder, dtype="float32")
    assert dict(rt.model_config.prompts) == {"query": "query: ", "passage": "passage: "}
    assert rt.model_config.default_prompt_name == "query"
    st = load_st(folder)
    default = rt.embed(texts)
    assert cosine_rows(default, st.encode(texts)).min() >= MIN_COSINE
    assert cosine_rows(default, st.encode(texts, prompt_name="query")).min() >= MIN_COSINE
    passage = rt.embed(texts, prompt_name="passage")
    assert cosine_rows(passage, st.encode(texts, prompt_name="passage")).min() >= MIN_COSINE
    literal = rt.embed(texts, prompt="custom: ")
    assert cosine_rows(literal, st.encode(texts, prompt="custom: ")).min() >= MIN_COSINE
    assert cosine_rows(passage, default).max() < 0.9999  # the prompts really differ
    with pytest.raises(InvalidRequestError,
                       match=r"^prompt_name 'doc' is not defined by model .*; defined: \['passage', 'query'\]$"):
        rt.embed(texts, prompt_name="doc")
    assert cosine_rows(rt.embed(texts), default).min() >= MIN_COSINE


def test_unknown_default_prompt_name_is_refused_at_load(make_minilm_folder):
    folder = make_minilm_folder("bad_default", modules=[TRANSFORMER, POOLING], pooling=MEAN,
                                st_config={"prompts": {"query": "q: "}, "default_prompt_name": "passage"})
    with pytest.raises(ModelLoadError, match=r"default_prompt_name 'passage'.*\['query'\]"):
        poolrunner.Runtime(folder, dtype="float32")


# --------------------------------------------------------------------------- saved by sentence-transformers


def test_folder_saved_by_sentence_transformers(st_model, tmp_path, texts):
    # The installed sentence-transformers writes its current module paths into modules.json
    # (e.g. sentence_transformers.base.modules.dense.Dense), not sentence_transformers.models.*.
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize

    torch.manual_seed(5)
    dense = Dense(384, 48, activation_function=torch.nn.Tanh())
    built = SentenceTransformer(modules=[st_model[0], st_model[1], dense, Normalize()], device="cpu")
    built.save(str(tmp_path / "saved"))
    rt, vectors = assert_matches_st(tmp_path / "saved", texts, exact=True)
    assert rt.model_config.embedding_size == 48 and rt.model_config.max_model_len == 256
    assert vectors.shape == (len(texts), 48)
