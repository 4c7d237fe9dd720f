"""Embeddings of real text equal sentence-transformers' on the same weights (fp32).

sentence-transformers strips text and silently truncates to ``max_seq_length`` (256 here);
poolrunner truncates only when asked, so the texts are stripped and ``truncate_prompt_tokens=-1``
is passed. Ten texts of three Lee documents each exceed 256 tokens, so truncation is exercised.
"""

from __future__ import annotations

import numpy as np
import pytest

import poolrunner
from poolrunner.core.testing.steps import record_steps
from tests.helpers import MIN_COSINE, cosine_rows


@pytest.fixture(scope="module")
def corpus(lee_docs, lee_long_docs) -> list[str]:
    # Interleave short and long texts so every batch mixes lengths.
    mixed = list(lee_docs)
    for i, text in enumerate(lee_long_docs):
        mixed.insert(5 * i + 2, text)
    return mixed


@pytest.fixture(scope="module")
def st_reference(st_model, corpus) -> np.ndarray:
    return st_model.encode(corpus, batch_size=16, convert_to_numpy=True)


def test_corpus_exercises_truncation(hf_tokenizer, corpus, lee_docs, st_model):
    lengths = [len(ids) for ids in hf_tokenizer(corpus)["input_ids"]]
    assert st_model.max_seq_length == 256
    assert sum(length > 256 for length in lengths) >= 8
    assert min(lengths) < 64 < 128 < max(len(ids) for ids in hf_tokenizer(lee_docs)["input_ids"]) <= 256


def test_lee_parity_with_sentence_transformers(runtime, corpus, st_reference):
    vectors = runtime.embed(corpus, truncate_prompt_tokens=-1)
    assert vectors.dtype == np.float32
    assert vectors.shape == (len(corpus), 384)
    cosines = cosine_rows(vectors, st_reference)
    assert cosines.min() >= MIN_COSINE, (cosines.argmin(), cosines.min())
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(vectors, st_reference, atol=2e-5)


def test_lee_parity_in_many_small_steps(corpus, st_reference):
    small = poolrunner.Runtime(max_num_batched_tokens=512, max_num_seqs=3, dtype="float32")
    with record_steps(small) as log:
        vectors = small.embed(corpus, truncate_prompt_tokens=-1)
    steps = [step.num_scheduled_tokens for step in log.steps]
    cosines = cosine_rows(vectors, st_reference)
    assert cosines.min() >= MIN_COSINE, (cosines.argmin(), cosines.min())
    ran = [s for s in steps if s]
    assert sum(len(s) for s in ran) == len(corpus)
    assert len(ran) >= len(corpus) // 3
    assert all(len(s) <= 3 and sum(s) <= 512 for s in ran)
    assert any(len(s) > 1 for s in ran)  # batching happened, not one request per step


def test_single_text_returns_one_vector(runtime, st_model, lee_docs):
    vector = runtime.embed(lee_docs[7])
    assert vector.shape == (384,)
    assert cosine_rows(vector, st_model.encode(lee_docs[7]))[0] >= MIN_COSINE


def test_token_id_inputs_match_text_inputs(runtime, hf_tokenizer, lee_docs, st_model):
    texts = lee_docs[:4]
    ids = [list(row) for row in hf_tokenizer(texts)["input_ids"]]
    from_ids = runtime.embed(ids)
    assert cosine_rows(from_ids, st_model.encode(texts)).min() >= MIN_COSINE
