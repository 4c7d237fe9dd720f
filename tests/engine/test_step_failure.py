"""A step that raises fails only the request that fails on its own: its requests are retried in
halves, the innocent finish with the answers they get alone (sentence-transformers' here), and
only the guilty one gets the error, whether the engine is driven directly or through the
serving loop many callers share."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import poolrunner
from poolrunner.core.errors import StepFailedError
from tests.helpers import MIN_COSINE, cosine_rows

GOOD = ["A cat sat on the mat.", "Paris is the capital of France.", "Rain is expected tomorrow.", "ok"]
POISON = "this text carries the poison token"


@pytest.fixture
def poisoned(monkeypatch):
    """A float32 runtime whose forward raises on any batch holding the token of "poison"."""
    runtime = poolrunner.Runtime(dtype="float32", load_entrypoints=False)
    token = runtime.inputs.tokenizer.convert_tokens_to_ids("poison")
    execute, batches = runtime._engine.runner.execute, []

    def guarded(batch):
        batches.append(batch.num_reqs)
        if (batch.input_ids == token).any():
            raise RuntimeError("poisoned batch")
        return execute(batch)

    monkeypatch.setattr(runtime._engine.runner, "execute", guarded)
    return runtime, batches


def test_the_innocent_in_a_failing_step_finish(poisoned, st_model):
    runtime, batches = poisoned
    requests = runtime.frontend.prepare([*GOOD[:2], POISON, *GOOD[2:]], runtime.frontend.params("embed"))
    for request in requests:
        runtime._engine.add_request(request)
    finished = dict(runtime._engine.step())
    assert batches[0] == 5 and len(batches) > 1  # one shared step, then smaller ones
    assert set(finished) == {r.request_id for r in requests} - {requests[2].request_id}
    [(failed_id, error)] = runtime._engine.take_failures()
    assert failed_id == requests[2].request_id and str(error) == "poisoned batch"
    vectors = np.stack([finished[r.request_id].numpy() for r in requests if r.request_id in finished])
    assert cosine_rows(vectors, st_model.encode(GOOD)).min() >= MIN_COSINE
    assert not runtime._engine.requests and not runtime._engine.take_failures()


def test_the_python_api_raises_the_guilty_error_and_still_serves(poisoned, st_model):
    runtime, _ = poisoned
    with pytest.raises(RuntimeError, match="^poisoned batch$"):
        runtime.embed([*GOOD, POISON])
    assert not runtime._engine.requests
    assert cosine_rows(runtime.embed(GOOD), st_model.encode(GOOD)).min() >= MIN_COSINE


def test_the_serving_loop_fails_only_the_guilty_submission(poisoned, st_model, monkeypatch):
    runtime, batches = poisoned
    execute = runtime._engine.runner.execute
    gate, first = threading.Event(), threading.Event()

    def held(batch):  # the first step waits, so that the callers below all join the next one
        if not first.is_set():
            first.set()
            assert gate.wait(30)
        return execute(batch)

    monkeypatch.setattr(runtime._engine.runner, "execute", held)

    async def main(serving):
        blocker = asyncio.ensure_future(serving.run(runtime.frontend.prepare(["blocker"],
                                                                            runtime.frontend.params("embed"))))
        await asyncio.get_running_loop().run_in_executor(None, first.wait, 30)
        calls = [serving.run(runtime.frontend.prepare([text], runtime.frontend.params("embed")))
                 for text in [*GOOD, POISON]]
        tasks = [asyncio.ensure_future(call) for call in calls]
        while serving.pending < 1 + len(tasks):
            await asyncio.sleep(0.01)
        gate.set()
        await blocker
        return await asyncio.gather(*tasks, return_exceptions=True)

    with runtime.serving() as serving:
        answers = asyncio.run(main(serving))
    assert batches[1] == len(GOOD) + 1  # the five callers shared a step, which failed
    assert isinstance(answers[-1], StepFailedError) and isinstance(answers[-1].__cause__, RuntimeError)
    assert str(answers[-1]) == "the engine step running this request failed: RuntimeError('poisoned batch')"
    vectors = np.stack([outputs[0].numpy() for outputs in answers[:-1]])
    assert cosine_rows(vectors, st_model.encode(GOOD)).min() >= MIN_COSINE
    assert not runtime._engine.requests
