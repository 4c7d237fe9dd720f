"""The last encoder layer on the rows the poolers read, when they read only each request's first.

A CLS embedder (BGE, GTE, Arctic...) or a cross-encoder reads one row of each request from the
last layer, yet that layer runs its output projection, residual norm and MLP on every row. In a
step where every pooler reads only the first rows (:attr:`Pooler.reads_first_rows
<poolrunner.core.plugin_api.pooler.Pooler.reads_first_rows>`, the runner's decision:
``PackedLayout.first_rows_only``), the last layer of a BERT-code encoder attends as before (its
keys and values need every row, and so does its self-attention module, run unchanged) and runs the
rest on the first rows only; its other output rows are left zero, as nothing reads them.
all-MiniLM-L6-v2 as a CLS embedder on 2 Zen 4 cores: 1.10-1.12x, bf16 and float32 (bench/README.md).

Only a backbone whose forward, encoder, last layer, attention block and feed-forward chunk are
BERT's code (bytecode-identical copies included: RoBERTa's, XLM-R's) and whose layer has
no cross-attention gets this forward: their code is self-attention, then row-wise blocks, and the
encoder's output is the last layer's. Everything else in the step is unchanged.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from transformers.models.bert.modeling_bert import BertAttention, BertEncoder, BertLayer, BertModel

from poolrunner.core.kernels.attention import LAYOUT_KWARG
from poolrunner.core.kernels.onednn import code_key

_CODE = {
    "model": code_key(BertModel.forward), "encoder": code_key(BertEncoder.forward),
    "layer": code_key(BertLayer.forward), "attention": code_key(BertAttention.forward),
    "feed_forward": code_key(BertLayer.feed_forward_chunk),
}


def compute_first_rows_only(backbone: nn.Module) -> bool:
    """Give the last layer of ``backbone``, where it is a BERT-code encoder's, the forward that
    computes only the first rows in a step whose layout asks for them.

    :returns: Whether it did.
    """
    encoder = getattr(backbone, "encoder", None)
    layers = getattr(encoder, "layer", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return False
    last = layers[-1]
    attention = getattr(last, "attention", None)
    codes = {"model": type(backbone).forward, "encoder": type(encoder).forward, "layer": type(last).forward,
             "attention": type(attention).forward, "feed_forward": getattr(type(last), "feed_forward_chunk", None)}
    if any(code_key(function) != _CODE[name] for name, function in codes.items()):
        return False
    if getattr(last, "is_decoder", False) or hasattr(last, "crossattention") or attention.is_cross_attention:
        return False
    last.forward = types.MethodType(_forward, last)
    return True


def _forward(self: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
             encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: torch.Tensor | None = None,
             cache: Any = None, **kwargs: Any) -> torch.Tensor:
    """``[1, num_tokens, hidden]`` -> the same shape; with the step's layout asking for first rows
    only, those rows as the layer's own code computes them and zeros elsewhere."""
    layout = kwargs.get(LAYOUT_KWARG)
    if layout is None or not layout.first_rows_only or encoder_hidden_states is not None or cache is not None:
        return type(self).forward(self, hidden_states, attention_mask, encoder_hidden_states,
                                  encoder_attention_mask=encoder_attention_mask, cache=cache, **kwargs)
    rows = layout.first_rows(hidden_states.device)
    context, _ = self.attention.self(hidden_states, attention_mask=attention_mask, **kwargs)
    attention_output = self.attention.output(context.index_select(1, rows), hidden_states.index_select(1, rows))
    out = hidden_states.new_zeros(hidden_states.shape)
    return out.index_copy_(1, rows, self.feed_forward_chunk(attention_output))
