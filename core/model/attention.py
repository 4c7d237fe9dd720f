"""poolrunner's attention function for packed, padding-free batches.

Registered in transformers' attention-interface registry under :data:`ATTENTION_NAME`, so any
architecture whose transformers modelling code dispatches through ``ALL_ATTENTION_FUNCTIONS``
runs on packed inputs: the tokens of all requests form one sequence ``[1, num_tokens]``, and
attention stays inside each request's span (causal or bidirectional, as the layer says).

Linear layers see only real tokens. Attention itself is computed in a few fused calls: requests
of similar length are grouped, padded to the group's longest and masked, which is far faster on
the CPU than one small kernel call per request while bounding the padded work (see
:func:`PackedLayout.build`). The layout is built once per step and shared by every layer.

Chunked prefill (causal models): a request whose prompt runs over several steps has a
:class:`KVCache`; its chunk attends to the cached keys and values of its earlier chunks plus its
own, and stores them for the next chunk unless this is its last.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from attrs import frozen
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

ATTENTION_NAME = "poolrunner_packed"
LAYOUT_KWARG = "poolrunner_layout"
"""Forward keyword that carries the step's :class:`PackedLayout`."""

# A group grows while its padded size stays within this factor of its real tokens.
MAX_PADDING_RATIO = 1.25


@frozen(eq=False)
class _Group:
    """Requests attended in one call: ``count`` rows padded to ``length`` tokens."""

    count: int
    length: int
    gather: torch.Tensor  # [count * length] flat token index of each padded slot (pads -> 0)
    valid: torch.Tensor  # [num_real] padded slots that hold real tokens
    dest: torch.Tensor  # [num_real] flat token index of each of those slots
    key_mask: torch.Tensor | None  # [count, 1, 1, length] True where a key is real; None if unpadded


class KVCache:
    """Keys and values of a request's earlier chunks, per layer: ``[1, kv_heads, tokens, head_dim]``.

    Owned by the runner for as long as the request is being prefilled; every stored tensor owns
    its storage (never a view of a step's buffers, which the next step reuses).
    """

    def __init__(self) -> None:
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


@frozen(eq=False)
class _CachedSpan:
    """A chunk of a request prefilled over several steps: tokens ``start:end`` of the step."""

    start: int
    end: int
    cache: KVCache
    store: bool  # keep this chunk's keys and values: more chunks follow


@frozen(eq=False)
class PackedLayout:
    """How the packed tokens of one step split into attention groups and cached chunks."""

    num_tokens: int
    groups: tuple[_Group, ...]
    cached: tuple[_CachedSpan, ...]
    causal: bool  # for layers that do not say themselves (``module.is_causal``)

    @classmethod
    def build(
        cls, lengths: Sequence[int], device: torch.device, *, causal: bool,
        caches: Sequence[tuple[KVCache, bool] | None] = (),
    ) -> PackedLayout:
        """Group requests of similar length; ``lengths[i]`` tokens belong to request ``i``.

        Requests are sorted by length and a group is closed when padding it to its longest
        member would exceed :data:`MAX_PADDING_RATIO` times its real tokens. A request with an
        entry ``(cache, store)`` in ``caches`` is a prefill chunk and attends on its own.
        """
        starts = [0]
        for length in lengths:
            starts.append(starts[-1] + length)
        chunked = {i: entry for i, entry in enumerate(caches) if entry is not None}
        cached = tuple(
            _CachedSpan(starts[i], starts[i + 1], cache, store) for i, (cache, store) in chunked.items()
        )
        order = sorted((i for i in range(len(lengths)) if i not in chunked), key=lambda i: lengths[i])
        groups, members = [], []
        for i in order:
            candidate = members + [i]
            if members and lengths[i] * len(candidate) > MAX_PADDING_RATIO * sum(lengths[j] for j in candidate):
                groups.append(_make_group(members, lengths, starts, device))
                candidate = [i]
            members = candidate
        if members:
            groups.append(_make_group(members, lengths, starts, device))
        return cls(num_tokens=starts[-1], groups=tuple(groups), cached=cached, causal=causal)


def _make_group(members: list[int], lengths: Sequence[int], starts: list[int], device: torch.device) -> _Group:
    longest = max(lengths[i] for i in members)
    gather, valid, dest = [], [], []
    for row, i in enumerate(members):
        tokens = list(range(starts[i], starts[i] + lengths[i]))
        gather.extend(tokens + [0] * (longest - lengths[i]))
        valid.extend(range(row * longest, row * longest + lengths[i]))
        dest.extend(tokens)
    key_mask = None
    if any(lengths[i] != longest for i in members):
        real = torch.tensor([lengths[i] for i in members])
        key_mask = (torch.arange(longest)[None, :] < real[:, None])[:, None, None, :].to(device)

    def to_device(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

    return _Group(len(members), longest, to_device(gather), to_device(valid), to_device(dest), key_mask)


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
    :param attention_mask: Ignored: the layout replaces the mask (the mask builder returns ``None``).
    :param scaling: Softmax scale; ``head_dim ** -0.5`` when ``None``.
    :returns: ``([1, num_tokens, num_heads, head_dim], None)``, the layout transformers expects.
    :raises ValueError: if the forward call did not pass the layout.
    """
    layout: PackedLayout | None = kwargs.get(LAYOUT_KWARG)
    if layout is None:
        raise ValueError(f"{ATTENTION_NAME} attention needs the {LAYOUT_KWARG!r} forward argument")
    causal = bool(getattr(module, "is_causal", layout.causal))
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [num_tokens, heads, head_dim]
    output = q.new_empty(q.shape)
    output[layout.num_tokens :] = 0  # rows past the requests' tokens pad the step to a bucket
    for group in layout.groups:
        padded = [_pad(t, group) for t in (q, k, v)]
        attended = F.scaled_dot_product_attention(
            *padded, attn_mask=_mask(group, causal), is_causal=causal and group.key_mask is None,
            scale=scaling, enable_gqa=k.shape[1] != q.shape[1],
        )
        rows = attended.transpose(1, 2).reshape(group.count * group.length, *q.shape[1:])
        output.index_copy_(0, group.dest, rows.index_select(0, group.valid))
    for span in layout.cached:
        output[span.start : span.end] = _attend_chunk(module, span, q, k, v, scaling)
    return output.unsqueeze(0), None


def _attend_chunk(
    module: nn.Module, span: _CachedSpan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None,
) -> torch.Tensor:
    """A causal chunk over its request's cached keys and values plus its own: ``[chunk, heads, dim]``."""
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError(f"chunked prefill needs attention layers with a layer_idx; {type(module).__name__} has none")
    keys, values = (t[span.start : span.end].transpose(0, 1).unsqueeze(0) for t in (k, v))  # [1, kv, chunk, d]
    past_kv = span.cache.layers.get(layer)
    if past_kv is not None:
        keys, values = torch.cat([past_kv[0], keys], dim=2), torch.cat([past_kv[1], values], dim=2)
    if span.store:  # a first chunk is a view of this step's buffers: copy it out
        span.cache.layers[layer] = (keys, values) if past_kv is not None else (keys.clone(), values.clone())
    chunk, past = span.end - span.start, keys.shape[2] - (span.end - span.start)
    # Query i (absolute position past + i) sees keys 0..past + i.
    mask = torch.ones(chunk, past + chunk, dtype=torch.bool, device=q.device).tril(diagonal=past)
    query = q[span.start : span.end].transpose(0, 1).unsqueeze(0)
    attended = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=keys.shape[1] != query.shape[1],
    )
    return attended[0].transpose(0, 1)


def _pad(tokens: torch.Tensor, group: _Group) -> torch.Tensor:
    """``[num_tokens, heads, head_dim]`` -> ``[count, heads, length, head_dim]``."""
    rows = tokens.index_select(0, group.gather)
    return rows.view(group.count, group.length, *tokens.shape[1:]).transpose(1, 2)


def _mask(group: _Group, causal: bool) -> torch.Tensor | None:
    if group.key_mask is None or not causal:
        return group.key_mask
    lower = torch.ones(group.length, group.length, dtype=torch.bool, device=group.key_mask.device).tril()
    return group.key_mask & lower


def _no_mask(*_args: Any, **_kwargs: Any) -> None:
    # The layout carries the structure; transformers must not build a dense mask for us.
    return None


AttentionInterface.register(ATTENTION_NAME, packed_attention)
AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
