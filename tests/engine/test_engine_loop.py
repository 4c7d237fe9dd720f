"""The engine loop under the server: a failing step, the Python API while serving, and ``priority``."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from poolrunner.core.server import ServerSettings
from poolrunner.core.testing.server import ServerThread
from tests.conftest import SANITY_TEXT
from tests.helpers import MIN_COSINE, cosine_rows


def test_a_failing_step_fails_only_its_requests_and_the_loop_keeps_serving(runtime, monkeypatch, sanity_reference):
    real = runtime._engine.runner.execute
    calls = []

    def fails_once(batch):
        calls.append(batch)
        if len(calls) == 1:
            raise RuntimeError("simulated device failure")
        return real(batch)

    monkeypatch.setattr(runtime._engine.runner, "execute", fails_once)
    with ServerThread(runtime) as running, httpx.Client(base_url=running.url) as client:
        failed = client.post("/v1/embeddings", json={"input": ["first"]})
        assert failed.status_code == 500
        assert failed.json()["error"]["message"] == (  # the cause only in the log (test_step_failure_answers)
            f"the engine step running this request failed (request id {failed.headers['x-request-id']}); the server "
            "logged the cause")
        assert running.serving.alive and running.serving.pending == 0 and not runtime._engine.requests
        vector = client.post("/v1/embeddings", json={"input": SANITY_TEXT}).json()["data"][0]["embedding"]
        assert cosine_rows(vector, sanity_reference)[0] >= MIN_COSINE


def test_the_python_api_goes_through_the_loop_while_serving(runtime, sanity_reference):
    with ServerThread(runtime) as running:
        assert cosine_rows(runtime.embed(SANITY_TEXT), sanity_reference)[0] >= MIN_COSINE
        metrics = httpx.get(f"{running.url}/metrics").text
        assert re.search(r"^poolrunner_batch_size_count 1\.0$", metrics, re.MULTILINE)  # the loop ran it
    # Detached at shutdown: the runtime drives its engine directly again.
    assert cosine_rows(runtime.embed(SANITY_TEXT), sanity_reference)[0] >= MIN_COSINE


def test_a_lower_priority_in_the_body_runs_first(runtime, monkeypatch):
    """vLLM's ``priority``: of two queued calls the lower value runs first, whatever their arrival."""
    first, gate = threading.Event(), threading.Event()
    execute = runtime._engine.runner.execute

    def held(batch):
        if not first.is_set():  # the first step holds the loop until both calls are queued
            first.set()
            assert gate.wait(30)
        return execute(batch)

    order: list[int] = []
    schedule = runtime._engine.scheduler.schedule

    def recording():
        out = schedule()
        order.extend(state.request.prompt_token_ids[1] for state in out.requests)
        return out

    monkeypatch.setattr(runtime._engine.runner, "execute", held)
    monkeypatch.setattr(runtime._engine.scheduler, "schedule", recording)
    with ServerThread(runtime, ServerSettings(scheduling_policy="priority")) as running, ThreadPoolExecutor(3) as pool:
        def post(marker: int, priority: int | None = None) -> httpx.Response:
            inputs = [[101, marker + i, 102] for i in range(3)]
            return httpx.post(f"{running.url}/v1/embeddings", json={"input": inputs, "priority": priority}, timeout=60)

        calls = [pool.submit(post, 4000)]
        assert first.wait(30)
        for marker, priority, pending in [(5000, 5, 4), (6000, -1, 7)]:
            calls.append(pool.submit(post, marker, priority))
            while running.serving.pending < pending:  # arrived, in this order
                time.sleep(0.01)
        gate.set()
        assert [call.result().status_code for call in calls] == [200] * 3
    assert order == [4000, 4001, 4002, 6000, 6001, 6002, 5000, 5001, 5002]
