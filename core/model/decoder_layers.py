"""Llama-code decoder layers, each run by one function instead of transformers' layer and attention modules.

The decoder embedders (Qwen3-Embedding, gte-Qwen2, e5-mistral, SmolLM2...) run a layer as a
decoder-layer module and an attention module, each behind transformers' decorated forwards:
SmolLM2-135M embedding one 31-token paragraph a call spent 36.8 ms in the backbone, about 30 ms of
it in operators, on 2 Zen 4 cores (bf16): some 230 us of Python a layer. A layer whose forward is
``LlamaDecoderLayer``'s code (74 classes of transformers 5 share it) and whose attention is one of
:data:`_ATTENTIONS` (Llama's and its copies: Gemma, Granite, GLM...; Qwen2's, Qwen3's with its
per-head norms, Mistral's) gets :func:`_forward`: the same operations on the same modules, in the
same order, with the attention inlined and query, key and value as one product where they are
prepacked alike (:mod:`~poolrunner.core.kernels.joined_projections`). The rotary embedding is the
one the attention module itself calls (poolrunner's kernel where
:mod:`~poolrunner.core.kernels.fused_rotary` gave it one). Where the backbone's forward is one of
:data:`_STACKS`, the last layer runs its output projection and MLP on the rows the poolers read
only (each request's last token for LAST pooling and decoder score heads:
:mod:`~poolrunner.core.model.inlined_blocks`).

The layer is still called as a module (int8's block replay, transformers' hidden-state capture);
a layer whose attention module has hooks (transformers' attention capture), with global module
hooks, in training or given a cache runs transformers' own forward.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
from attrs import frozen
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer, LlamaModel
from transformers.models.mistral.modeling_mistral import MistralAttention, MistralModel
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2Model
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3Model

from poolrunner.core.kernels.joined_projections import JoinedProjections, project
from poolrunner.core.kernels.onednn import code_key
from poolrunner.core.model.inlined_blocks import after_attention, hooked, mark_last_layer


@frozen
class _Attention:
    """What an attention code does beyond Llama's."""

    head_norms: bool = False
    """``q_norm`` / ``k_norm`` on each head's query and key before the rotary (Qwen3)."""
    window: str | None = None
    """The ``sliding_window`` it hands the attention function: none (Llama), the module's
    ``sliding_window`` (``"module"``: Qwen2, Qwen3) or the config's (``"config"``: Mistral)."""


_ATTENTIONS = {
    code_key(LlamaAttention.forward): _Attention(),
    code_key(Qwen2Attention.forward): _Attention(window="module"),
    code_key(Qwen3Attention.forward): _Attention(head_norms=True, window="module"),
    code_key(MistralAttention.forward): _Attention(window="config"),
}
_LAYER = code_key(LlamaDecoderLayer.forward)
_STACKS = frozenset(code_key(model.forward) for model in (LlamaModel, MistralModel, Qwen2Model, Qwen3Model))
"""Backbone forwards whose output is the last layer's but for the final norm (position-wise)."""
_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


@frozen
class _Inlined:
    """A layer's attention, as :func:`_forward` runs it."""

    kind: _Attention
    rotary: Callable[..., Any]  # apply_rotary_pos_emb as the attention module calls it
    eager: Callable[..., Any]  # the attention function of its module, transformers' default


def run_layers_directly(backbone: nn.Module) -> bool:
    """Give every layer of ``backbone``, where all are Llama-code decoder layers with a known
    attention, :func:`_forward`, and query, key and value one product where they are prepacked alike.

    :returns: Whether the last layer can compute only the rows the poolers read (the backbone's
        forward is one of :data:`_STACKS`); ``False`` also when nothing was changed.
    """
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return False
    inlined = [_inlined(layer) for layer in layers]
    if any(entry is None for entry in inlined):
        return False
    for layer, entry in zip(layers, inlined, strict=True):
        JoinedProjections.install(layer.self_attn, _PROJECTIONS)
        layer._poolrunner_inlined = entry
        layer.forward = types.MethodType(_forward, layer)
    return mark_last_layer(layers, code_key(type(backbone).forward) in _STACKS)


def _inlined(layer: nn.Module) -> _Inlined | None:
    """How to run ``layer``'s attention inline, or ``None`` where its code is not known."""
    attention = getattr(layer, "self_attn", None)
    if code_key(type(layer).forward) != _LAYER or attention is None:
        return None
    kind = _ATTENTIONS.get(code_key(type(attention).forward))
    own = vars(attention).get("forward")  # fused_rotary's: the class's code over other globals
    function = own.__func__ if isinstance(own, types.MethodType) else type(attention).forward
    if kind is None or code_key(function) != code_key(type(attention).forward):
        return None
    names = inspect.unwrap(function).__globals__
    rotary, eager = names.get("apply_rotary_pos_emb"), names.get("eager_attention_forward")
    return None if rotary is None or eager is None else _Inlined(kind, rotary, eager)


def _forward(self: nn.Module, hidden_states: torch.Tensor, attention_mask: Any = None,
             position_ids: torch.Tensor | None = None, cache: Any = None, use_cache: bool | None = False,
             position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs: Any) -> torch.Tensor:
    """``LlamaDecoderLayer.forward`` with its attention inlined: ``[batch, tokens, hidden]`` -> the same shape.
    With the step's layout asking for some rows only (the last layer, :func:`after_attention`),
    those rows as the layer's code computes them and zeros elsewhere."""
    attention, inlined = self.self_attn, self._poolrunner_inlined
    if self.training or cache is not None or position_embeddings is None or hooked((attention,)):
        return type(self).forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    heads = (*hidden_states.shape[:-1], -1, attention.head_dim)
    query, key, value = (t.view(heads) for t in project(attention, _PROJECTIONS, hidden_states))
    if inlined.kind.head_norms:
        query, key = attention.q_norm(query), attention.k_norm(key)
    query, key = inlined.rotary(query.transpose(1, 2), key.transpose(1, 2), *position_embeddings)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(attention.config._attn_implementation, inlined.eager)
    context, _ = attend(attention, query, key, value.transpose(1, 2), attention_mask, dropout=0.0,
                        scaling=attention.scaling, **_window(inlined.kind, attention), position_ids=position_ids,
                        use_cache=use_cache, **kwargs)
    return after_attention(self, kwargs, context, residual, _row_blocks)


def _row_blocks(layer: nn.Module, context: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The layer after its attention, each row alone: the output projection and residual, then the MLP block."""
    hidden_states = residual + layer.self_attn.o_proj(context)
    return hidden_states + layer.mlp(layer.post_attention_layernorm(hidden_states))


def _window(kind: _Attention, attention: nn.Module) -> dict[str, Any]:
    """The ``sliding_window`` argument the attention code passes, if it passes one."""
    if kind.window == "module":
        return {"sliding_window": attention.sliding_window}
    if kind.window == "config":
        return {"sliding_window": getattr(attention.config, "sliding_window", None)}
    return {}
