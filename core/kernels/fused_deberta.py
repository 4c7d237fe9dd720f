"""DeBERTa-v2 / v3's disentangled self-attention with the scores, softmax and values product in
one call of torch's scaled_dot_product_attention.

transformers' ``DisentangledSelfAttention`` (DeBERTa-v3 cross-encoders, NLI and zero-shot
classifiers, mxbai-rerank-v1) is eager code that costs a bfloat16 pass of deberta-v3-base's
shape three quarters of its time outside the linear layers (20 inputs of 200 tokens, two AMX
Xeon cores): queries, keys and values copied per head; the relative positions' projections
made for all ``2 * position_buckets`` positions and copied once per input and head; the scores,
the content-to-position (c2p) and position-to-content (p2c) terms each divided, added and
masked as a pass over ``[batch, heads, tokens, tokens]``; then a softmax and a product.

Here, per layer, with ``r[i, j] = clamp(bucket(i - j) + span, 0, 2 span - 1)`` the index of
the relative position of query ``i`` to key ``j`` (bucket and span as transformers computes
them; bucket is odd, so p2c's index ``clamp(-bucket(j - i) + span)`` is the same ``r[i, j]``):

    score[i, j] = (q_i . k_j + q_i . pos_key[r[i, j]] + k_j . pos_query[r[i, j]]) / sqrt(d * f)

with ``f`` = 1 plus one per term in ``pos_att_type``. Only the positions an input of this
length uses (``r``'s range, at most ``2 * tokens - 1`` of them) are projected, once per layer
and shared by the batch and its heads (broadcast, not copied); the two position terms are
gathered, summed, scaled and masked into SDPA's additive ``attn_mask``; SDPA computes
``q . k`` scaled, the softmax and the values product in one kernel (float32 scores and
softmax). Masked entries get ``finfo.min`` as transformers' ``masked_fill`` gives them, so a
padding row attends uniformly, as there. Float32 results equal the eager code's to rounding;
in bfloat16 they are no further from float64 than its own. ``output_attentions``, training and
the cases this module does not cover (``query_states`` given, ``relative_pos`` absent or
batch-wise: transformers' encoder passes one for all) run the module's own code. Each module
gets the fused forward as its own (no global patch), only where its class's code is
transformers' ``DisentangledSelfAttention``'s.
"""

from __future__ import annotations

import functools
import math
import types

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deberta_v2.modeling_deberta_v2 import DisentangledSelfAttention

from poolrunner.core.kernels import cpu_kernels
from poolrunner.core.kernels.onednn import code_key

_CODE = (code_key(DisentangledSelfAttention.forward), code_key(DisentangledSelfAttention.disentangled_attention_bias))


def fuse_deberta_attention(module: nn.Module, kernels: frozenset[torch.dtype] = frozenset()) -> int:
    """Give each ``DisentangledSelfAttention``-code module inside ``module`` the fused forward.

    :param kernels: The dtypes whose bias is made by poolrunner's CPU kernel
        (:func:`~poolrunner.core.kernels.cpu_kernels.relative_bias`) on a CPU; others by torch.
    :returns: The number of modules changed.
    """
    changed = 0
    for child in module.modules():
        kind = type(child)
        if (code_key(kind.forward), code_key(getattr(kind, "disentangled_attention_bias", None))) == _CODE:
            child.forward = types.MethodType(functools.partial(_forward, kernels=kernels), child)
            changed += 1
    return changed


def _forward(self: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor,
             output_attentions: bool = False, query_states: torch.Tensor | None = None,
             relative_pos: torch.Tensor | None = None, rel_embeddings: torch.Tensor | None = None, *,
             kernels: frozenset[torch.dtype]) -> tuple[torch.Tensor, None]:
    """``[batch, tokens, hidden]`` -> ``(context [batch, tokens, heads * head_size], None)``, as
    the module's own forward returns it; ``attention_mask`` is the encoder's ``[batch, 1, tokens,
    tokens]`` (or ``[batch, tokens, tokens]``) mask of the pairs that may attend."""
    batch, tokens = hidden_states.shape[:2]
    own_code = (output_attentions or self.training or query_states is not None or attention_mask.dim() not in (3, 4)
                or (self.relative_attention and (rel_embeddings is None or not _shared(relative_pos, tokens))))
    if own_code:
        return type(self).forward(self, hidden_states, attention_mask, output_attentions, query_states, relative_pos,
                                  rel_embeddings)
    # [heads, batch, tokens, head_size] views: the position terms' products then run per head
    # over the whole batch, with no copy of the positions' projections per input
    shape = (batch, tokens, self.num_attention_heads, -1)
    q, k, v = (layer(hidden_states).view(shape).permute(2, 0, 1, 3)
               for layer in (self.query_proj, self.key_proj, self.value_proj))
    factor = 1 + sum(kind in self.pos_att_type for kind in ("c2p", "p2c"))
    scale = 1 / math.sqrt(q.shape[-1] * factor)
    mask = attention_mask.bool() if attention_mask.dim() == 4 else attention_mask.bool().unsqueeze(1)
    mask = mask.expand(batch, 1, tokens, tokens).reshape(batch, tokens, tokens)  # a key mask [b, 1, 1, t] too
    terms = _position_terms(self, q, k, scale, relative_pos, rel_embeddings) if self.relative_attention else None
    if terms is not None and q.device.type == "cpu" and q.dtype in kernels:
        bias = cpu_kernels.relative_bias(*terms, mask)
    else:
        bias = _bias(terms, mask, q)
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.view(*q.shape[:2], tokens, tokens), scale=scale)
    return context.permute(1, 2, 0, 3).reshape(batch, tokens, -1), None


def _shared(relative_pos: torch.Tensor | None, tokens: int) -> bool:
    """Whether ``relative_pos`` is the encoder's one ``[tokens, tokens]`` matrix for every input."""
    return (relative_pos is not None and relative_pos.shape[-2:] == (tokens, tokens)
            and relative_pos.numel() == tokens ** 2)


def _position_terms(self: nn.Module, q: torch.Tensor, k: torch.Tensor, scale: float,
                    relative_pos: torch.Tensor, rel_embeddings: torch.Tensor,
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor] | None:
    """The c2p products ``rows[h * batch + b, i, r] = q_i . pos_key[r] * scale``, the p2c products
    ``cols[h * batch + b, j, r] = k_j . pos_query[r] * scale`` (each ``None`` unless
    ``pos_att_type`` names it), ``[heads * batch, tokens, positions]``, and ``index``, int64
    ``[tokens, tokens]``: the position ``r`` of each query-key pair, for ``q`` and ``k``
    ``[heads, batch, tokens, head_size]``; ``None`` when ``pos_att_type`` names neither term.
    Only the positions an input of this length uses are projected: ``positions`` is at most
    ``2 * tokens - 1``."""
    if not {"c2p", "p2c"} & set(self.pos_att_type):
        return None
    heads, batch, tokens, size = q.shape
    span = self.pos_ebd_size
    index = torch.clamp(relative_pos.reshape(tokens, tokens).to(device=q.device, dtype=torch.long) + span, 0,
                        2 * span - 1)
    low, high = int(index.min()), int(index.max()) + 1
    positions = rel_embeddings[low:high]

    def products(states: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        # [heads, head_size, positions], scaled here (the smaller side) rather than the products
        projected = (layer(positions) * scale).view(high - low, heads, size).permute(1, 2, 0)
        return torch.bmm(states.reshape(heads, batch * tokens, size), projected).view(heads * batch, tokens, -1)

    rows = cols = None
    if "c2p" in self.pos_att_type:
        rows = products(q, self.key_proj if self.share_att_key else self.pos_key_proj)
    if "p2c" in self.pos_att_type:
        cols = products(k, self.query_proj if self.share_att_key else self.pos_query_proj)
    return rows, cols, index - low


def _bias(terms: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor] | None, mask: torch.Tensor,
          q: torch.Tensor) -> torch.Tensor:
    """What :func:`~poolrunner.core.kernels.cpu_kernels.relative_bias` computes from ``terms``
    (:func:`_position_terms`' ``rows, cols, index``, or ``None``: no position terms), in torch
    operations, for other devices and dtypes: ``[heads * batch, tokens, tokens]`` of ``q``'s dtype."""
    heads, batch, tokens = q.shape[:3]
    bias = torch.zeros((heads * batch, tokens, tokens), dtype=q.dtype, device=q.device)
    if terms is not None:
        rows, cols, index = terms
        steps = torch.arange(tokens, device=q.device)
        if rows is not None:  # rows[g, i, index[i, j]]
            bias += rows[:, steps[:, None], index]
        if cols is not None:  # cols[g, j, index[i, j]]
            bias += cols[:, steps[None, :], index]
    masked = ~mask.expand(heads, batch, tokens, tokens).reshape(heads * batch, tokens, tokens)
    return bias.masked_fill_(masked, torch.finfo(q.dtype).min)
