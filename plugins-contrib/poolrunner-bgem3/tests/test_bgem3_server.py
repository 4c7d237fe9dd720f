"""BGE-M3 over HTTP: the real server (poolrunner.core.testing.server) with the installed plugin.

``/pooling`` with ``task: m3_embed`` answers the sparse part as the aggregated map itself
(``{"token_ids", "weights"}``, one weight per distinct token id, as the reference in
m3_reference.py computes it), the same as ``Runtime.encode``; a bad ``outputs`` is a 400 naming
the plugin and the server serves on; ``/score`` on an ``m3_embed`` server is the offline
weighted score.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from bgem3_folders import HIDDEN, write_bgem3_folder
from m3_reference import M3Reference, combined_score

import poolrunner
from poolrunner.core.testing.server import ServerThread

TEXTS = ["the cat sat on the mat and the dog sat on the cat", "what is bge m3 ?", "price 12 €"]
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital and largest city of france", "the cat sat on the mat"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_bgem3_folder(tmp_path_factory.mktemp("bgem3") / "tiny-bge-m3")


@pytest.fixture(scope="module")
def runtime(folder) -> poolrunner.Runtime:
    return poolrunner.Runtime(folder, device="cpu", dtype="float32")  # entry points: the installed plugin


@pytest.fixture(scope="module")
def offline(runtime) -> list[dict[str, np.ndarray]]:
    """Computed before the server attaches its loop: the runtime drives its engine directly."""
    return runtime.encode(TEXTS, task="m3_embed")


@pytest.fixture(scope="module")
def server(runtime, offline):
    with ServerThread(runtime) as running:
        yield running


def test_pooling_returns_the_aggregated_sparse_map(server, offline, folder):
    answer = httpx.post(f"{server.url}/pooling", json={"input": TEXTS, "task": "m3_embed", "outputs": "sparse"})
    assert answer.status_code == 200, answer.text
    reference = M3Reference(folder)
    for item, want in zip(answer.json()["data"], offline, strict=True):
        assert set(item["data"]) == {"token_ids", "weights"}
        assert all(type(token) is int for token in item["data"]["token_ids"])
        assert len(set(item["data"]["token_ids"])) == len(item["data"]["token_ids"])  # one weight per id
        assert item["data"]["token_ids"] == want["token_ids"].tolist()
        np.testing.assert_array_equal(np.array(item["data"]["weights"], dtype=np.float32), want["weights"])
    for item, text in zip(answer.json()["data"], TEXTS, strict=True):
        expected = reference.encode(text)["lexical"]
        got = dict(zip(item["data"]["token_ids"], item["data"]["weights"], strict=True))
        assert set(got) == set(expected)
        np.testing.assert_allclose([got[token] for token in expected], list(expected.values()), atol=1e-5)


def test_pooling_returns_every_part_by_default(server, offline):
    answer = httpx.post(f"{server.url}/pooling", json={"input": TEXTS, "task": "m3_embed"}).json()
    for item, want in zip(answer["data"], offline, strict=True):
        assert list(item["data"]) == ["dense", "token_ids", "weights", "colbert"]
        assert np.array(item["data"]["colbert"]).shape == (want["colbert"].shape[0], HIDDEN)
        for name in ("dense", "weights", "colbert"):
            np.testing.assert_array_equal(np.array(item["data"][name], dtype=np.float32), want[name])


def test_a_bad_outputs_value_is_a_400_and_the_server_serves_on(server, offline):
    answer = httpx.post(f"{server.url}/pooling", json={"input": TEXTS[0], "task": "m3_embed", "outputs": "bm25"})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["message"], error["param"]) == (
        "option outputs='bm25' (plugin 'bgem3') must name parts among dense, sparse, colbert, comma-separated; "
        "'bm25' is not one", "outputs")
    again = httpx.post(f"{server.url}/pooling", json={"input": TEXTS[0], "task": "m3_embed", "outputs": "sparse"})
    assert again.json()["data"][0]["data"]["token_ids"] == offline[0]["token_ids"].tolist()


def test_the_openapi_schema_shows_the_options(server):
    schema = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]["PoolingHttpRequest"]
    assert schema["properties"]["outputs"]["type"] == "string"
    assert schema["properties"]["sparse_weight"]["type"] == "number"
    assert schema["properties"]["outputs"]["description"].startswith("The BGE-M3 parts to compute")


def test_score_on_an_m3_server_is_the_weighted_score(folder):
    m3 = poolrunner.Runtime(folder, task="m3_embed", device="cpu", dtype="float32")
    expected = m3.score(QUERY, DOCUMENTS)  # before the server attaches its loop
    reference = M3Reference(folder)
    query = reference.encode(QUERY)
    weights = {"dense": 0.4, "sparse": 0.2, "colbert": 0.4}
    np.testing.assert_allclose(expected, [combined_score(query, reference.encode(document), weights)
                                          for document in DOCUMENTS], rtol=1e-5, atol=1e-6)
    with ServerThread(m3) as running:
        score = httpx.post(f"{running.url}/score", json={"text_1": QUERY, "text_2": DOCUMENTS})
        assert score.status_code == 200, score.text
        np.testing.assert_allclose([item["score"] for item in score.json()["data"]], expected, rtol=1e-6)
        rerank = httpx.post(f"{running.url}/rerank", json={"query": QUERY, "documents": DOCUMENTS}).json()
        assert [item["index"] for item in rerank["results"]] == list(np.argsort(-expected, kind="stable"))


def test_score_and_rerank_take_the_weights_as_body_fields(folder):
    m3 = poolrunner.Runtime(folder, task="m3_embed", device="cpu", dtype="float32")
    reference = M3Reference(folder)
    query, documents = reference.encode(QUERY), [reference.encode(document) for document in DOCUMENTS]
    weights = {"dense": 0.1, "sparse": 0.7, "colbert": 0.2}
    expected = [combined_score(query, document, weights) for document in documents]
    card = {"dense": 0.4, "sparse": 0.2, "colbert": 0.4}  # the defaults
    defaults = [combined_score(query, document, card) for document in documents]
    assert not np.allclose(expected, defaults, rtol=1e-3)  # the fields must matter
    fields = {"dense_weight": 0.1, "sparse_weight": 0.7, "colbert_weight": 0.2}
    with ServerThread(m3) as running:
        score = httpx.post(f"{running.url}/score", json={"text_1": QUERY, "text_2": DOCUMENTS, **fields})
        assert score.status_code == 200, score.text
        np.testing.assert_allclose([item["score"] for item in score.json()["data"]], expected, rtol=1e-5, atol=1e-6)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            rerank = httpx.post(f"{running.url}{path}", json={"query": QUERY, "documents": DOCUMENTS, **fields})
            assert rerank.status_code == 200, rerank.text
            by_index = {item["index"]: item["relevance_score"] for item in rerank.json()["results"]}
            np.testing.assert_allclose([by_index[0], by_index[1]], expected, rtol=1e-5, atol=1e-6)
        refused = httpx.post(f"{running.url}/score", json={"text_1": QUERY, "text_2": DOCUMENTS, "dense_weight": "x"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "dense_weight"
        again = httpx.post(f"{running.url}/score", json={"text_1": QUERY, "text_2": DOCUMENTS, **fields})
        np.testing.assert_allclose([item["score"] for item in again.json()["data"]], expected, rtol=1e-5, atol=1e-6)
