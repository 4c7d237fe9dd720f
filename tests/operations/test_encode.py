"""``encode`` (vLLM's generic pooling) on every surface, same inputs, same arrays:
``Runtime.encode(task=...)``, ``poolrunner encode --task``, vLLM's ``/pooling`` and TEI's
``/embed_all`` and ``/embed_sparse``; for ``embed`` and ``token_embed`` (with ``normalize`` and
truncation), ``token_classify`` (probabilities and raw logits) and a plugin's task with its
request option (SPLADE's ``sparse_embed``, ``top_k``: a keyword, ``--option top_k=N``, a body
field). Per-token results are transformers' own rows."""

from __future__ import annotations

import numpy as np
import pytest

from poolrunner.core.server import ServedModel
from poolrunner.core.testing.server import ServerThread
from tests.operations.surfaces import SPLADE, assert_close, assert_rows_close, cli_records, needs_splade, post

TEXTS = ["w1 w22 w333", "w10 w20 w30 w40 w50 w60", "w7", "w994 w5 w77 w123 w456"]


@pytest.fixture(scope="module")
def tokens(task_runtime, embed_folder):
    """A ``BertModel``'s runtime (``embed`` by default, ``token_embed`` too)."""
    return task_runtime(embed_folder)


@pytest.fixture(scope="module")
def ner(task_runtime, token_classifier_folder):
    return task_runtime(token_classifier_folder)


@pytest.fixture(scope="module")
def server(request, task_runtime, tokens, ner):
    models = [ServedModel(tokens, ("tokens",)), ServedModel(ner, ("ner",))]
    if SPLADE:
        models.append(ServedModel(task_runtime(request.getfixturevalue("splade_folder")), ("splade",)))
    with ServerThread(models) as running:
        yield running


def _cli_outputs(folder, argv, tmp_path):
    records = cli_records(["encode", "--model", str(folder), *argv, *TEXTS], tmp_path / "out.jsonl")
    assert [record["index"] for record in records] == list(range(len(TEXTS)))
    return [record["output"] for record in records]


def _pooling(server, body):
    return [item["data"] for item in post(server.url, "/pooling", {"input": TEXTS, **body})["data"]]


@pytest.mark.parametrize(("task", "api", "argv", "body"), [
    pytest.param("embed", {}, [], {}, id="embed"),
    pytest.param("token_embed", {}, [], {}, id="token_embed"),
    pytest.param("token_embed", {"normalize": True}, ["--normalize"], {"normalize": True}, id="token_embed-normalize"),
    pytest.param("token_embed", {"truncate_prompt_tokens": 3}, ["--truncate", "3"], {"truncate_prompt_tokens": 3},
                 id="token_embed-truncate"),
])
def test_embedding_tasks_answer_alike_everywhere(tokens, server, embed_folder, tmp_path, task, api, argv, body):
    expected = tokens.encode(TEXTS, task=task, **api)
    assert_rows_close(_cli_outputs(embed_folder, ["--task", task, *argv], tmp_path), expected)
    assert_rows_close(_pooling(server, {"model": "tokens", "task": task, **body}), expected)
    if task == "token_embed" and not api:  # TEI: every token's hidden state, unnormalized
        assert_rows_close(post(server.url, "/embed_all", {"inputs": TEXTS}), expected)


@pytest.mark.parametrize("raw", [False, True], ids=["probs", "raw-logits"])
def test_token_classify_answers_alike_everywhere(ner, server, token_classifier_folder, tmp_path, raw):
    expected = ner.encode(TEXTS, task="token_classify", use_activation=False if raw else None)
    assert [row.shape for row in expected] == [(len(text.split()) + 2, 5) for text in TEXTS]
    argv = ["--task", "token_classify", *(["--raw-logits"] if raw else [])]
    assert_rows_close(_cli_outputs(token_classifier_folder, argv, tmp_path), expected)
    body = {"model": "ner", "task": "token_classify", **({"use_activation": False} if raw else {})}
    assert_rows_close(_pooling(server, body), expected)


def test_per_token_results_are_transformers_rows(tokens, ner, token_reference, embed_folder,
                                                 token_classifier_folder):
    hidden = token_reference(embed_folder)
    assert_rows_close(tokens.encode(TEXTS, task="token_embed"), hidden.rows(hidden.token_ids(TEXTS)))
    classifier = token_reference(token_classifier_folder, "AutoModelForTokenClassification")
    logits = classifier.rows(classifier.token_ids(TEXTS))
    softmax = [np.exp(row - row.max(1, keepdims=True)) / np.exp(row - row.max(1, keepdims=True)).sum(1, keepdims=True)
               for row in logits]
    assert_rows_close(ner.encode(TEXTS, task="token_classify"), softmax)


def _sparse(outputs):
    """``{"token_ids", "weights"}`` per input as ``{token id: weight}``."""
    return [dict(zip(np.asarray(o["token_ids"]).tolist(), np.asarray(o["weights"]).tolist(), strict=True))
            for o in outputs]


def _assert_sparse_equal(actual, expected):
    for got, want in zip(_sparse(actual), _sparse(expected), strict=True):
        assert list(got) == list(want)  # same ids, same order
        assert_close(list(got.values()), list(want.values()))


@needs_splade
def test_a_plugin_task_and_its_request_option_answer_alike_everywhere(task_runtime, splade_folder, server, tmp_path):
    splade = task_runtime(splade_folder)
    expected = splade.encode(TEXTS, task="sparse_embed", top_k=3)
    assert [len(output["token_ids"]) for output in expected] == [3] * len(TEXTS)
    _assert_sparse_equal(_cli_outputs(splade_folder, ["--task", "sparse_embed", "--option", "top_k=3"], tmp_path),
                         expected)
    _assert_sparse_equal(_pooling(server, {"model": "splade", "task": "sparse_embed", "top_k": 3}), expected)

    # TEI's /embed_sparse: no top_k; every non-zero weight, by ascending token id
    every = _sparse(splade.encode(TEXTS, task="sparse_embed"))
    for entries, want in zip(post(server.url, "/embed_sparse", {"inputs": TEXTS}), every, strict=True):
        assert [entry["index"] for entry in entries] == sorted(want)
        assert_close([entry["value"] for entry in entries], [want[index] for index in sorted(want)])
