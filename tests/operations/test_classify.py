"""``classify`` on every surface, same inputs, same answers: ``Runtime.classify``, ``poolrunner
classify``, vLLM's ``/classify`` and ``/pooling`` (``task: classify``) and TEI's ``/predict``;
probabilities, raw logits and (text, text_pair) pairs. Same labels, same probabilities, and
the probabilities are transformers' logits through the softmax."""

from __future__ import annotations

import json

import pytest

from poolrunner.core.testing.server import ServerThread
from tests.operations.surfaces import assert_close, cli_records, post

TEXTS = ["w1 w22 w333", "w10 w20 w30 w40 w50 w60", "w7", "w994 w5 w77 w123 w456"]
PAIRS = [("w1 w2", "w3 w4 w5"), ("w100", "w200 w300"), ("w9 w8 w7 w6", "w5")]


@pytest.fixture(scope="module")
def runtime(task_runtime, classifier_folder):
    return task_runtime(classifier_folder)


@pytest.fixture(scope="module")
def server(runtime):
    with ServerThread(runtime) as running:
        yield running


def _check(results, labels, values):
    """``results`` (the API's) have these best ``labels`` and per-label ``values``."""
    assert [result.label for result in results] == labels
    assert_close(values, [result.probs for result in results])


@pytest.mark.parametrize("raw", [False, True], ids=["probs", "raw-logits"])
def test_every_surface_gives_the_api_labels_and_scores(runtime, server, classifier_folder, tmp_path, raw):
    results = runtime.classify(TEXTS, use_activation=False if raw else None)
    label_names = list(results[0].labels)

    key = "logits" if raw else "probs"
    records = cli_records(["classify", "--model", str(classifier_folder), *(["--raw-logits"] if raw else []), *TEXTS],
                          tmp_path / "out.jsonl")
    assert [list(record[key]) for record in records] == [label_names] * len(TEXTS)
    _check(results, [r["label"] for r in records], [list(r[key].values()) for r in records])

    activation = {"use_activation": False} if raw else {}
    answer = post(server.url, "/classify", {"input": TEXTS, **activation})
    _check(results, [item["label"] for item in answer["data"]], [item["probs"] for item in answer["data"]])
    assert {item["num_classes"] for item in answer["data"]} == {len(label_names)}
    pooling = post(server.url, "/pooling", {"input": TEXTS, "task": "classify", **activation})
    assert_close([item["data"] for item in pooling["data"]], [result.probs for result in results])

    predictions = post(server.url, "/predict", {"inputs": [[text] for text in TEXTS], "raw_scores": raw})
    for result, ranked in zip(results, predictions, strict=True):  # TEI: every label, best first
        assert ranked[0]["label"] == result.label
        by_label = {item["label"]: item["score"] for item in ranked}
        assert_close([by_label[name] for name in label_names], result.probs)


def test_pairs_give_the_same_scores_on_every_surface(runtime, server, classifier_folder, tmp_path):
    results = runtime.classify(PAIRS)
    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text("".join(json.dumps({"text": a, "pair": b}) + "\n" for a, b in PAIRS), encoding="utf-8")
    records = cli_records(["classify", "--model", str(classifier_folder), "--input", str(pairs_file),
                           "--pair-field", "pair"], tmp_path / "out.jsonl")
    _check(results, [r["label"] for r in records], [list(r["probs"].values()) for r in records])
    answer = post(server.url, "/classify", {"input": [list(pair) for pair in PAIRS]})
    _check(results, [item["label"] for item in answer["data"]], [item["probs"] for item in answer["data"]])
    predictions = post(server.url, "/predict", {"inputs": [list(pair) for pair in PAIRS]})
    assert [ranked[0]["label"] for ranked in predictions] == [result.label for result in results]


def test_the_api_probabilities_are_transformers_softmax(runtime, classifier_reference, classifier_folder):
    """Pairs as tuples, or as ``[text, text_pair]`` lists as sentence-transformers'
    ``CrossEncoder.predict`` takes them."""
    reference = classifier_reference(classifier_folder)
    for inputs, sent in ((TEXTS, TEXTS), (PAIRS, PAIRS), (PAIRS, [list(pair) for pair in PAIRS])):
        results = runtime.classify(sent)
        expected = reference.scores(inputs)
        assert_close([result.probs for result in results], expected)
        names = [reference.config.id2label[i] for i in expected.argmax(1)]
        assert [result.label for result in results] == names
