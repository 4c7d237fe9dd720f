"""SPLADE over HTTP and the command line: the real server (poolrunner.core.testing.server) and
``poolrunner encode`` against the offline API on splade-tiny, with the installed plugin.

The offline results are checked against transformers in test_splade_reference.py; here /pooling
must return the same int64 ``token_ids`` and float32 ``weights`` as ``Runtime.encode``, and
/score and /rerank the same scores as ``Runtime.score``, which is the sparse dot product of the
two texts' SPLADE vectors.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from splade_folders import sparse_encoder_folder, splade_tiny_folder

import poolrunner
from poolrunner.core import hookimpl
from poolrunner.core.cli.main import main
from poolrunner.core.testing.server import ServerThread

QUERY = "what is the capital of france"
DOCUMENTS = ["Paris is the capital and largest city of France.", "The cat sat on the mat.", "ok"]


@pytest.fixture(scope="module")
def splade_tiny() -> Path:
    return splade_tiny_folder()


class StepGate:
    """A test plugin that runs ``hold()`` (when set) as each step prepares its inputs, so a test
    can keep the engine loop busy with one step."""

    def __init__(self) -> None:
        self.hold: Callable[[], None] | None = None

    @hookimpl
    def prepare_inputs(self) -> None:
        if self.hold is not None:
            self.hold()


@pytest.fixture(scope="module")
def gate() -> StepGate:
    return StepGate()


@pytest.fixture(scope="module")
def sparse_encoder(tmp_path_factory, gate) -> poolrunner.Runtime:
    """splade-tiny as a sentence-transformers SparseEncoder folder: the installed plugin serves it,
    with sparse_embed as its default task; the gate holds steps when a test asks."""
    folder = sparse_encoder_folder(tmp_path_factory.mktemp("st") / "splade-tiny-st", "max")
    runtime = poolrunner.Runtime(folder, plugins=[gate], device="cpu", dtype="float32")
    assert runtime.task == "sparse_embed"
    return runtime


@pytest.fixture(scope="module")
def offline(sparse_encoder) -> dict[str, object]:
    """Computed before any server attaches its loop: the runtime drives its engine directly."""
    return {"encode": sparse_encoder.encode([QUERY, *DOCUMENTS]),
            "score": sparse_encoder.score(QUERY, DOCUMENTS),
            "nn": sparse_encoder.score([QUERY, DOCUMENTS[1]], DOCUMENTS[:2])}


@pytest.fixture(scope="module")
def server(sparse_encoder, offline):
    with ServerThread(sparse_encoder) as running:
        yield running


def _sparse_dot(left: dict[str, list], right: dict[str, list]) -> float:
    weights = dict(zip(left["token_ids"], left["weights"], strict=True))
    return sum(weights.get(token, 0.0) * weight for token, weight in zip(right["token_ids"], right["weights"],
                                                                             strict=True))


def test_pooling_returns_int_token_ids_equal_to_the_offline_encode(server, offline):
    body = httpx.post(f"{server.url}/pooling", json={"input": [QUERY, *DOCUMENTS]})
    assert body.status_code == 200
    data = body.json()["data"]
    for item, want in zip(data, offline["encode"], strict=True):
        assert set(item["data"]) == {"token_ids", "weights"}
        assert all(type(token) is int for token in item["data"]["token_ids"])  # JSON ints, not 2003.0
        assert item["data"]["token_ids"] == want["token_ids"].tolist()
        np.testing.assert_array_equal(np.array(item["data"]["weights"], dtype=np.float32), want["weights"])


def test_pooling_base64_is_little_endian_int64_token_ids_and_float32_weights(server, offline):
    body = httpx.post(f"{server.url}/pooling", json={"input": DOCUMENTS, "encoding_format": "base64"}).json()
    for item, want in zip(body["data"], offline["encode"][1:], strict=True):
        token_ids = np.frombuffer(base64.b64decode(item["data"]["token_ids"]), dtype="<i8")
        weights = np.frombuffer(base64.b64decode(item["data"]["weights"]), dtype="<f4")
        np.testing.assert_array_equal(token_ids, want["token_ids"])
        np.testing.assert_array_equal(weights, want["weights"])


def test_score_and_rerank_equal_the_offline_score_the_sparse_dot_product(server, offline):
    score = httpx.post(f"{server.url}/score", json={"text_1": QUERY, "text_2": DOCUMENTS})
    assert score.status_code == 200, score.text
    got = np.array([item["score"] for item in score.json()["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, offline["score"], rtol=1e-6)
    # A manual computation over the /pooling outputs: the dot product of the sparse vectors.
    pooled = [item["data"] for item in httpx.post(f"{server.url}/pooling",
                                                  json={"input": [QUERY, *DOCUMENTS]}).json()["data"]]
    np.testing.assert_allclose(got, [_sparse_dot(pooled[0], document) for document in pooled[1:]], rtol=1e-5)
    assert got[0] > got[1]  # the Paris document wins

    nn = httpx.post(f"{server.url}/score", json={"text_1": [QUERY, DOCUMENTS[1]], "text_2": DOCUMENTS[:2]}).json()
    np.testing.assert_allclose([item["score"] for item in nn["data"]], offline["nn"], rtol=1e-6)

    rerank = httpx.post(f"{server.url}/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2}).json()
    best = list(np.argsort(-offline["score"], kind="stable")[:2])
    assert [item["index"] for item in rerank["results"]] == best
    np.testing.assert_allclose([item["relevance_score"] for item in rerank["results"]], offline["score"][best],
                               rtol=1e-6)


def test_score_requests_share_engine_steps_with_other_clients(server, gate, offline, monkeypatch):
    """/score's requests go through the server's engine loop, batched with a concurrent /pooling."""
    release, first_step = threading.Event(), threading.Event()

    def held():
        first_step.set()
        assert release.wait(30)

    steps: list[int] = []
    on_step = server.app.state.metrics.on_step
    monkeypatch.setattr(server.app.state.metrics, "on_step", lambda num_reqs, num_tokens: (
        steps.append(num_reqs), on_step(num_reqs, num_tokens)))
    monkeypatch.setattr(gate, "hold", held)
    with ThreadPoolExecutor(3) as pool:
        blocker = pool.submit(httpx.post, f"{server.url}/pooling", json={"input": "ok"}, timeout=60)
        assert first_step.wait(30)  # the loop is busy with the blocker's step
        score = pool.submit(httpx.post, f"{server.url}/score", json={"text_1": QUERY, "text_2": DOCUMENTS[0]},
                            timeout=60)
        pooling = pool.submit(httpx.post, f"{server.url}/pooling", json={"input": DOCUMENTS[1]}, timeout=60)
        while server.serving.pending < 4:  # the blocker, /score's two texts, /pooling's one
            assert not (score.done() or pooling.done()), (score.result().text, pooling.result().text)
            threading.Event().wait(0.01)
        release.set()
        assert blocker.result().status_code == 200
        np.testing.assert_allclose(score.result().json()["data"][0]["score"], offline["score"][0], rtol=1e-6)
        assert pooling.result().json()["data"][0]["data"]["token_ids"] == offline["encode"][2]["token_ids"].tolist()
    assert steps == [1, 3]  # /score's two requests and /pooling's one in a single step


def test_top_k_over_pooling_equals_the_python_api(server, sparse_encoder):
    want = sparse_encoder.encode(QUERY, top_k=4)[0]
    answer = httpx.post(f"{server.url}/pooling", json={"input": QUERY, "top_k": 4})
    assert answer.status_code == 200, answer.text
    data = answer.json()["data"][0]["data"]
    assert data["token_ids"] == want["token_ids"].tolist() and len(data["token_ids"]) == 4
    np.testing.assert_array_equal(np.array(data["weights"], dtype=np.float32), want["weights"])


def test_the_openapi_schema_shows_top_k(server):
    schema = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]["PoolingHttpRequest"]
    field = schema["properties"]["top_k"]
    assert field["type"] == "integer"
    assert field["description"].startswith("Keep only the k largest sparse weights")
    assert "'sparse_embed'" in field["description"]


@pytest.mark.parametrize(("body", "message"), [
    ({"top_k": 40000}, "top_k=40000 exceeds the vocabulary size 30522 (top_k keeps the k largest sparse weights)"),
    ({"top_k": 0}, "option top_k=0 (plugin 'splade') must be at least 1"),
    ({"dimensions": 5}, "dimensions does not apply to task 'sparse_embed' (got 5)"),
])
def test_a_bad_option_on_pooling_is_a_400_and_the_server_keeps_serving(server, offline, body, message):
    answer = httpx.post(f"{server.url}/pooling", json={"input": QUERY, **body})
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == message
    again = httpx.post(f"{server.url}/pooling", json={"input": QUERY}).json()
    assert again["data"][0]["data"]["token_ids"] == offline["encode"][0]["token_ids"].tolist()


@pytest.mark.parametrize(("value", "shown"), [("5", "'5'"), (5.0, "5.0"), (True, "True")])
def test_a_mistyped_top_k_on_pooling_is_the_python_apis_400(server, offline, value, shown):
    answer = httpx.post(f"{server.url}/pooling", json={"input": QUERY, "top_k": value})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["message"], error["param"]) == (f"option top_k={shown} (plugin 'splade') must be an integer",
                                                  "top_k")
    again = httpx.post(f"{server.url}/pooling", json={"input": QUERY, "top_k": None}).json()  # null: left out
    assert again["data"][0]["data"]["token_ids"] == offline["encode"][0]["token_ids"].tolist()


def test_top_k_from_the_command_line(splade_tiny, capsys):
    want = poolrunner.Runtime(splade_tiny, task="sparse_embed", device="cpu", dtype="float32").encode(QUERY, top_k=6)
    argv = ["encode", "--model", str(splade_tiny), "--task", "sparse_embed", "--dtype", "float32", "--device", "cpu",
            "--option", "top_k=6", QUERY]
    assert main(argv) == 0
    [line] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert line["output"]["token_ids"] == want[0]["token_ids"].tolist()
    base = argv[:-3]  # without --option top_k=6 and the query
    assert main([*base, "--option", "top_k=0", QUERY]) == 2
    assert "option top_k=0 (plugin 'splade') must be at least 1" in capsys.readouterr().err
    assert main([*base, "--option", "top_k=5", "--option", "top_k=3", QUERY]) == 2
    assert "poolrunner: error: --option top_k is given twice (5 and 3): give it once" in capsys.readouterr().err


def test_encode_task_sparse_embed_from_the_command_line(splade_tiny, tmp_path, capsys):
    # A bare MLM folder defaults to embed: sparse_embed (declared by the plugin) must be asked for.
    runtime = poolrunner.Runtime(splade_tiny, task="sparse_embed", device="cpu", dtype="float32")
    expected = runtime.encode([QUERY, DOCUMENTS[0]])
    argv = ["encode", "--model", str(splade_tiny), "--task", "sparse_embed", "--dtype", "float32", "--device", "cpu",
            QUERY, DOCUMENTS[0]]
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["index"], line["task"]) for line in lines] == [(0, "sparse_embed"), (1, "sparse_embed")]
    for line, want in zip(lines, expected, strict=True):
        assert all(type(token) is int for token in line["output"]["token_ids"])
        assert line["output"]["token_ids"] == want["token_ids"].tolist()
        np.testing.assert_array_equal(np.array(line["output"]["weights"], dtype=np.float32), want["weights"])

    assert main([*argv, "--output", str(tmp_path / "out.npz")]) == 0
    with np.load(tmp_path / "out.npz") as archive:
        assert archive["0/token_ids"].dtype == np.int64
        np.testing.assert_array_equal(archive["1/token_ids"], expected[1]["token_ids"])
        np.testing.assert_array_equal(archive["1/weights"], expected[1]["weights"])


def test_encode_with_an_unknown_task_names_the_supported_ones(splade_tiny, capsys):
    assert main(["encode", "--model", str(splade_tiny), "--task", "sparse_embedd", "--dtype", "float32", "x"]) == 2
    error = capsys.readouterr().err
    assert "does not support task 'sparse_embedd'" in error
    assert "splade (poolrunner-splade " in error and "serves ['sparse_embed']" in error
