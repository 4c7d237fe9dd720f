"""Sequence pooling over packed hidden states: one vector per request, in float32.

Request ``i`` owns rows ``query_start_loc[i]:query_start_loc[i + 1]`` of ``hidden_states``
(``[num_tokens, hidden_size]``); every method returns ``[num_reqs, hidden_size]`` float32.
Boundaries come from the offsets, never from token ids, so a pad id equal to the EOS id
(common in decoders) cannot shift LAST pooling. Sums accumulate in float64 whatever the
hidden states' dtype, then round once to float32. Packed rows hold no padding, so no method
needs an attention mask: each reduces over exactly the request's tokens, as
sentence-transformers' masked Pooling does.

A pooling type naming several modes (``"MEAN+MAX"``, from a sentence-transformers Pooling
module with several modes) concatenates their vectors in that order:
``[num_reqs, n_modes * hidden_size]``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from poolrunner.core import ModelConfig, ModelLoadError

PoolingMethod = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cls_pool(hidden_states: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """First token of each request (sentence-transformers' Pooling(cls))."""
    return hidden_states[query_start_loc[:-1]].float()


def last_pool(hidden_states: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """Last real token of each request (sentence-transformers' Pooling(lasttoken))."""
    return hidden_states[query_start_loc[1:] - 1].float()


def mean_pool(hidden_states: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """Mean over each request's tokens (sentence-transformers' Pooling(mean))."""
    lengths = query_start_loc.diff()
    return (_token_sums(hidden_states, _owners(lengths, hidden_states.shape[0]), lengths.numel())
            / lengths.unsqueeze(1)).float()


def mean_sqrt_len_pool(hidden_states: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """Sum over each request's ``n`` tokens divided by ``sqrt(n)``
    (sentence-transformers' Pooling(mean_sqrt_len_tokens))."""
    lengths = query_start_loc.diff()
    return (_token_sums(hidden_states, _owners(lengths, hidden_states.shape[0]), lengths.numel())
            / lengths.double().sqrt().unsqueeze(1)).float()


def max_pool(hidden_states: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """Per-dimension maximum over each request's tokens (sentence-transformers' Pooling(max)).

    sentence-transformers masks padding out of the maximum; packed rows have none, so the maximum
    runs over exactly the request's tokens (every request has at least one). Taken in the hidden
    states' dtype, where a maximum is exact, then returned as float32.
    """
    lengths = query_start_loc.diff()
    owner = _owners(lengths, hidden_states.shape[0])
    maxima = hidden_states.new_full((lengths.numel(), hidden_states.shape[1]), float("-inf"))
    maxima.scatter_reduce_(0, owner.unsqueeze(1).expand_as(hidden_states), hidden_states, reduce="amax")
    return maxima.float()


def weighted_mean_pool(hidden_states: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """Mean over each request's tokens weighted by position
    (sentence-transformers' Pooling(weightedmean)).

    The ``k``-th token of a request (from 1) has weight ``k``: the weights start at its first
    token wherever the request sits in the packed batch (sentence-transformers starts them at the
    first non-padding token), and the sum is divided by ``n (n + 1) / 2``.
    """
    lengths = query_start_loc.diff()
    owner = _owners(lengths, hidden_states.shape[0])
    positions = torch.arange(hidden_states.shape[0], device=hidden_states.device) - query_start_loc[:-1][owner]
    weights = (positions + 1).to(torch.float64).unsqueeze(1)
    totals = (lengths * (lengths + 1) // 2).to(torch.float64)  # exact in int64
    return (_token_sums(hidden_states * weights, owner, lengths.numel()) / totals.unsqueeze(1)).float()


POOLING_METHODS: dict[str, PoolingMethod] = {
    "CLS": cls_pool,
    "LAST": last_pool,
    "MEAN": mean_pool,
    "MAX": max_pool,
    "WEIGHTEDMEAN": weighted_mean_pool,
    "MEAN_SQRT_LEN": mean_sqrt_len_pool,
}


def pooling_method(model_config: ModelConfig) -> PoolingMethod:
    """The sequence pooling of ``model_config.pooling_type``: one method, or the concatenation
    of several (``"MEAN+MAX"``), in the order named.

    The method maps ``hidden_states`` ``[num_tokens, hidden_size]`` and ``query_start_loc``
    ``[num_reqs + 1]`` int64 to ``[num_reqs, n_modes * hidden_size]`` float32.

    :raises ModelLoadError: for a token-level pooling type (ALL, STEP), or when the first Dense
        layer does not take the pooled width (sentence-transformers could not run it either).
    """
    methods = [POOLING_METHODS.get(mode) for mode in model_config.pooling_modes]
    if None in methods:
        raise ModelLoadError(
            f"pooling_type {model_config.pooling_type!r} cannot pool a sequence; use one of {sorted(POOLING_METHODS)}"
        )
    width = len(methods) * model_config.hidden_size
    dense = model_config.dense_layers
    if dense and dense[0].in_features != width:
        raise ModelLoadError(
            f"pooling_type {model_config.pooling_type!r} gives {width} values per input, but the first "
            f"Dense layer ({dense[0].path}) takes {dense[0].in_features}"
        )
    if len(methods) == 1:
        return methods[0]  # type: ignore[return-value]  # None was refused above
    return functools.partial(_concatenated, tuple(methods))


def _concatenated(methods: Sequence[PoolingMethod], hidden_states: torch.Tensor,
                  query_start_loc: torch.Tensor) -> torch.Tensor:
    """The vectors of ``methods`` side by side, as sentence-transformers concatenates its modes."""
    return torch.cat([method(hidden_states, query_start_loc) for method in methods], dim=1)


def _owners(lengths: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[num_tokens]`` int64: the request each packed row belongs to."""
    # output_size: the total is known, so CUDA needs no host sync to size the result.
    return torch.repeat_interleave(
        torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=num_tokens
    )


def _token_sums(values: torch.Tensor, owner: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """``[num_reqs, hidden_size]`` float64: each request's rows of ``values`` (``[num_tokens,
    hidden_size]``, ``owner`` from :func:`_owners`) summed in float64. ``index_add_`` adds one
    token at a time, so a float32 sum's error grew with the length (4.8e-6 relative at 1,500
    tokens, where sentence-transformers' reduction has 7e-8)."""
    sums = torch.zeros(num_reqs, values.shape[1], dtype=torch.float64, device=values.device)
    sums.index_add_(0, owner, values.double())
    return sums
