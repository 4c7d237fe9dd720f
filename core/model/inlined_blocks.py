"""What the layers poolrunner runs by one function share: when one must run transformers' own
forward instead, and which rows the backbone's last layer computes.

:mod:`~poolrunner.core.model.bert_layers` and :mod:`~poolrunner.core.model.decoder_layers` call
some of a layer's blocks' code directly rather than as modules; a forward hook on such a block
(transformers' attention capture hooks the attention modules) or a global module hook would then
never fire, so those calls go through transformers' forward (:func:`hooked`).

**The last layer on the rows the poolers read**: in a step where every pooler reads only each
request's first row, or only its last (:attr:`Pooler.reads_rows
<poolrunner.core.plugin_api.pooler.Pooler.reads_rows>`, the runner's decision:
``PackedLayout.rows``), the backbone's last layer attends as before (keys and values need every
row) and runs what follows the attention on those rows only; its other rows are left zero, as
nothing reads them (:func:`read_rows`). Only on a layer :func:`mark_last_layer` marked: the last
of a backbone whose forward is known code, so that its output is the backbone's but for
position-wise steps (a final norm).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from poolrunner.core.kernels.attention import LAYOUT_KWARG

_LAST_LAYER = "_poolrunner_last_layer"
"""A layer's attribute: ``True`` on a backbone's last layer that may compute the read rows only."""


def hooked(blocks: Iterable[nn.Module]) -> bool:
    """Whether a forward hook waits on one of ``blocks`` or on every module."""
    return (any(block._forward_hooks or block._forward_pre_hooks for block in blocks)
            or bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks))


def mark_last_layer(layers: nn.ModuleList, known_stack: bool) -> bool:
    """Let the last of ``layers`` compute the read rows only, where ``known_stack`` (the
    backbone's forward is known code); ``known_stack``."""
    setattr(layers[-1], _LAST_LAYER, known_stack)
    return known_stack


def after_attention(layer: nn.Module, kwargs: Mapping[str, Any], context: torch.Tensor, residual: torch.Tensor,
                    blocks: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``blocks(layer, context, residual)``, what follows ``layer``'s attention (each row alone), on
    every row, or on the rows :func:`read_rows` names and zeros elsewhere: ``context`` the
    attention's ``[batch, tokens, heads, head_dim]`` output, ``residual`` ``[batch, tokens, hidden]``
    -> ``[batch, tokens, hidden]``."""
    context = context.reshape(*residual.shape[:-1], -1).contiguous()
    rows = read_rows(layer, kwargs, residual.device)
    if rows is None:
        return blocks(layer, context, residual)
    computed = blocks(layer, context.index_select(1, rows), residual.index_select(1, rows))
    return residual.new_zeros(residual.shape).index_copy_(1, rows, computed)


def read_rows(layer: nn.Module, kwargs: Mapping[str, Any], device: torch.device) -> torch.Tensor | None:
    """The rows ``layer`` computes after its attention: each request's first or last row in the
    packed step (``[num_reqs]`` int64) where the step's layout asks for them and ``layer`` is a
    marked last layer; ``None``: every row."""
    layout = kwargs.get(LAYOUT_KWARG)
    if layout is None or layout.rows == "all" or not getattr(layer, _LAST_LAYER, False):
        return None
    return layout.read_rows(device)
