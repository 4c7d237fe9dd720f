"""BERT-code encoder layers, each run by one function instead of transformers' module tree.

transformers runs a BERT layer as six modules (layer, attention block, self-attention,
self-output, intermediate, output), three of them behind decorated forwards, and its MLP through
``apply_chunking_to_forward``, which calls ``inspect.signature`` every layer. With
the products prepacked that Python is a large part of a small step: all-MiniLM-L6-v2 embedding
one 31-token paragraph a call spends about 5.7 ms in the backbone, 4 ms of it in operators, on
2 Zen 4 cores. A layer whose code is all BERT's (bytecode-identical copies included: RoBERTa's,
XLM-R's, ELECTRA's, ERNIE's, CamemBERT's...) gets :func:`_forward`: the same operations on the
same modules, in the same order, called directly; only the wrappers and the identity dropouts
are gone. The layer itself is still called as a module, so hooks on layers (int8's block
replay, transformers' hidden-state capture) see every call; a layer with hooks on a block it
inlines (transformers' attention capture hooks the self-attention) or global module hooks, in
training, given cross-attention inputs or a cache, or chunking its feed-forward runs
transformers' own forward.

Two more changes ride on it:

- **Query, key and value in one product**, where the three are prepacked alike
  (:mod:`~poolrunner.core.kernels.joined_projections`).
- **The last layer on the rows the poolers read** (:mod:`~poolrunner.core.model.inlined_blocks`):
  its output block and MLP on each request's first row only in a step of CLS poolers.
  all-MiniLM-L6-v2 as a CLS embedder on 2 Zen 4 cores: 1.10-1.12x, bf16 and float32
  (bench/README.md). Only where the backbone's and encoder's forwards are BERT's, so the
  encoder's output is the last layer's.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bert import modeling_bert as bert

from poolrunner.core.kernels.joined_projections import JoinedProjections, project
from poolrunner.core.kernels.onednn import code_key
from poolrunner.core.model.inlined_blocks import after_attention, hooked, mark_last_layer

_LAYER_CODE = {
    "layer": code_key(bert.BertLayer.forward), "feed_forward": code_key(bert.BertLayer.feed_forward_chunk),
    "attention": code_key(bert.BertAttention.forward), "self": code_key(bert.BertSelfAttention.forward),
    "self_output": code_key(bert.BertSelfOutput.forward), "intermediate": code_key(bert.BertIntermediate.forward),
    "output": code_key(bert.BertOutput.forward),
}
_STACK_CODE = {"model": code_key(bert.BertModel.forward), "encoder": code_key(bert.BertEncoder.forward)}
_PROJECTIONS = ("query", "key", "value")


def run_layers_directly(backbone: nn.Module) -> bool:
    """Give every layer of ``backbone``, where all are BERT-code encoder layers, :func:`_forward`,
    and query, key and value one product where they are prepacked alike.

    :returns: Whether the last layer can compute only the rows the poolers read (the backbone's
        and encoder's forwards are BERT's too); ``False`` also when nothing was changed.
    """
    encoder = getattr(backbone, "encoder", None)
    layers = getattr(encoder, "layer", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0 or not all(_is_bert_layer(layer) for layer in layers):
        return False
    for layer in layers:
        JoinedProjections.install(layer.attention.self, _PROJECTIONS)
        layer.forward = types.MethodType(_forward, layer)
    stack = {"model": type(backbone).forward, "encoder": type(encoder).forward}
    return mark_last_layer(layers, all(code_key(function) == _STACK_CODE[name] for name, function in stack.items()))


def _is_bert_layer(layer: nn.Module) -> bool:
    """Whether ``layer`` and its blocks run BERT's code, as a self-attending encoder layer."""
    attention = getattr(layer, "attention", None)
    blocks = {"layer": layer, "attention": attention, "self": getattr(attention, "self", None),
              "self_output": getattr(attention, "output", None), "intermediate": getattr(layer, "intermediate", None),
              "output": getattr(layer, "output", None)}
    if any(block is None or code_key(type(block).forward) != _LAYER_CODE[name] for name, block in blocks.items()):
        return False
    if code_key(getattr(type(layer), "feed_forward_chunk", None)) != _LAYER_CODE["feed_forward"]:
        return False
    return not (getattr(layer, "is_decoder", False) or hasattr(layer, "crossattention")
                or attention.is_cross_attention)


def _forward(self: nn.Module, hidden_states: torch.Tensor, attention_mask: Any = None,
             encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: Any = None,
             cache: Any = None, **kwargs: Any) -> torch.Tensor:
    """``BertLayer.forward`` with its blocks inlined: ``[batch, tokens, hidden]`` -> the same shape.
    With the step's layout asking for some rows only (the last layer, :func:`after_attention`),
    those rows as the layer's code computes them and zeros elsewhere."""
    attention = self.attention.self
    if (self.training or encoder_hidden_states is not None or cache is not None or self.chunk_size_feed_forward
            or hooked((self.attention, attention, self.attention.output, self.intermediate, self.output))):
        return type(self).forward(self, hidden_states, attention_mask, encoder_hidden_states,
                                  encoder_attention_mask=encoder_attention_mask, cache=cache, **kwargs)
    heads = (*hidden_states.shape[:-1], -1, attention.attention_head_size)
    query, key, value = (t.view(heads).transpose(1, 2) for t in project(attention, _PROJECTIONS, hidden_states))
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(attention.config._attn_implementation, bert.eager_attention_forward)
    context, _ = attend(attention, query, key, value, attention_mask, dropout=0.0, scaling=attention.scaling, **kwargs)
    return after_attention(self, kwargs, context, hidden_states, _row_blocks)


def _row_blocks(layer: nn.Module, context: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    """The layer's blocks after attention, each row alone: ``BertSelfOutput``, then the
    feed-forward chunk (``BertIntermediate``, ``BertOutput``); dropouts are the identity here."""
    self_output, intermediate, output = layer.attention.output, layer.intermediate, layer.output
    attended = self_output.LayerNorm(self_output.dense(context) + hidden_states)
    inner = intermediate.dense(attended)
    if type(intermediate.intermediate_act_fn) is not nn.Identity:  # nn.Identity: fused into the product
        inner = intermediate.intermediate_act_fn(inner)
    return output.LayerNorm(output.dense(inner) + attended)
