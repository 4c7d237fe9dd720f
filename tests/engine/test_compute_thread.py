"""Every model step of a process runs on one thread (``core/engine/compute.py``), whoever calls:
a plain call, a serving loop fed by several threads, two runtimes; a caller interrupted while it
waits stops its run after the step in flight, and the runtime serves the next call."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import poolrunner
from poolrunner.core import hookimpl
from poolrunner.core.engine import compute
from tests.helpers import assert_engine_empty

TEXTS = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog.", "Rain is expected tomorrow."]


class StepThreads:
    """Records the thread of every step (``prepare_inputs`` runs once per step), and calls
    ``on_step`` there when set."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.on_step = None

    @hookimpl
    def prepare_inputs(self, batch, model_config):
        self.threads.append(threading.current_thread())
        if self.on_step is not None:
            self.on_step()


@pytest.fixture(scope="module")
def spied():
    spy = StepThreads()
    return spy, poolrunner.Runtime(plugins=[spy], load_entrypoints=False, dtype="float32", max_num_seqs=2)


def test_every_step_runs_on_the_one_compute_thread(spied, st_model):
    spy, runtime = spied
    other_spy = StepThreads()
    other = poolrunner.Runtime(plugins=[other_spy], load_entrypoints=False, dtype="float32")
    expected = st_model.encode(TEXTS, convert_to_numpy=True)
    np.testing.assert_allclose(runtime.embed(TEXTS), expected, atol=2e-6)  # a plain call
    with runtime.serving(), ThreadPoolExecutor(4) as callers:  # a loop fed by four threads
        for vectors in callers.map(lambda i: runtime.embed(TEXTS[i % 3:]), range(8)):
            np.testing.assert_allclose(vectors, expected[-len(vectors):], atol=2e-6)
    np.testing.assert_allclose(other.embed(TEXTS), expected, atol=2e-6)  # another runtime
    threads = {thread.ident for thread in spy.threads + other_spy.threads}
    assert len(threads) == 1 and spy.threads[0].name.startswith(compute.THREAD_NAME), spy.threads[0].name
    assert threading.current_thread() not in spy.threads


def test_an_interrupted_call_stops_after_its_step(spied, assert_serves):
    """Ctrl-C while a call waits: the step in flight ends, the call's other requests leave the
    engine, ``KeyboardInterrupt`` reaches the caller, and the next call is served."""
    spy, runtime = spied
    spy.threads.clear()
    spy.on_step = lambda: os.kill(os.getpid(), signal.SIGINT)  # delivered to the main thread, which waits
    # Python's Ctrl-C handler, which a process started in the background by a shell lacks (SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            runtime.embed(TEXTS * 20)  # 60 inputs, 2 a step
    finally:
        spy.on_step = None
        signal.signal(signal.SIGINT, previous)
    assert len(spy.threads) < 5, f"{len(spy.threads)} steps ran after the interrupt"
    assert_engine_empty(runtime)
    assert_serves(runtime)
