"""The one thread of a process that runs its models: loading, probing and every step.

On the CPU, torch runs an operation's parallel work on OpenMP threads, and GNU OpenMP (the
library torch's CPU builds use) keeps a team of worker threads for each thread that starts such
work. Once the teams of a process hold more threads than the machine has cores, its workers stop
spinning between two parallel regions and sleep at once: every region then wakes them through
the kernel. A runtime loaded on one thread and stepped by its serving loop on another is in that
case, and so is a process serving several models or called from several threads. Measured on 2
Zen 4 cores (AVX512-BF16, no AMX): 2,000 GELUs of ``[2048, 384]`` took 0.50 s on one thread and
1.4-1.9 s on a second thread after the first had run one; MiniLM stepped by a serving loop after
loading on the caller's thread ran its steps 15-20% slower, with 13 times the context switches.

So every runtime of a process runs its model work here, on one long-lived thread: their steps
then share one team, whatever thread asks for them. Callers wait on a future; a call made on
this thread runs inline. Work queues in order: a runtime loading holds up the steps of the
process's other runtimes until it is loaded (they would share the same cores anyway). A program
that runs torch work of its own on another thread beside a runtime pays the price above for it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

THREAD_NAME = "poolrunner-compute"

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_thread: threading.Thread | None = None


def submit(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
    """Run ``fn(*args, **kwargs)`` on the compute thread; its future (already settled when
    called from the compute thread itself, which runs it inline)."""
    if on_compute_thread():
        future: Future[T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the caller, as the executor does
            future.set_exception(exc)
        return future
    return _pool().submit(fn, *args, **kwargs)


def call(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` run on the compute thread: its result, or its exception raised here."""
    return submit(fn, *args, **kwargs).result()


def on_compute_thread() -> bool:
    """Whether the calling thread is the compute thread."""
    return _thread is not None and threading.current_thread() is _thread


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME, initializer=_started)
        return _executor


def _started() -> None:
    global _thread
    _thread = threading.current_thread()


def _forget() -> None:
    """In a forked child the thread is gone: the next call starts a new one."""
    global _executor, _thread, _lock
    _executor, _thread, _lock = None, None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)
