"""Runner-owned, mutable state of a request while it is in the engine."""

from __future__ import annotations

import time
from typing import Any

from attrs import define, field

from poolrunner.core.types import PoolingRequest


@define(kw_only=True, eq=False)
class RequestState:
    """A request admitted to the engine.

    :ivar request: The immutable request as submitted.
    :ivar plugin_data: Per-plugin scratch space, keyed by plugin name. Plugins keep their
        per-request state here and delete their key in ``remove_request``.
    :ivar arrival_time: ``time.monotonic()`` at admission, seconds.
    :ivar num_computed_tokens: Prompt tokens already run through the model.
    """

    request: PoolingRequest
    plugin_data: dict[str, Any] = field(factory=dict)
    arrival_time: float = field(factory=time.monotonic)
    num_computed_tokens: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.num_computed_tokens >= self.num_tokens
