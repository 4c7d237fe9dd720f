"""poolrunner's attention function for packed, padding-free batches.

Registered in transformers' attention-interface registry under :data:`ATTENTION_NAME`, so any
architecture whose transformers modelling code dispatches through ``ALL_ATTENTION_FUNCTIONS``
runs on packed inputs: the tokens of all requests form one sequence ``[1, num_tokens]`` and this
function keeps each request's attention inside its own span (causal or bidirectional, as the
layer says). No padding is computed and no ``[num_tokens, num_tokens]`` mask is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

ATTENTION_NAME = "poolrunner_packed"
SPANS_KWARG = "poolrunner_spans"
"""Forward keyword that carries the per-request ``(start, end)`` token spans (host ints)."""


def packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention within each request's span of a packed sequence.

    :param query: ``[1, num_heads, num_tokens, head_dim]``.
    :param key: ``[1, num_kv_heads, num_tokens, head_dim]`` (grouped-query heads allowed).
    :param value: Same shape as ``key``.
    :param attention_mask: Ignored: spans replace the mask (the mask builder returns ``None``).
    :param scaling: Softmax scale; ``head_dim ** -0.5`` when ``None``.
    :returns: ``([1, num_tokens, num_heads, head_dim], None)``, the layout transformers expects.
    :raises ValueError: if the forward call did not pass the spans.
    """
    spans: Sequence[tuple[int, int]] | None = kwargs.get(SPANS_KWARG)
    if spans is None:
        raise ValueError(f"{ATTENTION_NAME} attention needs the {SPANS_KWARG!r} forward argument")
    causal = bool(getattr(module, "is_causal", False))
    gqa = key.shape[1] != query.shape[1]
    output = torch.empty_like(query)
    for start, end in spans:
        output[:, :, start:end] = F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
            is_causal=causal, scale=scaling, enable_gqa=gqa,
        )
    return output.transpose(1, 2), None


def _no_mask(*_args: Any, **_kwargs: Any) -> None:
    # Spans carry the structure; transformers must not build a dense mask for us.
    return None


AttentionInterface.register(ATTENTION_NAME, packed_attention)
AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
