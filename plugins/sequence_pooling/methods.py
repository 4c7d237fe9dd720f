"""Sequence pooling over packed hidden states: one vector per request, in float32.

Request ``i`` owns rows ``query_start_loc[i]:query_start_loc[i + 1]`` of ``hidden_states``
(``[num_tokens, hidden_size]``); every method returns ``[num_reqs, hidden_size]`` float32.
Boundaries come from the offsets, never from token ids, so a pad id equal to the EOS id
(common in decoders) cannot shift LAST pooling.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from poolrunner.core import ModelConfig, ModelLoadError


def cls_pool(hidden_states: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """First token of each request (sentence-transformers' Pooling(cls))."""
    return hidden_states[query_start_loc[:-1]].float()


def last_pool(hidden_states: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """Last real token of each request (sentence-transformers' Pooling(lasttoken))."""
    return hidden_states[query_start_loc[1:] - 1].float()


def mean_pool(hidden_states: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """Mean over each request's tokens, summed in float32 (sentence-transformers' Pooling(mean))."""
    lengths = query_start_loc.diff()
    owner = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=lengths.device), lengths,
        output_size=hidden_states.shape[0],
    )
    sums = torch.zeros(
        lengths.numel(), hidden_states.shape[1], dtype=torch.float32, device=hidden_states.device
    )
    sums.index_add_(0, owner, hidden_states.float())
    return sums / lengths.unsqueeze(1)


POOLING_METHODS = {"CLS": cls_pool, "LAST": last_pool, "MEAN": mean_pool}


def pooling_method(model_config: ModelConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The sequence pooling of ``model_config.pooling_type``.

    :raises ModelLoadError: for a token-level pooling type (ALL, STEP).
    """
    method = POOLING_METHODS.get(model_config.pooling_type)
    if method is None:
        raise ModelLoadError(
            f"pooling_type {model_config.pooling_type!r} cannot pool a sequence; use one of {sorted(POOLING_METHODS)}"
        )
    return method
