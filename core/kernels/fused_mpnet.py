"""MPNet's self-attention in one call of torch's scaled_dot_product_attention.

transformers' ``MPNetSelfAttention`` (all-mpnet-base-v2 and the other MPNet embedders) runs its
attention as eager code: a product for the scores, a division, the relative position bias and
the padding mask added, a softmax and a product with the values, each a pass over
``[batch, heads, tokens, tokens]`` rounded to the model's dtype: 43% of a bfloat16 pass of
mpnet-base's shape on two AMX Xeon cores (20 inputs of 200 tokens). SDPA computes the same
function in one fused kernel (float32 scores and softmax; in bfloat16 the products on AMX tiles
where the CPU has them), the bias and the mask added to the scores as its ``attn_mask``. The bias
and the mask are the same for every layer of a forward (the encoder computes the bias once), so
their sum is made by the first layer and reused by the others (:class:`_MaskSum`).

Results equal the eager code's to float32 rounding in float32 (the scale, ``1 / sqrt(head_size)``,
is exact for MPNet's 64-wide heads); in bfloat16 SDPA rounds less and comes closer to float32.
``output_attentions`` and training run the module's own code. Each module gets the fused forward
as its own (no global patch), only where its class's forward is ``MPNetSelfAttention.forward``'s
code; its query, key and value become one product where they are prepacked alike
(:mod:`~poolrunner.core.kernels.joined_projections`; mpnet-base's ``[31, 768] x [768, 2304]`` in
bf16 on 2 Zen 4 cores: 288 us against 339 us for the three).
"""

from __future__ import annotations

import math
import types
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.mpnet.modeling_mpnet import MPNetSelfAttention

from poolrunner.core.kernels.joined_projections import JoinedProjections, project
from poolrunner.core.kernels.onednn import code_key

_CODE = code_key(MPNetSelfAttention.forward)
_PROJECTIONS = ("q", "k", "v")


def fuse_mpnet_attention(module: nn.Module, *, join_projections: bool) -> int:
    """Give each ``MPNetSelfAttention``-code module inside ``module`` a forward that attends in one
    SDPA call; the modules of one call share one :class:`_MaskSum`.

    :param join_projections: Query, key and value as one product where they are prepacked alike
        (:mod:`~poolrunner.core.kernels.joined_projections`); not where adapters find them by name.
    :returns: The number of modules changed.
    """
    masks = _MaskSum()
    changed = 0
    for child in module.modules():
        if code_key(type(child).forward) == _CODE:
            if join_projections:
                JoinedProjections.install(child, _PROJECTIONS)
            child.forward = types.MethodType(_attention(masks), child)
            changed += 1
    return changed


def _attention(masks: _MaskSum) -> Any:
    """The fused forward of an ``MPNetSelfAttention``-code module, summing masks in ``masks``."""

    def forward(self: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_bias: torch.Tensor | None = None, output_attentions: bool = False,
                **kwargs: Any) -> tuple[torch.Tensor]:
        """``[batch, tokens, hidden]`` -> ``(output,)``, as the module's own forward returns it."""
        if output_attentions or self.training:  # the probabilities, or dropout: the module's own code
            return type(self).forward(self, hidden_states, attention_mask, position_bias, output_attentions, **kwargs)
        shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
        q, k, v = (t.view(shape).transpose(1, 2) for t in project(self, _PROJECTIONS, hidden_states))
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=masks.sum(position_bias, attention_mask),
                                                 scale=1 / math.sqrt(self.attention_head_size))
        context = context.transpose(1, 2).reshape(*hidden_states.shape[:-1], self.all_head_size)
        return (self.o(context),)

    return forward


class _MaskSum:
    """``position_bias + attention_mask`` of the forward running now: made by its first layer and
    reused by the others while the bias tensor lives (the encoder makes a new one per forward);
    dropped with it, so no ``[batch, heads, tokens, tokens]`` tensor outlives its forward."""

    def __init__(self) -> None:
        self._entry: tuple[weakref.ref, weakref.ref, torch.Tensor] | None = None

    def sum(self, bias: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor | None:
        """``bias + mask``, either one alone when the other is ``None``."""
        if bias is None or mask is None:
            return mask if bias is None else bias
        entry = self._entry
        if entry is not None and entry[0]() is bias and entry[1]() is mask:
            return entry[2]
        total = bias + mask
        self._entry = (weakref.ref(bias, self._drop), weakref.ref(mask), total)
        return total

    def _drop(self, ref: weakref.ref) -> None:
        if self._entry is not None and self._entry[0] is ref:
            self._entry = None
