"""A request as plugins see it while it is in the engine."""

from __future__ import annotations

import time
from typing import Any

from attrs import define, field

from poolrunner.core.types import PoolingRequest


@define(kw_only=True, eq=False)
class RequestState:
    """A request admitted to the engine, as the request and step hooks receive it.

    Everything but :attr:`plugin_data` is read-only to plugins: the scheduler alone advances
    :attr:`num_computed_tokens` (through :func:`advance`), so no plugin can desynchronise it.

    :ivar request: The immutable request as submitted.
    :ivar plugin_data: Per-plugin scratch space, keyed by plugin name. Plugins keep their
        per-request state here and delete their key in ``remove_request``.
    :ivar arrival_time: ``time.monotonic()`` at admission, seconds.
    """

    request: PoolingRequest
    plugin_data: dict[str, Any] = field(factory=dict)
    arrival_time: float = field(factory=time.monotonic)
    _num_computed_tokens: int = field(default=0, init=False, alias="_num_computed_tokens")

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens

    @property
    def num_computed_tokens(self) -> int:
        """Prompt tokens already scheduled through the model (every chunk launched so far)."""
        return self._num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self._num_computed_tokens >= self.num_tokens


def advance(state: RequestState, num_scheduled_tokens: int) -> None:
    """Count ``num_scheduled_tokens`` more prompt tokens of ``state`` as computed (engine only)."""
    state._num_computed_tokens += num_scheduled_tokens
