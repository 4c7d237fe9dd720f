"""One step's scheduled requests, packed: as the model inputs see them (:class:`InputBatch`)
and as a pooler sees them (:class:`PoolingMetadata`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from attrs import frozen

from poolrunner.core.plugin_api.request import RequestState
from poolrunner.core.types import PoolingParams


@frozen(kw_only=True, eq=False)
class InputBatch:
    """The requests scheduled in one step, packed without padding.

    Request ``i`` owns the flat positions ``query_start_loc[i]:query_start_loc[i + 1]``.

    :ivar requests: The scheduled requests, in packing order.
    :ivar num_scheduled_tokens: Tokens of each request run in this step.
    :ivar input_ids: ``[num_tokens]`` int64 on the model's device.
    :ivar positions: ``[num_tokens]`` int64 on the model's device: each token's index in its prompt.
    :ivar query_start_loc: ``[num_reqs + 1]`` int64 on the model's device: row offsets.
    :ivar query_start_loc_cpu: The same offsets on the CPU, for host-side loops.
    """

    requests: tuple[RequestState, ...]
    num_scheduled_tokens: tuple[int, ...]
    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor

    @property
    def num_reqs(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc_cpu[-1])

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @classmethod
    def build(
        cls,
        requests: Sequence[RequestState],
        num_scheduled_tokens: Sequence[int],
        device: torch.device,
    ) -> InputBatch:
        """Pack the next ``num_scheduled_tokens[i]`` prompt tokens of each request."""
        ids: list[int] = []
        positions: list[int] = []
        for state, count in zip(requests, num_scheduled_tokens, strict=True):
            start = state.num_computed_tokens
            ids.extend(state.request.prompt_token_ids[start : start + count])
            positions.extend(range(start, start + count))
        counts = list(num_scheduled_tokens)
        offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0, out=offsets[1:])
        return cls(
            requests=tuple(requests),
            num_scheduled_tokens=tuple(counts),
            input_ids=_to_device(torch.tensor(ids, dtype=torch.int64), device),
            positions=_to_device(torch.tensor(positions, dtype=torch.int64), device),
            query_start_loc=_to_device(offsets, device),
            query_start_loc_cpu=offsets,
        )


@frozen(kw_only=True, eq=False)
class PoolingMetadata:
    """The scheduled requests of one step, as a pooler sees them.

    Tokens of all requests are packed in one flat tensor without padding; request ``i`` owns
    rows ``query_start_loc[i]:query_start_loc[i + 1]`` of the hidden states.

    :ivar request_ids: One per scheduled request, in packing order.
    :ivar pooling_params: One per scheduled request, in packing order.
    :ivar prompt_lens: ``[num_reqs]`` int64 on the CPU: each request's token count.
    :ivar query_start_loc: ``[num_reqs + 1]`` int64 on the model's device: row offsets.
    :ivar prompt_token_ids: ``[num_tokens]`` int64 on the model's device: the packed ids.
    """

    request_ids: tuple[str, ...]
    pooling_params: tuple[PoolingParams, ...]
    prompt_lens: torch.Tensor
    query_start_loc: torch.Tensor
    prompt_token_ids: torch.Tensor

    @property
    def num_reqs(self) -> int:
        return len(self.request_ids)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host-to-device copy that overlaps with host work on CUDA (pinned source, non-blocking)."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
