"""Memory-aware admission of per-token work (issue 31): a server-wide budget of output values in flight.

One request's per-token outputs are bounded by ``max_output_values`` (a 413 above it), but many
such requests at once could still hold far more memory than one. Each request with per-token
outputs (``token_embed``, ``token_classify``) therefore takes a :class:`Lease` of its values
(tokens x hidden size) from the app's :class:`OutputBudget` before its engine requests are
queued, and holds it until its answer has been sent. A request that does not fit waits, first
come first served (a big one is never overtaken for ever by small ones); one that alone passes
``max_output_values`` never waits (it is the 413). Requests without per-token outputs take nothing.

Everything here runs in the server's event loop: no lock.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque

OUTPUT_VALUE_BYTES = 48
"""Server memory one in-flight per-token value may cost at its peak: 4 bytes as a float32 array
and about 20 characters of JSON, held twice while the text becomes the body's bytes."""
MEMORY_SHARE = 4
"""The default budget is 1 / MEMORY_SHARE of the machine's physical memory."""


def default_budget(max_output_values: int) -> int:
    """Values that a quarter of the machine's physical memory holds at :data:`OUTPUT_VALUE_BYTES`
    each, but at least ``max_output_values`` (one largest request always fits).

    Physical memory is ``os.sysconf``'s pages x page size (Linux, macOS); where that is unknown,
    8 x ``max_output_values``.
    """
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 * max_output_values
    return max(max_output_values, memory // MEMORY_SHARE // OUTPUT_VALUE_BYTES)


class Lease:
    """``values`` of an :class:`OutputBudget`, held until :meth:`release` (idempotent)."""

    def __init__(self, budget: OutputBudget | None, values: int) -> None:
        self._budget, self.values = budget, values

    def release(self) -> None:
        budget, self._budget = self._budget, None
        if budget is not None:
            budget._give_back(self.values)


NO_LEASE = Lease(None, 0)
"""The lease of a request without per-token outputs."""


class OutputBudget:
    """At most ``limit`` per-token output values held by requests at once, over every model of
    the server; requests take them in arrival order.

    :param limit: The budget, values (tokens x hidden size); positive.
    :raises ValueError: for a limit below 1.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the output budget must be at least 1 value, got {limit}")
        self.limit = limit
        self.held = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        """Requests waiting for room."""
        return len(self._waiters)

    async def acquire(self, values: int) -> Lease:
        """A lease of ``values``, once they fit after every earlier waiter's (at once when nothing
        waits and they fit). Cancelling the wait takes nothing.

        :raises ValueError: for more values than the whole budget, which could never fit.
        """
        if values <= 0:
            return NO_LEASE
        if values > self.limit:
            raise ValueError(f"{values} values can never fit the budget of {self.limit}")
        if not self._waiters and self.held + values <= self.limit:
            self.held += values
            return Lease(self, values)
        waiter = asyncio.get_running_loop().create_future()
        entry = (values, waiter)
        self._waiters.append(entry)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # granted as it was cancelled: hand it on
                self._give_back(values)
            else:
                self._waiters.remove(entry)
                self._wake()  # a big waiter leaving may let smaller ones behind it in
            raise
        return Lease(self, values)

    def _give_back(self, values: int) -> None:
        self.held -= values
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.held + self._waiters[0][0] <= self.limit:
            values, waiter = self._waiters.popleft()
            self.held += values
            waiter.set_result(None)
