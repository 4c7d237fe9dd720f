"""The scoring API: ``Runtime.score`` and ``Runtime.rerank`` on a bi-encoder and a cross-encoder.

Bi-encoder scores are compared with the cosine of sentence-transformers embeddings of the same
model; cross-encoder scores with themselves under other batch compositions (their parity with
sentence-transformers' CrossEncoder is in ``test_cross_encoder_quality.py``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from poolrunner import InvalidRequestError, Runtime, UnsupportedTaskError

SENTENCES = [
    "A man is playing a guitar on the stage.",
    "Someone performs music in front of an audience.",
    "The stock market fell sharply on Monday.",
    "Shares dropped at the start of the week.",
    "Bushfires are burning out of control near Sydney.",
    "Firefighters battle blazes in New South Wales.",
]
QUERY = "Fires threaten homes in Australia."
# Cross-encoder pairs of very different lengths (a batch of mixed lengths).
PAIRS = [
    ("Who won the cricket match?", "Australia beat South Africa by 246 runs at the Adelaide Oval."),
    ("Bushfires near Sydney", "Hot, dry winds fanned more than 100 fires across New South Wales on Christmas Day, "
     "destroying homes in the Blue Mountains and forcing thousands of residents to leave."),
    ("Middle East violence", "Israeli troops entered the West Bank town."),
    ("A short query", "Short."),
    ("Economy", "The Reserve Bank left interest rates unchanged " * 8),
]


# --------------------------------------------------------------------------- bi-encoder


@pytest.fixture(scope="module")
def st_cosine(st_model) -> Callable[[list[tuple[str, str]]], np.ndarray]:
    """Cosine of sentence-transformers' fp32 embeddings of each (query, document) pair, float64."""

    def cosine(pairs: list[tuple[str, str]]) -> np.ndarray:
        left = st_model.encode([q for q, _ in pairs], convert_to_numpy=True).astype(np.float64)
        right = st_model.encode([d for _, d in pairs], convert_to_numpy=True).astype(np.float64)
        return (left * right).sum(1) / (np.linalg.norm(left, axis=1) * np.linalg.norm(right, axis=1))

    return cosine


BI_ENCODER_SHAPES: dict[str, tuple[Any, Any, list[tuple[str, str]]]] = {
    "1:1 strings": (SENTENCES[0], SENTENCES[1], [(SENTENCES[0], SENTENCES[1])]),
    "1:1 lists": ([SENTENCES[2]], [SENTENCES[3]], [(SENTENCES[2], SENTENCES[3])]),
    "1:N": (QUERY, SENTENCES, [(QUERY, s) for s in SENTENCES]),
    "1-item list:N": ([QUERY], SENTENCES, [(QUERY, s) for s in SENTENCES]),
    "N:N": (SENTENCES[::2], SENTENCES[1::2], list(zip(SENTENCES[::2], SENTENCES[1::2], strict=True))),
}


@pytest.mark.parametrize("shape", list(BI_ENCODER_SHAPES))
def test_bi_encoder_score_is_sentence_transformers_cosine(shape, runtime, st_cosine):
    queries, documents, pairs = BI_ENCODER_SHAPES[shape]
    scores = runtime.score(queries, documents)
    assert runtime.task == "embed"
    single = isinstance(queries, str) and isinstance(documents, str)  # one pair: a scalar, as CrossEncoder.predict
    assert scores.dtype == np.float32 and scores.shape == (() if single else (len(pairs),))
    np.testing.assert_allclose(scores, st_cosine(pairs), rtol=0, atol=1e-5)


def test_bi_encoder_rerank_orders_by_cosine(runtime, st_cosine):
    expected = st_cosine([(QUERY, s) for s in SENTENCES])
    results = runtime.rerank(QUERY, SENTENCES)
    assert [r.index for r in results] == list(np.argsort(-expected, kind="stable"))
    np.testing.assert_allclose([r.score for r in results], np.sort(expected)[::-1], atol=1e-5)
    assert results[0].index in (4, 5)  # the two bushfire sentences lead


# --------------------------------------------------------------------------- request errors

ERRORS: dict[str, tuple[str, tuple[Any, ...], dict[str, Any], str]] = {
    "empty queries": ("score", ([], ["a document"]), {}, "queries is empty: scoring needs at least one of each"),
    "empty documents": ("score", ("a query", []), {}, "documents is empty: scoring needs at least one of each"),
    "2 queries vs 3 documents": (
        "score", (["q1", "q2"], ["d1", "d2", "d3"]), {},
        "cannot score 2 queries against 3 documents: use 1:1, 1:N (one query) or N:N (equal lengths)",
    ),
    "non-string document": ("score", ("a query", ["fine", 7]), {}, "documents[1] must be a string, got 7"),
    "non-string query in a list": ("score", (["q1", None], ["d1", "d2"]), {}, "queries[1] must be a string, got None"),
    "a number for documents": ("score", ("a query", 7), {}, "documents must be a string or a list of strings, got 7"),
    "None for queries": ("score", (None, ["d1"]), {}, "queries must be a string or a list of strings, got None"),
    "bytes for documents": ("score", ("a query", b"abc"), {},
                            "documents must be a string or a list of strings, got b'abc'"),
    "rerank a number for documents": ("rerank", ("a query", 7), {}, "documents must be a list of strings, got 7"),
    "rerank top_n=0": ("rerank", ("a query", ["d1", "d2"]), {"top_n": 0}, "top_n must be a positive integer, got 0"),
    "rerank top_n=-1": ("rerank", ("a query", ["d1", "d2"]), {"top_n": -1},
                        "top_n must be a positive integer, got -1"),
    "rerank top_n=True": ("rerank", ("a query", ["d1", "d2"]), {"top_n": True},
                          "top_n must be a positive integer, got True"),
    "rerank documents as one string": ("rerank", ("a query", "one document"), {},
                                       "documents must be a list of strings, not one string"),
    "rerank non-string query": ("rerank", (["a query"], ["d1"]), {}, "query must be a string, got ['a query']"),
    "rerank no documents": ("rerank", ("a query", []), {}, "documents is empty: scoring needs at least one of each"),
    "embed's dimensions on score": (
        "score", ("a query", ["d1"]), {"dimensions": 128},
        "request field 'dimensions' does not apply to ScoreRequest (it takes ['activation', 'add_special_tokens', "
        "'documents', 'lora', 'max_tokens_per_doc', 'prompt', 'prompt_name', 'queries', 'sides', "
        "'truncate_prompt_tokens', 'truncation_side', 'use_activation'] and the plugins' request options)"),
}


@pytest.fixture(scope="module")
def ce_runtime(lee_cross_encoder, classifier_runtime) -> Runtime:
    return classifier_runtime(lee_cross_encoder.folder)


@pytest.mark.parametrize("case", list(ERRORS))
def test_bi_encoder_rejects_bad_requests(case, runtime, assert_serves):
    method, args, kwargs, message = ERRORS[case]
    with pytest.raises(InvalidRequestError) as caught:
        getattr(runtime, method)(*args, **kwargs)
    assert str(caught.value) == message
    assert_serves(runtime)


@pytest.mark.parametrize("case", list(ERRORS))
def test_cross_encoder_rejects_bad_requests(case, ce_runtime, poolrunner_step_recorder):
    before = ce_runtime.score(*PAIRS[0])
    log = poolrunner_step_recorder(ce_runtime)
    method, args, kwargs, message = ERRORS[case]
    with pytest.raises(InvalidRequestError) as caught:
        getattr(ce_runtime, method)(*args, **kwargs)
    assert str(caught.value) == message
    assert not log.in_flight
    np.testing.assert_allclose(ce_runtime.score(*PAIRS[0]), before, rtol=1e-6)


# --------------------------------------------------------------------------- rerank options


def test_top_n_larger_than_the_list_returns_all(runtime):
    results = runtime.rerank(QUERY, SENTENCES, top_n=100)
    assert sorted(r.index for r in results) == list(range(len(SENTENCES)))
    top = runtime.rerank(QUERY, SENTENCES, top_n=2)
    assert [(r.index, r.score) for r in top] == [(r.index, r.score) for r in results[:2]]


def test_return_documents(runtime):
    without = runtime.rerank(QUERY, SENTENCES)
    assert all(r.document is None for r in without)
    with_docs = runtime.rerank(QUERY, SENTENCES, return_documents=True)
    assert [r.document for r in with_docs] == [SENTENCES[r.index] for r in with_docs]
    assert [(r.index, r.score) for r in with_docs] == [(r.index, r.score) for r in without]


def test_ties_keep_input_order(runtime):
    """Duplicate documents score exactly alike and come back in their input order."""
    documents = [SENTENCES[2], SENTENCES[4], SENTENCES[2], SENTENCES[5], SENTENCES[4], SENTENCES[2]]
    results = runtime.rerank(QUERY, documents)
    score_of = {r.index: r.score for r in results}
    assert score_of[0] == score_of[2] == score_of[5] and score_of[1] == score_of[4]
    assert len(set(score_of.values())) == 3
    assert [r.index for r in results] == sorted(range(len(documents)), key=lambda i: (-score_of[i], i))
    assert [r.index for r in results][:2] == [1, 4]  # the bushfire duplicates lead, in input order


# --------------------------------------------------------------------------- unsupported models


def test_score_on_a_multi_label_classifier_is_unsupported(minilm_classifier_folder, classifier_runtime):
    runtime = classifier_runtime(minilm_classifier_folder(3))
    assert runtime.task == "classify" and len(runtime.model_config.labels) == 3
    message = ("score needs an embed model (bi-encoder) or a classify model with one label (cross-encoder); "
               "this runtime serves 'classify' with 3 labels, and no plugin scores 'classify' outputs "
               "(see `poolrunner plugins --hook score_outputs`).")
    for call in (lambda: runtime.score("a query", ["a document"]), lambda: runtime.rerank("a query", ["a doc"])):
        with pytest.raises(UnsupportedTaskError) as caught:
            call()
        assert str(caught.value) == message
    # It still classifies.
    result = runtime.classify("The market rallied.")[0]
    assert result.probs.shape == (3,) and abs(float(result.probs.sum()) - 1.0) < 1e-5


# --------------------------------------------------------------------------- cross-encoder


def test_cross_encoder_score_shapes(ce_runtime):
    queries, documents = [q for q, _ in PAIRS], [d for _, d in PAIRS]
    n_to_n = ce_runtime.score(queries, documents)
    assert n_to_n.dtype == np.float32 and n_to_n.shape == (len(PAIRS),)
    assert ((n_to_n > 0) & (n_to_n < 1)).all()  # sigmoid of one logit
    one_to_n = ce_runtime.score(queries[0], documents)
    np.testing.assert_allclose(ce_runtime.score([queries[0]], documents), one_to_n, rtol=0, atol=1e-6)
    np.testing.assert_allclose(one_to_n[0], n_to_n[0], rtol=0, atol=1e-6)
    one_to_one = ce_runtime.score(queries[1], documents[1])
    assert isinstance(one_to_one, np.float32)  # a scalar for one pair, as sentence-transformers' CrossEncoder.predict
    np.testing.assert_allclose(one_to_one, n_to_n[1], rtol=0, atol=1e-6)


def test_cross_encoder_is_batch_invariant(ce_runtime):
    """The same pair alone, in a mixed-length batch, next to a duplicate and shuffled scores alike
    (raw logits, the most sensitive output)."""
    queries, documents = [q for q, _ in PAIRS], [d for _, d in PAIRS]
    batch = ce_runtime.score(queries, documents, use_activation=False)
    alone = np.array([ce_runtime.score(q, d, use_activation=False) for q, d in PAIRS])
    order = list(range(len(PAIRS)))
    random.Random(3).shuffle(order)
    assert order != sorted(order)
    shuffled = ce_runtime.score([queries[i] for i in order], [documents[i] for i in order], use_activation=False)
    doubled = ce_runtime.score(queries + queries, documents + documents, use_activation=False)
    np.testing.assert_allclose(batch, alone, rtol=0, atol=1e-5)
    np.testing.assert_allclose(shuffled, batch[order], rtol=0, atol=1e-5)
    np.testing.assert_allclose(doubled, np.concatenate([batch, batch]), rtol=0, atol=1e-5)
    assert np.ptp(batch) > 0.05  # distinct pairs give distinct scores: the comparison means something


def test_cross_encoder_rerank_sorts_its_scores(ce_runtime):
    query, documents = PAIRS[1][0], [d for _, d in PAIRS]
    scores = ce_runtime.score(query, documents)
    results = ce_runtime.rerank(query, documents, top_n=3, return_documents=True)
    assert [r.index for r in results] == list(np.argsort(-scores, kind="stable")[:3])
    np.testing.assert_allclose([r.score for r in results], np.sort(scores)[::-1][:3], rtol=0, atol=1e-6)
    assert [r.document for r in results] == [documents[r.index] for r in results]
    assert all(r.document is None for r in ce_runtime.rerank(query, documents, top_n=10))
