"""The engine loop under the server: a failing step, and the Python API while serving."""

from __future__ import annotations

import re

import httpx

from poolrunner.core.testing.server import ServerThread
from tests.conftest import SANITY_TEXT
from tests.helpers import MIN_COSINE, cosine_rows


def test_a_failing_step_fails_only_its_requests_and_the_loop_keeps_serving(runtime, monkeypatch, sanity_reference):
    real = runtime.engine.runner.execute
    calls = []

    def fails_once(batch):
        calls.append(batch)
        if len(calls) == 1:
            raise RuntimeError("simulated device failure")
        return real(batch)

    monkeypatch.setattr(runtime.engine.runner, "execute", fails_once)
    with ServerThread(runtime) as running, httpx.Client(base_url=running.url) as client:
        failed = client.post("/v1/embeddings", json={"input": ["first"]})
        assert failed.status_code == 500
        assert failed.json()["error"]["message"] == (
            "the engine step running this request failed: RuntimeError('simulated device failure')")
        assert running.serving.alive and running.serving.pending == 0 and not runtime.engine.requests
        vector = client.post("/v1/embeddings", json={"input": SANITY_TEXT}).json()["data"][0]["embedding"]
        assert cosine_rows(vector, sanity_reference)[0] >= MIN_COSINE


def test_the_python_api_goes_through_the_loop_while_serving(runtime, sanity_reference):
    with ServerThread(runtime) as running:
        assert cosine_rows(runtime.embed(SANITY_TEXT), sanity_reference)[0] >= MIN_COSINE
        metrics = httpx.get(f"{running.url}/metrics").text
        assert re.search(r"^poolrunner_batch_size_count 1\.0$", metrics, re.MULTILINE)  # the loop ran it
    # Detached at shutdown: the runtime drives its engine directly again.
    assert cosine_rows(runtime.embed(SANITY_TEXT), sanity_reference)[0] >= MIN_COSINE
