"""First-come, first-served batching under a token budget, with chunked prefill for decoders."""

from __future__ import annotations

from collections import deque

from attrs import frozen

from poolrunner.core.plugin_api.request import RequestState


@frozen
class SchedulerOutput:
    """What runs in one step: each request with its ``num_scheduled_tokens``."""

    requests: tuple[RequestState, ...]
    num_scheduled_tokens: tuple[int, ...]


class Scheduler:
    """Packs requests into steps in arrival order.

    A step takes requests while their tokens fit ``max_num_batched_tokens`` and their count fits
    ``max_num_seqs``. Requests whose prefill already started (``running``) continue before new
    ones start, and the queue is never reordered, so no request starves.

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
        self.waiting: deque[RequestState] = deque()

    def add(self, state: RequestState) -> None:
        self.waiting.append(state)

    def remove(self, state: RequestState) -> bool:
        """Drop a request wherever it waits; ``False`` if it was not queued."""
        if state in self.running:
            self.running.remove(state)
            return True
        try:
            self.waiting.remove(state)
        except ValueError:
            return False
        return True

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> SchedulerOutput:
        chosen: list[RequestState] = []
        counts: list[int] = []
        budget = self.max_num_batched_tokens
        for state in [*self.running, *self.waiting]:
            if len(chosen) == self.max_num_seqs or budget == 0:
                break
            remaining = state.num_tokens - state.num_computed_tokens
            if remaining <= budget:
                count = remaining
            elif self.chunked_prefill:
                count = budget
            elif not chosen:
                count = remaining  # alone: over budget, but never left waiting
            else:
                break
            chosen.append(state)
            counts.append(count)
            budget -= min(count, budget)
        scheduled = dict(zip(map(id, chosen), counts, strict=True))
        started = [state for state in chosen if state not in self.running]
        for state in started:
            self.waiting.remove(state)

        def unfinished(state: RequestState) -> bool:
            return state.num_computed_tokens + scheduled.get(id(state), 0) < state.num_tokens

        # A request stays "running" from its first chunk until its last, in arrival order.
        self.running = [state for state in [*self.running, *started] if unfinished(state)]
        return SchedulerOutput(tuple(chosen), tuple(counts))
