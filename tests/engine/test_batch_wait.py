"""``batch_wait_fraction``: between steps the engine loop waits for the callers of the last step.

Each test slows every step to :data:`STEP` seconds (the wait's limit is a fraction of the last
step's time) and records when each step ran and how many requests it held.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import attrs
import pytest

from poolrunner.core.config import RuntimeConfig
from poolrunner.core.errors import InvalidRequestError

STEP = 0.5  # seconds each step takes here: a wait would last as long


class Steps:
    """The runtime's steps, slowed to :data:`STEP` seconds, as (began, ended, requests)."""

    def __init__(self, runtime, monkeypatch) -> None:
        self.ran: list[tuple[float, float, int]] = []
        self.began = 0  # steps begun
        self.started = threading.Event()
        execute = runtime._engine.runner.execute

        def slow(batch):
            began = time.monotonic()
            self.began += 1
            self.started.set()
            time.sleep(STEP)
            out = execute(batch)
            self.ran.append((began, time.monotonic(), batch.num_reqs))
            return out

        monkeypatch.setattr(runtime._engine.runner, "execute", slow)
        monkeypatch.setattr(runtime, "config", attrs.evolve(runtime.config, batch_wait_fraction=1.0))


def test_serving_with_the_wait_on_says_so_in_the_log_and_without_it_says_nothing(runtime, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="poolrunner.core.runtime"), runtime.serving():
        pass
    assert not caplog.records
    expected = runtime.embed("served")
    monkeypatch.setattr(runtime, "config", attrs.evolve(runtime.config, batch_wait_fraction=0.25))
    with caplog.at_level(logging.INFO, logger="poolrunner.core.runtime"), runtime.serving():
        assert (runtime.embed("served") == expected).all()  # a lone caller, served through the loop
    assert [r.getMessage() for r in caplog.records] == [
        f"{runtime.model_config.name}: a step may wait up to 0.25 of the last step's time for the callers of the "
        "last (batch_wait_fraction)"]


def _call(runtime, text: str, times: int = 1) -> threading.Thread:
    """A closed-loop caller: ``times`` calls, each sent as soon as the last is answered."""
    thread = threading.Thread(target=lambda: [runtime.embed(text) for _ in range(times)])
    thread.start()
    return thread


def test_callers_answered_by_one_step_share_the_next_again(runtime, monkeypatch):
    steps = Steps(runtime, monkeypatch)
    with runtime.serving():
        first = _call(runtime, "first caller", times=2)
        assert steps.started.wait(30)
        second = _call(runtime, "second caller")  # arrives while the first caller's step runs
        first.join(30)
        second.join(30)
    # Without the wait the second caller's request starts a step alone, the first caller's next
    # request queued behind it: [1, 1, 1].
    assert [count for _, _, count in steps.ran] == [1, 2]


def test_a_lone_caller_never_waits(runtime, monkeypatch):
    steps = Steps(runtime, monkeypatch)
    with runtime.serving():
        _call(runtime, "alone", times=3).join(30)
    assert [count for _, _, count in steps.ran] == [1, 1, 1]
    gaps = [began - ended for (_, ended, _), (began, _, _) in itertools.pairwise(steps.ran)]
    assert max(gaps) < 0.6 * STEP  # a wait would have lasted STEP


def test_a_caller_whose_call_spans_steps_is_one_caller(runtime, monkeypatch):
    """What the wait counts is calls, not their requests: after a call of 8 inputs run 4 a
    step, the same caller's next call is all that was pending, and does not wait."""
    steps = Steps(runtime, monkeypatch)
    monkeypatch.setattr(runtime._engine.scheduler, "max_num_seqs", 4)
    with runtime.serving():
        thread = threading.Thread(target=lambda: [runtime.embed([f"text {i}" for i in range(8)]),
                                                  runtime.embed("one more")])
        thread.start()
        thread.join(30)
    assert [count for _, _, count in steps.ran] == [4, 4, 1]
    (_, ended, _), (began, _, _) = steps.ran[1:]
    assert began - ended < 0.6 * STEP  # a wait would have lasted STEP


def test_callers_that_do_not_come_back_cost_one_wait_then_are_not_waited_for(runtime, monkeypatch):
    steps = Steps(runtime, monkeypatch)
    with runtime.serving():
        first = _call(runtime, "first caller")
        assert steps.started.wait(30)
        second = _call(runtime, "second caller")  # pending with the first: two callers
        first.join(30)
        while steps.began < 2:  # the second caller's step runs...
            time.sleep(0.01)
        third = _call(runtime, "third caller")  # ...and a third arrives meanwhile
        second.join(30)
        third.join(30)
    (_, first_ended, _), (second_began, second_ended, _), (third_began, _, _) = steps.ran
    assert second_began - first_ended >= 0.9 * STEP  # waited for the first caller, who did not come back
    assert third_began - second_ended < 0.6 * STEP  # the next chance to wait is skipped


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), True, "0.2"])
def test_a_batch_wait_fraction_outside_0_to_1_is_refused(value):
    with pytest.raises(InvalidRequestError) as error:
        RuntimeConfig(batch_wait_fraction=value)
    assert str(error.value) == f"batch_wait_fraction must be a number from 0 to 1, got {value!r}"
