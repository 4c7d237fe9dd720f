"""A request that becomes more engine requests than ``--max-waiting-requests`` could never be
queued: a 413 naming the limit and its count, never the 429 that invites retrying (which a
queue merely busy now still answers, see test_load.py). A bi-encoder's score and rerank run the
query and each distinct document once (N+1, 2N for N:N), a long input runs as windows; a
cross-encoder runs one request per pair, which ``max_inputs_per_request`` already bounds."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from poolrunner import Runtime
from poolrunner.core.server import ServerSettings
from poolrunner.core.testing.server import ServerThread

QUERY = "Fires threaten homes in Australia."
DOCUMENTS = ["Shares dropped at the start of the week.", "Bushfires are burning out of control near Sydney.",
             "Someone performs music in front of an audience.", "Firefighters battle blazes in New South Wales."]
SETTINGS = ServerSettings(max_waiting_requests=4, max_inputs_per_request=4)


def _message(count: int) -> str:
    return (f"this request needs {count} engine requests (one per text the model runs: each input, each distinct "
            "text of a score or rerank, each window of a long input), more than the limit of 4 waiting or running "
            "at once (max_waiting_requests, the --max-waiting-requests flag): it could never be queued; send fewer "
            "inputs")


def _too_large(answer: httpx.Response, count: int) -> None:
    assert answer.status_code == 413, answer.text
    assert answer.json() == {"error": {"message": _message(count), "type": "request_too_large", "param": None,
                                       "code": 413}}


@pytest.fixture(scope="module")
def small_queue(runtime):
    """The default model (a bi-encoder), at most 4 engine requests waiting or running, 4 inputs a request."""
    with ServerThread(runtime, SETTINGS) as running:
        yield running


def test_a_rerank_that_can_never_fit_is_a_413_and_the_server_still_serves(small_queue, runtime):
    with httpx.Client(base_url=small_queue.url, timeout=60) as client:
        for path in ("/rerank", "/v1/rerank", "/v2/rerank", "/invocations"):
            _too_large(client.post(path, json={"query": QUERY, "documents": DOCUMENTS}), 5)  # the query and 4
        answer = client.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS[:3]})
        assert answer.status_code == 200, answer.text
        expected = runtime.rerank(QUERY, DOCUMENTS[:3])
        assert [r["index"] for r in answer.json()["results"]] == [r.index for r in expected]
        np.testing.assert_allclose([r["relevance_score"] for r in answer.json()["results"]],
                                   [r.score for r in expected], atol=1e-6)
        # 4 documents of which 3 distinct: the query and 3 texts fit
        assert client.post("/rerank", json={"query": QUERY, "documents": [*DOCUMENTS[:3], DOCUMENTS[0]]}
                           ).status_code == 200
        assert small_queue.serving.pending == 0


def test_a_score_that_can_never_fit_is_a_413(small_queue, runtime):
    with httpx.Client(base_url=small_queue.url, timeout=60) as client:
        _too_large(client.post("/score", json={"queries": QUERY, "documents": DOCUMENTS}), 5)
        _too_large(client.post("/score", json={"queries": DOCUMENTS[:3], "documents": [QUERY, "a", "b"]}), 6)  # N:N
        answer = client.post("/score", json={"queries": DOCUMENTS[:2], "documents": DOCUMENTS[2:]})
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose([item["score"] for item in answer.json()["data"]],
                                   runtime.score(DOCUMENTS[:2], DOCUMENTS[2:]), atol=1e-6)


def test_a_tei_rerank_that_can_never_fit_is_a_413_in_tei_shape(small_queue):
    answer = httpx.post(f"{small_queue.url}/rerank", json={"query": QUERY, "texts": DOCUMENTS}, timeout=60)
    assert (answer.status_code, answer.json()) == (413, {"error": _message(5), "error_type": "Validation"})
    assert httpx.post(f"{small_queue.url}/rerank", json={"query": QUERY, "texts": DOCUMENTS[:3]},
                      timeout=60).status_code == 200


def test_a_cross_encoder_runs_one_request_per_pair(minilm_classifier_folder, classifier_runtime):
    runtime = classifier_runtime(minilm_classifier_folder(1))
    with ServerThread(runtime, SETTINGS) as running:
        answer = httpx.post(f"{running.url}/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert [r["index"] for r in answer.json()["results"]] == [r.index for r in runtime.rerank(QUERY, DOCUMENTS)]


def test_long_inputs_whose_windows_can_never_fit_are_a_413(lee_long_docs):
    runtime = Runtime(dtype="float32", max_embed_len=1000, load_entrypoints=False)
    text = " ".join(lee_long_docs)[:3000]  # 3 windows of 256 tokens
    windows = -(-len(runtime.frontend.inputs.tokenizer(text)["input_ids"]) // 256)
    assert windows == 3
    with ServerThread(runtime, SETTINGS) as running, httpx.Client(base_url=running.url, timeout=60) as client:
        _too_large(client.post("/v1/embeddings", json={"input": [text, text]}), 6)
        tei = client.post("/embed", json={"inputs": [text, text], "truncate": False})  # windows, not TEI's cut
        assert (tei.status_code, tei.json()) == (413, {"error": _message(6), "error_type": "Validation"})
        answer = client.post("/v1/embeddings", json={"input": [text, "a short text"]})
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose([item["embedding"] for item in answer.json()["data"]],
                                   runtime.embed([text, "a short text"]), atol=1e-6)
