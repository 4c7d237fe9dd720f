"""Fair service under load: callers take turns in every step, so a short call that arrives while a
huge one runs is answered within a step or two, the huge one still progresses in every step, and a
lower ``priority`` (vLLM's) runs first. Batch composition changes rounding only.

The scheduler's step composition is checked on hand-made requests; the serving loop
(``Runtime.serving``, the HTTP server's path) on the default model, against the same inputs run alone.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Awaitable, Sequence
from typing import Any

import numpy as np
import pytest

import poolrunner
from poolrunner.core import PoolingParams, PoolingRequest, RequestState
from poolrunner.core.engine.scheduler import Scheduler
from poolrunner.core.plugin_api.request import advance

ATOL = 1e-6  # float32: batch composition moves a vector by rounding only


# --------------------------------------------------------------------------- step composition


def state(name: str, num_tokens: int) -> RequestState:
    return RequestState(request=PoolingRequest(request_id=name, prompt_token_ids=[5] * num_tokens,
                                               params=PoolingParams(task="embed")))


def queue(scheduler: Scheduler, group: str, lengths: Sequence[int], priority: int = 0) -> None:
    """Add ``group``'s requests ``group0``, ``group1``... of the given token counts."""
    for index, num_tokens in enumerate(lengths):
        scheduler.add(state(f"{group}{index}", num_tokens), group=group, priority=priority)


def steps(scheduler: Scheduler, count: int | None = None) -> list[list[tuple[str, int]]]:
    """``count`` steps (all, when ``None``) as ``(request id, tokens)`` lists."""
    out: list[list[tuple[str, int]]] = []
    while scheduler.has_unfinished() and (count is None or len(out) < count):
        scheduled = scheduler.schedule()
        out.append([(s.request_id, n) for s, n in zip(scheduled.requests, scheduled.num_scheduled_tokens,
                                                       strict=True)])
        for s, n in zip(scheduled.requests, scheduled.num_scheduled_tokens, strict=True):
            advance(s, n)
    return out


def test_a_short_call_joins_the_next_step_of_a_huge_one():
    scheduler = Scheduler(max_num_batched_tokens=40, max_num_seqs=8, chunked_prefill=False)
    queue(scheduler, "h", [10] * 12)
    assert steps(scheduler, 1) == [[("h0", 10), ("h1", 10), ("h2", 10), ("h3", 10)]]
    queue(scheduler, "s", [5])
    queue(scheduler, "t", [5, 5])
    # Callers take turns, one request each; the rotation carries over from step to step.
    assert steps(scheduler) == [
        [("h4", 10), ("s0", 5), ("t0", 5), ("h5", 10), ("t1", 5)],
        [("h6", 10), ("h7", 10), ("h8", 10), ("h9", 10)],
        [("h10", 10), ("h11", 10)],
    ]


def test_one_caller_alone_is_first_come_first_served():
    scheduler = Scheduler(max_num_batched_tokens=64, max_num_seqs=8, chunked_prefill=False)
    for name, num_tokens in [("a", 10), ("b", 200), ("c", 64), ("d", 20), ("e", 30)]:
        scheduler.add(state(name, num_tokens))  # no group: direct calls share one
    assert steps(scheduler) == [[("a", 10)], [("b", 200)], [("c", 64)], [("d", 20), ("e", 30)]]


def test_a_request_that_does_not_fit_keeps_its_turn():
    scheduler = Scheduler(max_num_batched_tokens=30, max_num_seqs=8, chunked_prefill=False)
    queue(scheduler, "a", [10, 25])
    queue(scheduler, "b", [10, 10, 10])
    queue(scheduler, "c", [100])
    assert steps(scheduler) == [
        [("a0", 10), ("b0", 10)],  # c0 does not fit: the step ends, though b1 would fit
        [("c0", 100)],  # its turn kept: over the budget, it runs alone
        [("a1", 25)],
        [("b1", 10), ("b2", 10)],
    ]


def test_started_prompts_continue_first_and_max_num_seqs_holds():
    scheduler = Scheduler(max_num_batched_tokens=16, max_num_seqs=2, chunked_prefill=True)
    queue(scheduler, "a", [40])
    queue(scheduler, "b", [4, 4, 4])
    assert steps(scheduler) == [
        [("a0", 16)],
        [("a0", 16)],
        [("a0", 8), ("b0", 4)],
        [("b1", 4), ("b2", 4)],
    ]


def test_lower_priority_value_runs_first_and_equal_priorities_take_turns():
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=3, chunked_prefill=False)
    queue(scheduler, "late", [10, 10], priority=5)
    queue(scheduler, "x", [10, 10], priority=0)
    queue(scheduler, "y", [10, 10], priority=0)
    queue(scheduler, "urgent", [10], priority=-3)
    assert steps(scheduler) == [
        [("urgent0", 10), ("x0", 10), ("y0", 10)],
        [("x1", 10), ("y1", 10), ("late0", 10)],
        [("late1", 10)],
    ]


def test_removing_requests_anywhere_leaves_the_queues_consistent():
    scheduler = Scheduler(max_num_batched_tokens=100, max_num_seqs=8, chunked_prefill=False)
    queue(scheduler, "a", [10, 10])
    queue(scheduler, "b", [10])
    waiting = {s.request_id: s for s in scheduler.waiting}
    assert len(scheduler.waiting) == 3
    assert scheduler.remove(waiting["a1"]) and scheduler.remove(waiting["b0"])
    assert not scheduler.remove(waiting["b0"])  # twice: not queued any more
    assert [s.request_id for s in scheduler.waiting] == ["a0"]
    assert steps(scheduler) == [[("a0", 10)]]
    assert not scheduler.waiting and not scheduler.has_unfinished()


# --------------------------------------------------------------------------- the serving loop


@pytest.fixture(scope="module")
def fair_runtime():
    """The default model in float32 with a 512-token step budget: many steps from few tokens."""
    return poolrunner.Runtime(dtype="float32", load_entrypoints=False, max_num_batched_tokens=512)


def token_lists(count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` inputs of ``length`` token ids: [CLS], words of the vocabulary, [SEP]."""
    rng = random.Random(seed)
    return [[101, *(rng.randrange(2000, 29000) for _ in range(length - 2)), 102] for _ in range(count)]


class StepLog:
    """The request ids of each non-empty step, recorded by the loop thread as it schedules."""

    def __init__(self, runtime: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: list[list[str]] = []
        schedule = runtime._engine.scheduler.schedule

        def recording() -> Any:
            out = schedule()
            if out.requests:
                self.steps.append([s.request_id for s in out.requests])
            return out

        monkeypatch.setattr(runtime._engine.scheduler, "schedule", recording)

    def first(self, request_id: str) -> int:
        return next(i for i, ids in enumerate(self.steps) if request_id in ids)


async def timed(call: Awaitable[list[Any]]) -> tuple[float, list[Any]]:
    began = time.perf_counter()
    outputs = await call
    return time.perf_counter() - began, outputs


def vectors(outputs: Sequence[Any]) -> np.ndarray:
    return np.stack([output.numpy() for output in outputs])


def test_a_short_call_is_answered_within_two_steps_while_a_huge_one_runs(fair_runtime, monkeypatch, capsys):
    runtime = fair_runtime
    huge_ids, short_ids = token_lists(256, 64, seed=1), token_lists(1, 16, seed=2)
    alone_huge, alone_short = runtime.embed(huge_ids), runtime.embed(short_ids)
    params = runtime.frontend.params("embed")
    huge, short = runtime.frontend.prepare(huge_ids, params), runtime.frontend.prepare(short_ids, params)
    log = StepLog(runtime, monkeypatch)

    async def main(serving: Any) -> tuple[Any, ...]:
        quiet = await timed(serving.run(runtime.frontend.prepare(short_ids, params)))
        log.steps.clear()
        huge_call = asyncio.ensure_future(timed(serving.run(huge)))
        while len(log.steps) < 2:  # the huge call is running
            await asyncio.sleep(0.001)
        joined_at = len(log.steps)
        return quiet, joined_at, await timed(serving.run(short)), await huge_call

    with runtime.serving() as serving:
        (quiet, _), joined_at, (short_latency, short_out), (huge_latency, huge_out) = asyncio.run(main(serving))
    assert len(log.steps) >= 32  # 16,384 tokens in steps of 512
    # Its step is the next one, or the one after when it came just after the loop admitted.
    assert log.first(short[0].request_id) <= joined_at + 1, (joined_at, log.first(short[0].request_id))
    assert short_latency < huge_latency / 5
    np.testing.assert_allclose(vectors(short_out), alone_short, atol=ATOL)
    np.testing.assert_allclose(vectors(huge_out), alone_huge, atol=ATOL)
    with capsys.disabled():
        print(f"\n[fairness] short call alone {quiet * 1000:.0f} ms, during a 256-input call "
              f"{short_latency * 1000:.0f} ms; the huge call {huge_latency:.2f} s in {len(log.steps)} steps")


def test_a_huge_call_progresses_every_step_while_short_calls_keep_arriving(fair_runtime, monkeypatch):
    runtime = fair_runtime
    huge_ids, pool = token_lists(256, 64, seed=3), token_lists(8, 24, seed=4)
    alone_huge, alone_pool = runtime.embed(huge_ids), runtime.embed(pool)
    params = runtime.frontend.params("embed")
    huge = runtime.frontend.prepare(huge_ids, params)
    huge_set = {request.request_id for request in huge}
    log = StepLog(runtime, monkeypatch)
    answered: list[tuple[int, np.ndarray]] = []

    async def client(serving: Any, number: int, huge_call: asyncio.Future[Any]) -> None:
        while not huge_call.done():
            index = (number + len(answered)) % len(pool)
            outputs = await serving.run(runtime.frontend.prepare([pool[index]], params))
            answered.append((index, vectors(outputs)[0]))

    async def main(serving: Any) -> list[Any]:
        huge_call = asyncio.ensure_future(serving.run(huge))
        await asyncio.gather(*(client(serving, number, huge_call) for number in range(4)))
        return await huge_call

    with runtime.serving() as serving:
        huge_out = asyncio.run(main(serving))
    ran = [i for i, ids in enumerate(log.steps) if huge_set & set(ids)]
    assert ran == list(range(ran[0], ran[-1] + 1)), "a step ran without the huge call"
    assert len(answered) >= len(ran), (len(answered), len(ran))  # short calls kept being answered
    np.testing.assert_allclose(vectors(huge_out), alone_huge, atol=ATOL)
    for index, vector in answered:
        np.testing.assert_allclose(vector, alone_pool[index], atol=ATOL)


def test_a_lower_priority_value_runs_first(fair_runtime, monkeypatch):
    runtime = fair_runtime
    params = runtime.frontend.params("embed")
    first, gate = threading.Event(), threading.Event()
    execute = runtime._engine.runner.execute

    def held(batch: Any) -> Any:
        if not first.is_set():  # the first step holds the loop until both calls are queued
            first.set()
            assert gate.wait(30)
        return execute(batch)

    monkeypatch.setattr(runtime._engine.runner, "execute", held)
    later, sooner = (runtime.frontend.prepare(token_lists(20, 64, seed=s), params) for s in (5, 6))
    log = StepLog(runtime, monkeypatch)

    async def main(serving: Any) -> None:
        blocker = asyncio.ensure_future(serving.run(runtime.frontend.prepare(token_lists(1, 8, seed=7), params)))
        await asyncio.get_running_loop().run_in_executor(None, first.wait, 30)
        calls = [asyncio.ensure_future(serving.run(later, priority=5)),  # submitted first
                 asyncio.ensure_future(serving.run(sooner, priority=-1))]
        while serving.pending < 1 + len(later) + len(sooner):
            await asyncio.sleep(0.005)
        gate.set()
        await asyncio.gather(blocker, *calls)

    with runtime.serving() as serving:
        asyncio.run(main(serving))
    order = [request_id for ids in log.steps[1:] for request_id in ids]
    assert order == [r.request_id for r in [*sooner, *later]]
    assert len(log.steps) >= 3  # 2560 tokens: not one step
