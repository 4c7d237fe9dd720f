"""Decoder families (Llama, Qwen2, Qwen3, GPT-2) on every task their head allows, against transformers.

Seeded random tiny folders (hidden 64, 2 layers, vocab 1000, 512 positions; pad == eos) from
``make_decoder_folder`` / ``make_classifier_folder``. References are transformers' own models over
right-padded batches with an attention mask, tokenized by the folder's own tokenizer:

* bare model and causal LM -> ``embed`` (LAST pooling, the default) and ``token_embed``;
* ``*ForSequenceClassification`` -> ``classify`` (GPT-2 here; Llama/Qwen are covered elsewhere);
* ``*ForTokenClassification`` -> ``token_classify`` (the default for that architecture).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers import cosine_rows

# As conftest.DECODER_FAMILIES (test modules do not import conftest).
DECODER_FAMILIES = ("llama", "qwen2", "qwen3", "gpt2")
EMBED_HEADS = ("model", "causal_lm")
PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "gpt2": "GPT2"}
CAUSAL_LM = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
             "gpt2": "GPT2LMHeadModel"}
HIDDEN = 64
# fp32 on both sides: the packed runtime and transformers' padded batch agree to ~1e-6.
ATOL = 1e-5


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def max_dev(got, expected) -> float:
    return float(np.abs(np.asarray(got, dtype=np.float64) - np.asarray(expected, dtype=np.float64)).max())


@pytest.fixture(scope="module")
def texts(word_texts) -> list[str]:
    """Seven texts of 1..30 tiny-vocabulary words: a right-padded batch of mixed lengths."""
    return word_texts(7, 11, 1, 30)


# --------------------------------------------------------------------------- embed (LAST)


@pytest.mark.parametrize("head", EMBED_HEADS)
@pytest.mark.parametrize("family", DECODER_FAMILIES)
def test_embed_pools_the_last_real_token(family, head, make_decoder_folder, task_runtime, token_reference, texts):
    folder = make_decoder_folder(family, head)
    rt = task_runtime(folder)
    assert rt.model_config.architecture == {"model": f"{PREFIX[family]}Model", "causal_lm": CAUSAL_LM[family]}[head]
    assert (rt.task, rt.model_config.pooling_type, rt.model_config.is_causal) == ("embed", "LAST", True)
    assert rt.model_config.model_tasks == {"embed", "token_embed"}

    ref = token_reference(folder)
    ids = ref.token_ids(texts)
    assert len({len(row) for row in ids}) > 3, "the reference batch must be right-padded"
    states, lengths = ref.padded(ids)
    expected = states[np.arange(len(ids)), lengths - 1]  # from the mask, never from the pad (== eos) id

    raw = rt.embed(texts, normalize=False)
    assert raw.shape == (len(texts), HIDDEN) and raw.dtype == np.float32
    assert max_dev(raw, expected) <= ATOL
    assert cosine_rows(raw, expected).min() >= 0.9999
    # Meaningful: the row before the last is a different vector.
    before = states[np.arange(len(ids)), lengths - 2]
    assert cosine_rows(raw, before).max() < 0.99

    normalized = rt.embed(texts)  # default: normalized
    np.testing.assert_allclose(np.linalg.norm(normalized, axis=1), 1.0, atol=1e-5)
    assert max_dev(normalized, expected / np.linalg.norm(expected, axis=1, keepdims=True)) <= 1e-6


@pytest.mark.parametrize("family", DECODER_FAMILIES)
def test_equal_length_batch_is_still_causal(family, make_decoder_folder, task_runtime, token_reference):
    """Two inputs with the same token count: no padding anywhere, so a runtime that builds the
    causal mask only for padded batches would attend to future tokens here."""
    folder = make_decoder_folder(family, "model")
    ref = token_reference(folder)
    # Same length, shared 3-token prefix; the second holds the pad/eos id 2 mid-prompt.
    ids = [[1, 17, 230, 45, 9, 300, 71], [1, 17, 230, 2, 412, 7, 88]]
    alone = [ref.alone(row) for row in ids]

    embedded = task_runtime(folder).embed(ids, normalize=False)
    for vector, expected in zip(embedded, alone, strict=True):
        assert max_dev(vector, expected[-1]) <= ATOL

    tokens = task_runtime(folder, "token_embed").encode(ids)
    for rows, expected in zip(tokens, alone, strict=True):
        assert rows.shape == (7, HIDDEN)
        assert max_dev(rows, expected) <= ATOL
    # Causal: rows of the shared prefix cannot see the different suffixes, so they are equal...
    assert max_dev(tokens[0][:3], tokens[1][:3]) <= 1e-6
    # ...and the first differing token changes everything from there on.
    assert cosine_rows(tokens[0][3:], tokens[1][3:]).max() < 0.99


# --------------------------------------------------------------------------- token_embed (ALL)


@pytest.mark.parametrize("head", EMBED_HEADS)
@pytest.mark.parametrize("family", DECODER_FAMILIES)
def test_token_embed_is_last_hidden_state(family, head, make_decoder_folder, task_runtime, token_reference, texts):
    folder = make_decoder_folder(family, head)
    rt = task_runtime(folder, "token_embed")
    assert rt.task == "token_embed"
    ref = token_reference(folder)
    ids = ref.token_ids(texts)
    expected = ref.rows(ids)

    out = rt.encode(texts)
    assert isinstance(out, list) and len(out) == len(texts)
    assert [rows.shape for rows in out] == [(len(row), HIDDEN) for row in ids]  # the model's tokenizer
    for rows, want in zip(out, expected, strict=True):
        assert rows.dtype == np.float32
        assert max_dev(rows, want) <= ATOL
        assert cosine_rows(rows, want).min() >= 0.9999


# --------------------------------------------------------------------------- tokenizers that append EOS


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_last_pools_the_eos_the_tokenizer_appends(family, make_decoder_folder, task_runtime, token_reference,
                                                  texts):
    """A post-processor template ends every text with ``</s>`` (id 2, also the pad id): LAST
    pools the hidden state at that EOS position, found from the length, not from the pad id."""
    folder = make_decoder_folder(family, "model", append_eos=True)
    ref = token_reference(folder)
    ids = ref.token_ids(texts)
    assert all(row[-1] == 2 == ref.pad_id for row in ids)
    states, lengths = ref.padded(ids)
    at_eos = states[np.arange(len(ids)), lengths - 1]
    before_eos = states[np.arange(len(ids)), lengths - 2]

    raw = task_runtime(folder).embed(texts, normalize=False)
    assert max_dev(raw, at_eos) <= ATOL
    assert cosine_rows(raw, before_eos).max() < 0.99

    tokens = task_runtime(folder, "token_embed").encode(texts)
    assert [rows.shape[0] for rows in tokens] == [len(row) for row in ids]  # EOS row included
    for rows, vector in zip(tokens, raw, strict=True):
        assert max_dev(rows[-1], vector) <= 1e-6


# --------------------------------------------------------------------------- classify (GPT-2)


@pytest.mark.parametrize("variant", ["multiclass", "single", "multilabel"])
def test_gpt2_sequence_classification(variant, make_classifier_folder, classifier_runtime, classifier_reference,
                                      texts):
    folder = make_classifier_folder("gpt2", variant)
    rt = classifier_runtime(folder)
    assert rt.model_config.architecture == "GPT2ForSequenceClassification"
    assert (rt.task, rt.model_config.pooling_type) == ("classify", "LAST")
    ref = classifier_reference(folder)
    assert ref.config.pad_token_id == 2  # GPT2ForSequenceClassification needs it for padded batches
    expected = ref.scores(texts)

    results = rt.classify(texts)
    assert [r.labels for r in results] == [rt.model_config.labels] * len(texts)
    assert rt.model_config.labels == tuple(ref.config.id2label[i] for i in range(ref.config.num_labels))
    got = np.stack([r.probs for r in results])
    np.testing.assert_allclose(got, expected, rtol=2e-3, atol=1e-6)
    assert max_dev(got, expected) <= 1e-5
    assert np.ptp(got, axis=0).max() > 1e-2, "inputs must score differently for the check to mean anything"


# --------------------------------------------------------------------------- token_classify


@pytest.mark.parametrize("family", DECODER_FAMILIES)
def test_token_classification(family, make_decoder_folder, task_runtime, token_reference, texts):
    folder = make_decoder_folder(family, "token")
    rt = task_runtime(folder)
    ref = token_reference(folder, "AutoModelForTokenClassification")
    assert rt.model_config.architecture == f"{PREFIX[family]}ForTokenClassification"
    assert rt.task == "token_classify"  # the default of a *ForTokenClassification architecture
    num_labels = ref.config.num_labels
    assert num_labels == 5
    assert rt.model_config.labels == tuple(ref.config.id2label[i] for i in range(num_labels))
    ids = ref.token_ids(texts)
    logits = ref.rows(ids)

    probs = rt.encode(texts)
    assert [p.shape for p in probs] == [(len(row), num_labels) for row in ids]
    for got, want in zip(probs, logits, strict=True):
        np.testing.assert_allclose(got.sum(1), 1.0, atol=1e-5)
        assert max_dev(got, softmax(want)) <= 3e-2  # the field's bar...
        assert max_dev(got, softmax(want)) <= 1e-5  # ...and what fp32 actually gives
    assert max(p.max() for p in probs) > 0.6, "some token must lean clearly towards one label"

    raw = rt.encode(texts, use_activation=False)
    for got, want in zip(raw, logits, strict=True):
        assert max_dev(got, want) <= ATOL


# --------------------------------------------------------------------------- LongRoPE


@pytest.fixture(scope="module")
def longrope_folder(tmp_path_factory) -> Path:
    """A tiny Llama with Phi-3's LongRoPE: short factors up to 16 positions, long ones past them."""
    import torch
    import transformers

    from poolrunner.core.testing import tiny_models

    config = tiny_models.tiny_config("llama")
    half = config.hidden_size // config.num_attention_heads // 2
    config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
                              "short_factor": [1.0 + 0.1 * i for i in range(half)],
                              "long_factor": [2.0 + 0.5 * i for i in range(half)]}
    config.max_position_embeddings = 128
    torch.manual_seed(0)
    model = tiny_models.widen_weights(transformers.LlamaModel(config).eval())
    return tiny_models.save_tiny_folder(tmp_path_factory.mktemp("longrope"), "llama", model)


def test_longrope_serves_prompts_within_its_short_factors(longrope_folder, task_runtime, token_reference, word_texts,
                                                          caplog):
    """transformers rotates a whole pass with LongRoPE's long factors once any position passes
    ``original_max_position_embeddings``: a short prompt batched with a long one, or a long one's
    later chunks, would be rotated by what ran beside it. Prompts stop at the short factors'
    length, where every pass uses them, so each vector equals the prompt run alone."""
    import poolrunner
    from poolrunner.core.errors import ModelLoadError, PromptTooLongError

    with caplog.at_level("WARNING", logger="poolrunner.core.model.metadata"):
        rt = task_runtime(longrope_folder, max_num_batched_tokens=8)
    assert rt.model_config.max_model_len == 16
    assert "max_model_len 16, the LongRoPE short factors' positions" in caplog.text
    ref = token_reference(longrope_folder)
    texts = [t for t in word_texts(12, 5, 1, 12) if len(ref.token_ids([t])[0]) <= 16]
    assert max(len(ids) for ids in ref.token_ids(texts)) > 8, "a prompt must run in chunks"
    got = rt.encode(texts, task="token_embed")
    for text, states in zip(texts, got, strict=True):
        assert max_dev(states, ref.alone(ref.token_ids([text])[0])) <= ATOL

    long_text = " ".join(f"w{i}" for i in range(20))
    with pytest.raises(PromptTooLongError, match=r"has 2\d tokens, more than the maximum of 16"):
        rt.embed([long_text])
    assert rt.embed(texts[:1]).shape == (1, HIDDEN)  # the next request is served
    with pytest.raises(ModelLoadError, match=r"max_model_len=32 exceeds the 16 positions of .*LongRoPE short factors"):
        poolrunner.Runtime(longrope_folder, dtype="float32", max_model_len=32)
