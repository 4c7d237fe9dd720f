"""Batching under a token budget, taking turns between callers, with chunked prefill for decoders."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, KeysView

from attrs import frozen

from poolrunner.core.plugin_api.request import RequestState


@frozen
class SchedulerOutput:
    """What runs in one step: each request with its ``num_scheduled_tokens``."""

    requests: tuple[RequestState, ...]
    num_scheduled_tokens: tuple[int, ...]


class _Step:
    """A step being filled: its requests, their token counts and what is left of the budget."""

    def __init__(self, budget: int, max_num_seqs: int, chunked_prefill: bool) -> None:
        self.requests: list[RequestState] = []
        self.counts: list[int] = []
        self.budget = budget
        self.max_num_seqs = max_num_seqs
        self.chunked_prefill = chunked_prefill

    def offer(self, state: RequestState) -> bool:
        """Add ``state`` if it fits; ``False`` (nothing added) when it does not."""
        count = None if self._full() else self._tokens_for(state)
        if count is None:
            return False
        self.requests.append(state)
        self.counts.append(count)
        self.budget -= min(count, self.budget)
        return True

    def _full(self) -> bool:
        return len(self.requests) == self.max_num_seqs or self.budget == 0

    def _tokens_for(self, state: RequestState) -> int | None:
        """The tokens ``state`` would run in this step; ``None`` if it does not fit."""
        remaining = state.num_tokens - state.num_computed_tokens
        if remaining <= self.budget:
            return remaining
        if self.chunked_prefill:
            return self.budget
        if not self.requests:
            return remaining  # alone: over budget, but never left waiting
        return None


class Scheduler:
    """Packs requests into steps, taking turns between callers.

    Each request belongs to a *group* (one caller's requests: the serving loop's submission;
    ``None`` for direct calls) and a *priority* (vLLM's: lower runs first). A group's requests
    start in arrival order; the groups of one priority take turns, one request each, in a
    rotation that carries over from step to step, so a short call that arrives while a huge one
    waits runs in the next step, and the huge one keeps its turn in every round. A priority's
    groups start only when no group of a lower priority value waits. One group alone is served
    first come, first served.

    A step takes requests while their tokens fit ``max_num_batched_tokens`` and their count fits
    ``max_num_seqs``. Requests whose prefill already started (``running``) continue before new
    ones start. When the request whose turn it is does not fit, the step ends and that request
    starts the next one: none is skipped, and every group of a priority gets a turn in each
    round, so none starves (a higher priority value waits while lower ones do, as in vLLM).

    With ``chunked_prefill`` (causal models, whose earlier tokens never attend to later ones) a
    prompt that does not fit what is left of the budget is split: it takes the rest of this step
    and continues in the next. Without it (bidirectional encoders, which need the whole prompt
    at once) a prompt longer than the budget runs alone in its own step instead of waiting forever.
    """

    def __init__(self, *, max_num_batched_tokens: int, max_num_seqs: int, chunked_prefill: bool) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.chunked_prefill = chunked_prefill
        self.running: list[RequestState] = []
        # priority -> group -> its requests not started yet; a group's place is its turn
        self._queues: dict[int, OrderedDict[Hashable, deque[RequestState]]] = {}
        self._placed: dict[RequestState, tuple[int, Hashable]] = {}  # waiting request -> (priority, group)

    @property
    def waiting(self) -> KeysView[RequestState]:
        """The requests not started yet, in arrival order (a live view: its ``len`` is safe to
        read from another thread, as the server's gauges do)."""
        return self._placed.keys()

    def add(self, state: RequestState, *, group: Hashable = None, priority: int = 0) -> None:
        """Queue ``state`` behind its ``group``'s requests; a group with none waiting takes its
        turn after the groups of its ``priority`` already waiting."""
        groups = self._queues.setdefault(priority, OrderedDict())
        groups.setdefault(group, deque()).append(state)
        self._placed[state] = (priority, group)

    def remove(self, state: RequestState) -> bool:
        """Drop a request wherever it waits; ``False`` if it was not queued."""
        if state in self.running:
            self.running.remove(state)
            return True
        placed = self._placed.pop(state, None)
        if placed is None:
            return False
        queue = self._queues[placed[0]][placed[1]]
        queue.remove(state)
        if not queue:
            self._forget(*placed)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.running or self._placed)

    def schedule(self) -> SchedulerOutput:
        """The next step: started prompts first, then waiting requests in turn while they fit."""
        step = _Step(self.max_num_batched_tokens, self.max_num_seqs, self.chunked_prefill)
        for state in self.running:  # chunked prefill: a started prompt takes at most what is left
            if not step.offer(state):
                break
        started: list[RequestState] = []
        # A request that does not fit keeps its turn: it starts the next step, so none is skipped.
        while (state := self._next()) is not None and step.offer(state):
            self._start(state)
            started.append(state)
        scheduled = dict(zip(map(id, step.requests), step.counts, strict=True))

        def unfinished(state: RequestState) -> bool:
            return state.num_computed_tokens + scheduled.get(id(state), 0) < state.num_tokens

        # A request stays "running" from its first chunk until its last, in the order it started.
        self.running = [state for state in [*self.running, *started] if unfinished(state)]
        return SchedulerOutput(tuple(step.requests), tuple(step.counts))

    def _next(self) -> RequestState | None:
        """The request whose turn it is: the first of the first group of the best priority."""
        if not self._queues:
            return None
        groups = self._queues[min(self._queues)]
        return next(iter(groups.values()))[0]

    def _start(self, state: RequestState) -> None:
        """Take ``state`` (from :meth:`_next`) off its queue; its group's next turn is after the others'."""
        priority, group = self._placed.pop(state)
        groups = self._queues[priority]
        groups[group].popleft()
        if groups[group]:
            groups.move_to_end(group)
        else:
            self._forget(priority, group)

    def _forget(self, priority: int, group: Hashable) -> None:
        """Drop ``group``'s empty queue (and its priority's, when it was the last)."""
        groups = self._queues[priority]
        del groups[group]
        if not groups:
            del self._queues[priority]
