"""A background thread that owns the engine, so that concurrent callers share its steps.

Callers :meth:`EngineLoop.submit` groups of requests from any thread; between steps the loop
admits what was submitted, then steps while work exists, and hands each group's outputs to its
:class:`Submission` (a ``concurrent.futures.Future``, which ``asyncio.wrap_future`` awaits). Each
submission is one group of the scheduler's turns, so a short call is not queued behind a huge one. Only
the loop thread touches the engine: two drivers of one engine would hand a step's results to
the wrong caller.

Between steps the loop can wait a little for more requests (``batch_wait_fraction``, off by
default). Clients that wait for each answer before sending again, answered by one step, send
their next requests at about the same time; without the wait the first of them starts a step
while the others queue behind it, and on a busy CPU the clients settle into two groups that take
turns in half-size steps, each costing more per request. The wait pays only where the clients
come back fast (bench/README.md, "the batch wait"); where they are slower than it, it stops
trying for a while.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Protocol

from poolrunner.core.engine import compute
from poolrunner.core.engine.engine import Engine
from poolrunner.core.errors import LoopClosedError, NonFiniteOutputError, QueueFullError, StepFailedError
from poolrunner.core.plugin_api.output import RequestOutput
from poolrunner.core.plugin_api.request import RequestState
from poolrunner.core.types import PoolingRequest
from poolrunner.core.validators import check_fraction


class LoopObserver(Protocol):
    """Receives the loop's measurements (the server's metrics implement it)."""

    def on_step(self, num_reqs: int, num_tokens: int) -> None:
        """One step ran ``num_reqs`` requests with ``num_tokens`` tokens in all."""

    def on_finish(self, queue_time: float, inference_time: float) -> None:
        """A request finished: seconds from submission to its first step, then to its end."""


class Submission:
    """One caller's requests on their way through the loop.

    :ivar future: Resolves to the outputs in request order, or fails with the error of the
        first request that failed (``InvalidRequestError`` at admission, ``StepFailedError``);
        cancelled when aborted.
    :ivar priority: vLLM's scheduling priority of these requests: lower runs first.
    """

    def __init__(self, requests: Sequence[PoolingRequest], on_output: Callable[[], object] | None,
                 priority: int = 0) -> None:
        self.requests = tuple(requests)
        self.priority = priority
        self.future: Future[list[RequestOutput]] = Future()
        self.submitted_at = time.monotonic()
        self._on_output = on_output
        self._outputs: list[RequestOutput | None] = [None] * len(self.requests)
        self._remaining = len(self.requests)
        self.aborted = False
        self.released = False  # its requests no longer count as pending

    def result(self, timeout: float | None = None) -> list[RequestOutput]:
        return self.future.result(timeout)

    def _deliver(self, index: int, output: RequestOutput) -> bool:
        """Store one output; ``True`` when it was the last one (then :meth:`_complete` it)."""
        self._outputs[index] = output
        self._remaining -= 1
        if self._on_output is not None:
            self._on_output()
        return not self._remaining

    def _complete(self) -> None:
        _settle(self.future, result=list(self._outputs))


def _settle(future: Future[list[RequestOutput]], *, result: object = None, error: BaseException | None = None) -> None:
    # A waiter may cancel its future at any moment; a settled future stays as it is.
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]
    except InvalidStateError:
        pass


MAX_WAITS_SKIPPED = 64
"""Most chances to wait for a batch skipped after a wait ran out (doubling from 1 each time one
runs out again): callers that cannot come back in time cost at most one wait in this many steps."""


class EngineLoop:
    """Drives one :class:`Engine` from a daemon thread for any number of callers.

    :param engine: The engine this loop owns from :meth:`start` until :meth:`stop` returns.
    :param max_pending: Most requests submitted and not yet finished (queued or running); a
        submission that would pass it raises :class:`QueueFullError` at once. ``None``: no limit.
    :param observer: Optional receiver of per-step and per-request measurements.
    :param batch_wait_fraction: When the engine has run out of work and fewer submissions (callers'
        calls, an HTTP request each) are pending than were at once since the last step began, the
        next step waits until as many are, or until their requests fill a step
        (``max_num_batched_tokens`` or ``max_num_seqs``), for at most this fraction of the last
        step's duration; ``0``: a step starts as soon as a request is pending. A lone caller never
        waits: it was the only one pending. After a wait that ran out, the next 1, 2, 4... up to
        :data:`MAX_WAITS_SKIPPED` chances to wait are skipped.
    """

    def __init__(self, engine: Engine, *, max_pending: int | None = None, observer: LoopObserver | None = None,
                 batch_wait_fraction: float = 0.0) -> None:
        if max_pending is not None and max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        check_fraction("batch_wait_fraction", batch_wait_fraction)
        self.engine = engine
        self.max_pending = max_pending
        self._observer = observer
        self._cond = threading.Condition()
        self._inbox: list[Submission] = []
        self._aborts: list[Submission] = []
        self._pending = 0
        self._closing = False
        self._owner: dict[str, tuple[Submission, int]] = {}  # request id -> (submission, index)
        self._started_at: dict[str, float] = {}
        self.batch_wait_fraction = batch_wait_fraction
        self._callers = 0  # submissions pending: their callers wait for them
        self._peak = 0  # most submissions pending at once since the last step began
        self._last_step = 0.0  # seconds
        self._waits_to_skip = 0
        self._skip_after_timeout = 1
        self._thread = threading.Thread(target=self._run, name="poolrunner-engine-loop", daemon=True)

    @property
    def pending(self) -> int:
        """Requests submitted and not yet finished, failed or aborted."""
        return self._pending

    @property
    def waiting(self) -> int:
        """Pending requests not yet in any step: submitted but not admitted, or queued in the
        scheduler (read without the lock: a gauge, not an invariant)."""
        inbox = sum(len(submission.requests) for submission in list(self._inbox))
        return min(self._pending, inbox + len(self.engine.scheduler.waiting))

    @property
    def alive(self) -> bool:
        """The loop thread runs and takes requests."""
        return self._thread.is_alive() and not self._closing

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def submit(self, requests: Sequence[PoolingRequest], on_output: Callable[[], object] | None = None, *,
               priority: int = 0) -> Submission:
        """Queue ``requests`` for the next steps; returns at once.

        :param on_output: Called in the loop thread after each of these requests finishes.
        :param priority: Lower runs first; submissions of one priority take turns, one request each.
        :raises QueueFullError: if ``max_pending`` would be passed (naming the limit).
        :raises LoopClosedError: after :meth:`stop`.
        """
        submission = Submission(requests, on_output, priority)
        if not submission.requests:
            submission.future.set_result([])
            return submission
        with self._cond:
            if self._closing:
                raise LoopClosedError("the engine loop is shutting down and takes no new requests")
            if self.max_pending is not None and self._pending + len(submission.requests) > self.max_pending:
                raise QueueFullError(
                    f"the request queue is full: {self._pending} requests are waiting or running and "
                    f"{len(submission.requests)} more would pass the limit of {self.max_pending} "
                    "(max_pending; the server's --max-waiting-requests); retry later"
                )
            self._pending += len(submission.requests)
            self._callers += 1
            self._peak = max(self._peak, self._callers)
            self._inbox.append(submission)
            self._cond.notify()
        submission.future.add_done_callback(lambda future: future.cancelled() and self.abort(submission))
        return submission

    def abort(self, submission: Submission) -> None:
        """Remove ``submission``'s requests from the engine (e.g. its client went away).

        Its future is cancelled; outputs already computed are dropped. Idempotent.
        """
        with self._cond:
            if submission.aborted:
                return
            submission.aborted = True
            self._aborts.append(submission)
            self._cond.notify()
        submission.future.cancel()

    def stop(self, timeout: float | None = None) -> None:
        """Take no new requests, finish those already submitted, then end the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # --- the loop thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as exc:  # a bug here must not leave waiters hanging
            with self._cond:
                self._closing = True
                left = [*self._inbox, *{owner for owner, _ in self._owner.values()}]
                self._inbox.clear()
            for submission in left:
                _settle(submission.future, error=LoopClosedError(f"the engine loop failed: {exc!r}"))
            raise

    def _iterate(self) -> bool:
        """Admit, abort and step once; ``False`` when closed and out of work."""
        with self._cond:
            while not (self._inbox or self._aborts or self._closing or self.engine.has_unfinished_requests()):
                self._cond.wait()
            if not self.engine.has_unfinished_requests():
                self._wait_for_batch()
            self._peak = self._callers
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for submission in aborts:
            self._drop(submission, None)
        for submission in inbox:
            self._admit(submission)
        if self.engine.has_unfinished_requests():
            self._step()
            return True
        with self._cond:
            return not (self._closing and not self._inbox and not self._aborts)

    def _wait_for_batch(self) -> None:
        """With the lock held and the engine out of work: wait, as ``batch_wait_fraction`` says,
        for the callers pending during the last step to be pending again."""
        if not self.batch_wait_fraction:
            return
        if self._waits_to_skip:
            self._waits_to_skip -= 1
            return
        deadline = time.monotonic() + self.batch_wait_fraction * self._last_step
        while self._callers < self._peak and not (self._closing or self._aborts or self._inbox_fills_a_step()):
            left = deadline - time.monotonic()
            if left <= 0:  # ran out: these callers come back slower than the wait
                self._waits_to_skip = self._skip_after_timeout
                self._skip_after_timeout = min(2 * self._skip_after_timeout, MAX_WAITS_SKIPPED)
                return
            self._cond.wait(left)
        self._skip_after_timeout = 1

    def _inbox_fills_a_step(self) -> bool:
        """Whether the submitted requests (all that is pending: the engine is out of work) fill
        one step's ``max_num_seqs`` or ``max_num_batched_tokens``."""
        scheduler = self.engine.scheduler
        return (self._pending >= scheduler.max_num_seqs
                or sum(len(request.prompt_token_ids) for submission in self._inbox for request in submission.requests)
                >= scheduler.max_num_batched_tokens)

    def _admit(self, submission: Submission) -> None:
        if submission.aborted:
            return
        try:
            for index, request in enumerate(submission.requests):
                self.engine.add_request(request, group=submission, priority=submission.priority)
                self._owner[request.request_id] = (submission, index)
        except Exception as exc:  # validation at admission: this submission alone fails
            self._drop(submission, exc)

    def _drop(self, submission: Submission, error: BaseException | None) -> None:
        """Remove every request of ``submission`` still in the engine and settle its future."""
        for request in submission.requests:
            owner = self._owner.pop(request.request_id, None)
            self._started_at.pop(request.request_id, None)
            if owner is not None:
                self.engine.abort_request(request.request_id)
        # Released first: a waiter woken by the future already sees the loop's counts settled.
        self._release(submission)
        if error is not None:
            _settle(submission.future, error=error)

    def _release(self, submission: Submission) -> None:
        with self._cond:
            if not submission.released:
                submission.released = True
                self._pending -= len(submission.requests)
                self._callers -= 1

    def _step(self) -> None:
        states = list(self.engine.requests.values())
        computed = [state.num_computed_tokens for state in states]
        began = time.monotonic()
        try:
            finished = compute.call(self.engine.step)  # every model's steps on one thread: see compute
        except Exception as exc:
            self._fail_step(exc)
            return
        now = time.monotonic()
        self._last_step = now - began
        self._observe_step(states, computed, began)
        for request_id, exc in self.engine.take_failures():  # one request's own failure: its submission alone
            owner = self._owner.get(request_id)
            if owner is not None:
                if isinstance(exc, NonFiniteOutputError):  # the request's own answer, not a failed step
                    error: Exception = exc
                else:
                    error = StepFailedError(f"the engine step running this request failed: {exc!r}")
                    error.__cause__ = exc
                self._drop(owner[0], error)
        for request_id, output in finished:
            owner = self._owner.pop(request_id, None)
            if owner is None:
                continue
            submission, index = owner
            started = self._started_at.pop(request_id, now)
            if self._observer is not None:
                self._observer.on_finish(started - submission.submitted_at, now - started)
            if submission._deliver(index, output):
                self._release(submission)
                submission._complete()

    def _observe_step(self, states: list[RequestState], computed: list[int], began: float) -> None:
        ran = [(state, state.num_computed_tokens - before) for state, before in zip(states, computed, strict=True)
               if state.num_computed_tokens > before]
        for state, _ in ran:
            self._started_at.setdefault(state.request_id, began)
        if self._observer is not None and ran:
            self._observer.on_step(len(ran), sum(count for _, count in ran))

    def _fail_step(self, exc: Exception) -> None:
        """The engine already removed the failed step's requests: fail their submissions only."""
        lost = {owner for request_id, (owner, _) in self._owner.items() if request_id not in self.engine.requests}
        for submission in lost:
            error = StepFailedError(f"the engine step running this request failed: {exc!r}")
            error.__cause__ = exc
            self._drop(submission, error)
