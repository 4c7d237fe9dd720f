"""First-come, first-served batching under a token budget and a request cap."""

from __future__ import annotations

from collections import deque

from attrs import frozen

from poolrunner.core.engine.request import RequestState


@frozen
class SchedulerOutput:
    """What runs in one step: each request with its ``num_scheduled_tokens``."""

    requests: tuple[RequestState, ...]
    num_scheduled_tokens: tuple[int, ...]


class Scheduler:
    """Packs waiting requests into steps, in arrival order.

    A step takes requests while their tokens fit ``max_num_batched_tokens`` and their count fits
    ``max_num_seqs``. The queue is never reordered, so no request starves. A prompt longer than
    the budget (but within the model maximum, checked at admission) runs alone in its own
    step instead of waiting forever.
    """

    def __init__(self, *, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[RequestState] = deque()

    def add(self, state: RequestState) -> None:
        self.waiting.append(state)

    def remove(self, state: RequestState) -> bool:
        """Drop a waiting request; ``False`` if it was not waiting."""
        try:
            self.waiting.remove(state)
        except ValueError:
            return False
        return True

    def has_waiting(self) -> bool:
        return bool(self.waiting)

    def schedule(self) -> SchedulerOutput:
        chosen: list[RequestState] = []
        counts: list[int] = []
        budget = self.max_num_batched_tokens
        while self.waiting and len(chosen) < self.max_num_seqs:
            tokens = self.waiting[0].num_tokens - self.waiting[0].num_computed_tokens
            if tokens > budget and chosen:
                break
            chosen.append(self.waiting.popleft())
            counts.append(tokens)
            budget -= tokens
        return SchedulerOutput(tuple(chosen), tuple(counts))
