"""poolrunner's attention function for packed, padding-free batches.

Registered in transformers' attention-interface registry under :data:`ATTENTION_NAME`, so any
architecture whose transformers modelling code dispatches through ``ALL_ATTENTION_FUNCTIONS``
runs on packed inputs: the tokens of all requests form one sequence ``[1, num_tokens]``, and
attention stays inside each request's span.

Which keys a query may see is decided by transformers itself. The model builds its masks
(causal, bidirectional, sliding window, ``config.is_causal: false``, Gemma3's bidirectional
window...) through the mask interface, and poolrunner's mask builder keeps the model's mask
*function* as a :class:`MaskRule` instead of a dense tensor. The rule is evaluated with
transformers' own ``sdpa_mask`` for one request of each length in the step, exactly as it
would be for that request run alone; so every layer gets its own semantics and a new mask
feature needs no code here.

Every other argument a layer passes is either implemented (``scaling``, ``softcap``, sinks as
``s_aux``), known to
be carried by the mask (``sliding_window``, ``is_causal``) or inert (positions, caches); any
other argument with a value raises :class:`UnsupportedAttentionError`. The runner runs one probe
forward at load (:func:`probe_attention`), so a layout or a new transformers release that asks
for something not implemented is refused at load, never run with the feature silently off.

Linear layers see only real tokens, and so does attention: requests of equal length that sit
side by side in the packed sequence are one run, and a run is attended in one call on views of
the packed tensors (``[count, heads, length, head_dim]``), without gathering, padding or masking
keys (see :func:`PackedLayout.build`). The runner packs a step's requests by length so that
equal lengths are adjacent. Against grouping requests of similar length into padded, key-masked
batches this made all-MiniLM-L6-v2's embed calls 2-8% faster on 2 Zen 4 cores (100 texts of
about 200 tokens, 1,000 of about 31; bf16 and fp32), its attention 17-38%: the padded keys and
queries cost more than the extra kernel calls. The layout is built once per step and shared by
every layer.

On an x86 CPU with AVX-512, or AVX2 in float32 (``compile="auto"``), the runs whose mask is full,
causal or a sliding window (:meth:`MaskRule.window`) attend in
poolrunner's own kernel instead (:mod:`~poolrunner.core.kernels.cpu_kernels`), all of them in one
call per layer; other masks, soft-capping and sinks stay on the path above. On CUDA the same runs
attend in flash attention's variable-length kernel, in float16 and bfloat16
(:mod:`~poolrunner.core.kernels.cuda_attention`).

Chunked prefill (models that never attend to later tokens, see :func:`probe_attention`): a
request whose prompt runs over several steps has a :class:`KVCache`; its chunk attends to the
cached keys and values of its earlier chunks plus its own, with the layer's mask rule evaluated
at the chunk's offset, and stores them for the next chunk unless this is its last.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from attrs import define, field, frozen
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from poolrunner.core.errors import UnsupportedAttentionError
from poolrunner.core.kernels import cpu_kernels, cuda_attention

ATTENTION_NAME = "poolrunner_packed"
LAYOUT_KWARG = "poolrunner_layout"
"""Forward keyword that carries the step's :class:`PackedLayout`."""

# Length of the probe prompt run at load: long enough to show any attention to a later token.
PROBE_TOKENS = 8
LONG_ROWS = 1024
"""Requests longer than this never get a whole ``[length, length]`` mask: their mask kind is read
tile by tile, and a mask that is neither full nor causal (a sliding window) is attended in tiles
of :data:`TILE_ROWS` query rows, each over the keys its rows see. Memory then grows with
``length * TILE_ROWS``, not ``length ** 2`` (at 8,192 tokens a whole mask is 64 MiB of bools, and
SDPA's scores for it 3 GiB in float32 over 12 heads)."""
TILE_ROWS = 256

# Forward arguments with no attention semantics of their own.
_INERT_KWARGS = frozenset({
    LAYOUT_KWARG, "position_ids", "cache_position", "past_key_values", "past_key_value", "use_cache",
    "output_attentions", "deterministic", "position_embeddings",
})
# Arguments whose meaning the layer's mask already carries: transformers' eager and sdpa
# attention read the mask, not these.
_MASK_KWARGS = frozenset({"sliding_window", "is_causal"})


KNOWN_WINDOWS_LIMIT = 1 << 16
"""Most entries of :data:`_known_windows` (cleared when full)."""
_known_windows: dict[tuple[Hashable, bool, int], tuple[int, int] | None] = {}
""":meth:`MaskRule.window` of every length a mask function has been read at, across steps, by the
function's :func:`_function_key`: transformers hands over a new rule every forward, and reading a
length's mask (evaluating it, then checking it is a window) took ~0.4 ms a length on the H200
machine's host: most of the host's time on a GPU step of mixed lengths (bench/README.md, "GPU
check")."""


def _function_key(function: Any) -> Hashable | None:
    """A key equal for two mask functions only where they compute the same mask: the same code,
    defaults and captured values, each captured value a number, string, ``None``, a tuple of them,
    or a function with a key itself (transformers' ``and_masks`` and window overlays). ``None``
    for any other function (one capturing a tensor: token types, padding)."""
    if not isinstance(function, types.FunctionType):
        return None
    parts = []
    for value in (*(cell.cell_contents for cell in function.__closure__ or ()), function.__defaults__,
                  tuple(sorted((function.__kwdefaults__ or {}).items()))):
        part = _value_key(value)
        if part is None:
            return None
        parts.append(part)
    return function.__code__, tuple(parts)


def _value_key(value: Any) -> Hashable | None:
    if value is None or type(value) in (bool, int, float, str):
        return type(value).__name__, value
    if type(value) is tuple:
        parts = tuple(_value_key(item) for item in value)
        return None if any(part is None for part in parts) else parts
    return _function_key(value)


@define(eq=False)
class MaskRule:
    """The mask one kind of layer uses, as transformers defines it: ``mask_function(batch, head,
    q_idx, kv_idx) -> bool``, evaluated per request length and cached for the step (its windows
    across steps, where :func:`_function_key` can tell the function)."""

    mask_function: Callable[..., Any]
    use_vmap: bool
    key: Hashable | None = field(init=False)
    _blocks: dict[tuple[int, int, int, str], _Block] = field(factory=dict, init=False)
    _kinds: dict[int, str] = field(factory=dict, init=False)
    _tiles: dict[tuple[int, str], tuple[_Tile, ...]] = field(factory=dict, init=False)
    _windows: dict[int, tuple[int, int] | None] = field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        self.key = _function_key(self.mask_function)

    def rows(self, q_offset: int, q_length: int, kv_length: int) -> torch.Tensor:
        """The ``[q_length, kv_length]`` bool mask (CPU) of queries ``q_offset ..`` of one request."""
        mask = sdpa_mask(
            batch_size=1, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=0,
            mask_function=self.mask_function, attention_mask=None, allow_is_causal_skip=False,
            allow_is_bidirectional_skip=False, use_vmap=self.use_vmap, device="cpu",
        )
        return mask[0, 0].expand(q_length, kv_length)

    def kind(self, length: int, device: torch.device) -> str:
        """``full``, ``causal`` or ``custom``: :attr:`_Block.kind` of a request of ``length``
        tokens, read in tiles of :data:`TILE_ROWS` rows past :data:`LONG_ROWS` tokens."""
        if length <= LONG_ROWS:
            return self.block(0, length, length, device).kind
        if length not in self._kinds:
            full = causal = True
            for start in range(0, length, TILE_ROWS):
                tile = self.rows(start, min(TILE_ROWS, length - start), length)
                full = full and bool(tile.all())
                causal = causal and torch.equal(tile, torch.ones_like(tile).tril(diagonal=start))
                if not (full or causal):
                    break
            self._kinds[length] = "full" if full else "causal" if causal else "custom"
        return self._kinds[length]

    def window(self, length: int, device: torch.device) -> tuple[int, int] | None:
        """``(before, after)`` when each query ``i`` of a request of ``length`` tokens sees exactly
        its keys ``i - before .. i + after`` (-1: unbounded; :func:`cpu_kernels.attend`'s
        ``window``): full, causal or a sliding window; ``None`` for any other mask. Past
        :data:`LONG_ROWS` tokens it is read from the tiles, never a whole mask. Read once per
        length and function (:data:`_known_windows`), where the function has a key."""
        if length not in self._windows:
            known = (self.key, self.use_vmap, length)
            window = _known_windows[known] if known in _known_windows else self._read_window(length, device)
            if self.key is not None:
                if len(_known_windows) >= KNOWN_WINDOWS_LIMIT:
                    _known_windows.clear()
                _known_windows[known] = window
            self._windows[length] = window
        return self._windows[length]

    def _read_window(self, length: int, device: torch.device) -> tuple[int, int] | None:
        if length <= LONG_ROWS:
            return self.block(0, length, length, device).window
        kind = self.kind(length, device)
        if kind != "custom":
            return cpu_kernels.FULL if kind == "full" else cpu_kernels.CAUSAL
        return _tiles_window(self.tiles(length, device), length)

    def tiles(self, length: int, device: torch.device) -> tuple[_Tile, ...]:
        """A request of ``length`` tokens in tiles of :data:`TILE_ROWS` query rows, each with the
        span of keys its rows see and that part of the mask; built once per step, then shared by
        every layer with this rule (ModernBERT-base: 14 local layers)."""
        key = (length, str(device))
        if key not in self._tiles:
            self._tiles[key] = tuple(_Tile.of(self.rows(start, min(TILE_ROWS, length - start), length), start, device)
                                     for start in range(0, length, TILE_ROWS))
        return self._tiles[key]

    def block(self, q_offset: int, q_length: int, kv_length: int, device: torch.device) -> _Block:
        """The ``[q_length, kv_length]`` mask of one request whose queries start at ``q_offset``."""
        key = (q_offset, q_length, kv_length, str(device))
        if key not in self._blocks:
            # Built and classified on the CPU, so a GPU step never waits on a mask.
            self._blocks[key] = _Block.of(self.rows(q_offset, q_length, kv_length), q_offset, device)
        return self._blocks[key]


@frozen(eq=False)
class _Block:
    """A request's mask and what kind it is, so plain masks use the fast SDPA paths."""

    mask: torch.Tensor  # [q_length, kv_length] bool, True where a query sees a key
    kind: str  # "full", "causal" (a square block where query i sees keys 0..i) or "custom"
    attends_future: bool  # some query sees a key at a later position
    window: tuple[int, int] | None = None  # a whole request's (before, after): see MaskRule.window

    @classmethod
    def of(cls, mask: torch.Tensor, q_offset: int, device: torch.device) -> _Block:
        q_length, kv_length = mask.shape
        causal = torch.ones(q_length, kv_length, dtype=torch.bool).tril(diagonal=q_offset)
        future = bool((mask & ~causal).any())
        # SDPA's is_causal aligns the triangle top-left: only right for a square block from 0.
        square = q_offset == 0 and q_length == kv_length
        kind = "full" if bool(mask.all()) else "causal" if square and torch.equal(mask, causal) else "custom"
        window = {"full": cpu_kernels.FULL, "causal": cpu_kernels.CAUSAL}.get(kind)
        if kind == "custom" and square:
            edges = _band_edges(mask, 0, 0, kv_length)
            window = edges if edges is not None and _is_band(mask, 0, 0, kv_length, edges) else None
        return cls(mask.contiguous().to(device, non_blocking=True), kind, future, window)


@frozen(eq=False)
class _Tile:
    """Query rows ``start:end`` of a long request, over keys ``first:last`` (those they see)."""

    start: int
    end: int
    first: int
    last: int
    block: _Block  # the tile's mask over its keys

    @classmethod
    def of(cls, mask: torch.Tensor, start: int, device: torch.device) -> _Tile:
        """:param mask: ``[rows, length]`` bool, the rows' whole mask.
        :raises UnsupportedAttentionError: when the rows see no key at all."""
        seen = mask.any(0).nonzero()
        end = start + mask.shape[0]
        if len(seen) == 0:
            raise UnsupportedAttentionError(f"queries {start}..{end} of a {mask.shape[1]}-token request see no key")
        first, last = int(seen[0]), int(seen[-1]) + 1
        mask = mask[:, first:last]
        return cls(start, end, first, last,
                   _Block(mask.contiguous().to(device), "full" if bool(mask.all()) else "custom", False))


def _band_edges(mask: torch.Tensor, q_offset: int, k_offset: int, kv_length: int) -> tuple[int, int] | None:
    """The ``(before, after)`` that ``mask`` (``[rows, keys]``: queries from ``q_offset`` over keys
    from ``k_offset`` of a ``kv_length``-key request) would be the band of, read from each row's
    first and last key (-1 on a side where no row is clipped by the window); ``None`` when the rows
    disagree. A candidate only: :func:`_is_band` checks it."""
    rows, keys = mask.shape
    if not bool(mask.any(1).all()):
        return None
    index = torch.arange(keys)
    first = torch.where(mask, index, keys).amin(1) + k_offset
    last = torch.where(mask, index, -1).amax(1) + k_offset
    query = torch.arange(rows) + q_offset
    befores, afters = (query - first)[first > 0].unique(), (last - query)[last < kv_length - 1].unique()
    if len(befores) > 1 or len(afters) > 1 or bool((befores < 0).any()) or bool((afters < 0).any()):
        return None
    return int(befores[0]) if len(befores) else -1, int(afters[0]) if len(afters) else -1


def _is_band(mask: torch.Tensor, q_offset: int, k_offset: int, kv_length: int, window: tuple[int, int]) -> bool:
    """Whether ``mask`` (as for :func:`_band_edges`) is exactly the band ``window``, no key of the
    rows' band outside its ``keys`` columns."""
    rows, keys = mask.shape
    query = torch.arange(rows)[:, None] + q_offset
    lo = torch.zeros_like(query) if window[0] < 0 else (query - window[0]).clamp(min=0)
    hi = torch.full_like(query, kv_length) if window[1] < 0 else (query + window[1] + 1).clamp(max=kv_length)
    if int(lo.min()) < k_offset or int(hi.max()) > k_offset + keys:
        return False
    key = torch.arange(keys)[None] + k_offset
    return torch.equal(mask, (key >= lo) & (key < hi))


def _tiles_window(tiles: Sequence[_Tile], length: int) -> tuple[int, int] | None:
    """:meth:`MaskRule.window` of a long request from its tiles: each tile's edges, then every
    tile checked against one band (a tile whose rows are not clipped on a side reads -1 there)."""
    found = [_band_edges(tile.block.mask, tile.start, tile.first, length) for tile in tiles]
    if any(window is None for window in found):
        return None
    window = (max(w[0] for w in found), max(w[1] for w in found))  # type: ignore[index]
    if all(_is_band(tile.block.mask, tile.start, tile.first, length, window) for tile in tiles):
        return window
    return None


@frozen(eq=False)
class _Run:
    """``count`` requests of ``length`` tokens each, side by side from flat token ``start``."""

    start: int
    count: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.count * self.length


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
    """How the packed tokens of one step split into attention runs and cached chunks.

    :ivar probe: When a list, every attention call appends ``True`` if its layer lets a query
        see a later token (used once at load by :func:`probe_attention`).
    :ivar rows: Which rows of the last layer's output are read: ``"all"``, or only each
        request's ``"first"`` or ``"last"`` (:meth:`read_rows`; :mod:`~poolrunner.core.model.inlined_blocks`):
        a prefill chunk's last row where it is its request's last chunk, none of an earlier one.
    """

    num_tokens: int
    runs: tuple[_Run, ...]
    cached: tuple[_CachedSpan, ...]
    probe: list[bool] | None = None
    native: bool = False
    rows: str = "all"
    _spans: dict[tuple[_Run, ...], tuple[torch.Tensor, torch.Tensor]] = field(factory=dict, init=False)
    _varlen: dict[tuple[_Run, ...], tuple[slice | torch.Tensor, torch.Tensor, int]] = field(factory=dict, init=False)
    _windowed: dict[tuple[Any, ...], tuple[dict[tuple[int, int], tuple[_Run, ...]], tuple[_Run, ...]]] = field(
        factory=dict, init=False)

    @classmethod
    def build(
        cls, lengths: Sequence[int], *, caches: Sequence[tuple[KVCache, bool] | None] = (),
        probe: list[bool] | None = None, native: bool = False, rows: str = "all",
    ) -> PackedLayout:
        """Split the step into runs; ``lengths[i]`` tokens belong to request ``i``, in packing order.

        Adjacent requests of equal length form one run. A request with an entry
        ``(cache, store)`` in ``caches`` is a prefill chunk and attends on its own. ``native``:
        runs with a full, causal or sliding-window mask attend in one kernel call per window:
        poolrunner's CPU kernel (:mod:`~poolrunner.core.kernels.cpu_kernels`, which the caller
        has built), or on CUDA flash attention's (:mod:`~poolrunner.core.kernels.cuda_attention`).
        ``rows``: see the attribute; ``"first"`` needs every request whole in the step (no ``caches``).
        """
        if rows == "first" and any(entry is not None for entry in caches):
            raise ValueError("rows='first' needs every request whole in the step, not a prefill chunk")
        starts = [0]
        for length in lengths:
            starts.append(starts[-1] + length)
        chunked = {i: entry for i, entry in enumerate(caches) if entry is not None}
        cached = tuple(
            _CachedSpan(starts[i], starts[i + 1], cache, store) for i, (cache, store) in chunked.items()
        )
        runs: list[_Run] = []
        for i, length in enumerate(lengths):
            if i in chunked:
                continue
            last = runs[-1] if runs else None
            if last is not None and last.length == length and last.end == starts[i]:
                runs[-1] = _Run(last.start, last.count + 1, length)
            else:
                runs.append(_Run(starts[i], 1, length))
        return cls(num_tokens=starts[-1], runs=tuple(runs), cached=cached, probe=probe, native=native, rows=rows)

    def read_rows(self, device: torch.device) -> torch.Tensor:
        """Each whole request's first (``rows="first"``) or last (``"last"``) token in the packed
        sequence, then the last token of each request's last prefill chunk: ``[rows]`` int64."""
        last = self.rows == "last"
        rows = [start + (run.length - 1 if last else 0) for run in self.runs
                for start in range(run.start, run.end, run.length)]
        rows += [span.end - 1 for span in self.cached if not span.store]
        return torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)

    def windowed_runs(
        self, rule: MaskRule, q: torch.Tensor, k: torch.Tensor, takes: Callable[[_Run, tuple[int, int]], bool],
    ) -> tuple[dict[tuple[int, int], tuple[_Run, ...]], tuple[_Run, ...]]:
        """The runs a windowed kernel ``takes`` under ``rule``, by window, and the others; worked
        out by the first layer of the step with this rule and these query and key shapes, then
        shared by the rest."""
        key = (rule, q.dtype, q.shape[1], k.shape[1], q.shape[-1], q.device)
        if key not in self._windowed:
            windows: dict[tuple[int, int], list[_Run]] = {}
            rest = []
            for run in self.runs:
                window = rule.window(run.length, q.device)
                if window is not None and takes(run, window):
                    windows.setdefault(window, []).append(run)
                else:
                    rest.append(run)
            self._windowed[key] = ({window: tuple(members) for window, members in windows.items()}, tuple(rest))
        return self._windowed[key]

    def request_spans(self, runs: tuple[_Run, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request of ``runs``: its first token and its length, int64 ``[num_requests]`` each;
        computed once per step, then shared by every layer that attends these runs."""
        if runs not in self._spans:
            starts = [run.start + i * run.length for run in runs for i in range(run.count)]
            lengths = [run.length for run in runs for _ in range(run.count)]
            self._spans[runs] = (torch.tensor(starts), torch.tensor(lengths))
        return self._spans[runs]

    def varlen_spans(
        self, runs: tuple[_Run, ...], device: torch.device,
    ) -> tuple[slice | torch.Tensor, torch.Tensor, int]:
        """The tokens of ``runs`` (a slice where they lie side by side, else an index on
        ``device``), their requests' int32 cumulative lengths ``[num_requests + 1]`` on ``device``
        and the longest length: variable-length attention's arguments, once per step."""
        if runs not in self._varlen:
            lengths = [run.length for run in runs for _ in range(run.count)]
            cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
            if all(a.end == b.start for a, b in itertools.pairwise(runs)):
                rows: slice | torch.Tensor = slice(runs[0].start, runs[-1].end)
            else:
                rows = torch.cat([torch.arange(run.start, run.end) for run in runs]).to(device, non_blocking=True)
            self._varlen[runs] = (rows, cu_seqlens.to(device, non_blocking=True), max(lengths))
        return self._varlen[runs]


def packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: MaskRule | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention within each request's span of a packed sequence, as the layer's mask rule says.

    :param query: ``[1, num_heads, num_tokens, head_dim]``.
    :param key: ``[1, num_kv_heads, num_tokens, head_dim]`` (grouped-query heads allowed).
    :param value: Same shape as ``key``.
    :param attention_mask: The layer's :class:`MaskRule`, from :func:`_keep_mask_rule`.
    :param scaling: Softmax scale; ``head_dim ** -0.5`` when ``None``.
    :param softcap: Logit soft-capping (Gemma2): scores become ``softcap * tanh(scores / softcap)``.
    :param s_aux: Attention sinks (GPT-OSS), ``[num_heads]``: one extra logit per head that joins
        the softmax and is then dropped.
    :returns: ``([1, num_tokens, num_heads, head_dim], None)``, the layout transformers expects.
    :raises UnsupportedAttentionError: for a dropout during inference, a mask that did not come
        from transformers' mask interface, or any other argument with a value.
    """
    layout: PackedLayout | None = kwargs.get(LAYOUT_KWARG)
    if layout is None:
        raise ValueError(f"{ATTENTION_NAME} attention needs the {LAYOUT_KWARG!r} forward argument")
    _check_arguments(module, attention_mask, dropout, kwargs)
    assert isinstance(attention_mask, MaskRule)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [num_tokens, heads, head_dim]
    output = q.new_empty(q.shape)
    output[layout.num_tokens :] = 0  # rows past the requests' tokens pad the step to a bucket
    runs = layout.runs
    if layout.native and softcap is None and s_aux is None and layout.probe is None:
        runs = _attend_native(attention_mask, layout, q, k, v, output, scaling)
    for run in runs:
        if run.length > LONG_ROWS and layout.probe is None:
            _attend_long(attention_mask, run, q, k, v, output, scaling, softcap, s_aux)
            continue
        block = attention_mask.block(0, run.length, run.length, q.device)
        if layout.probe is not None:
            layout.probe.append(block.attends_future)
        attended = _attend(*(_rows(t, run) for t in (q, k, v)), block, scaling, softcap, s_aux)
        output[run.start : run.end] = attended.transpose(1, 2).reshape(run.end - run.start, *q.shape[1:])
    for span in layout.cached:
        output[span.start : span.end] = _attend_chunk(module, attention_mask, span, q, k, v, scaling, softcap, s_aux)
    return output.unsqueeze(0), None


def _check_arguments(module: nn.Module, mask: Any, dropout: float, kwargs: dict[str, Any]) -> None:
    layer = type(module).__name__
    if not isinstance(mask, MaskRule):
        raise UnsupportedAttentionError(
            f"{layer} did not build its attention mask through transformers' mask interface "
            f"(got {type(mask).__name__}), so poolrunner cannot tell which keys each query sees"
        )
    if dropout:
        raise UnsupportedAttentionError(f"{layer} asks for attention dropout {dropout} at inference")
    unknown = sorted(
        name for name, value in kwargs.items()
        if name not in _INERT_KWARGS and name not in _MASK_KWARGS and value is not None and value is not False
    )
    if unknown:
        raise UnsupportedAttentionError(
            f"{layer} passes attention arguments poolrunner does not implement: {', '.join(unknown)}"
        )


def _attend_native(
    rule: MaskRule, layout: PackedLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor,
    scaling: float | None,
) -> tuple[_Run, ...]:
    """Attend the runs whose mask is full, causal or a sliding window in poolrunner's CPU kernel
    (on CUDA: :func:`_attend_varlen`), one call per window, into ``output`` (``[num_tokens,
    heads, head_dim]``); return the runs left for SDPA (other masks, a dtype or head size the
    kernel does not take, runs whose rows see more than
    :func:`cpu_kernels.kernel_keys <poolrunner.core.kernels.cpu_kernels.kernel_keys>` keys)."""
    if q.is_cuda:
        return _attend_varlen(rule, layout, q, k, v, output, scaling)
    if q.dtype not in cpu_kernels.supported_dtypes() or q.shape[-1] % cpu_kernels.HEAD_DIM_MULTIPLE:
        return layout.runs
    limit = {banded: cpu_kernels.kernel_keys(q.dtype, q.shape[-1], banded) for banded in (False, True)}

    def takes(run: _Run, window: tuple[int, int]) -> bool:
        return _keys_seen(window, run.length) <= limit[window not in (cpu_kernels.FULL, cpu_kernels.CAUSAL)]

    windows, rest = layout.windowed_runs(rule, q, k, takes)
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    q, k, v = (_kernel_layout(t) for t in (q, k, v))
    for window, members in windows.items():
        starts, lengths = layout.request_spans(members)
        cpu_kernels.attend(q, k, v, output, starts, lengths, window, scale)
    return rest


def _attend_varlen(
    rule: MaskRule, layout: PackedLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor,
    scaling: float | None,
) -> tuple[_Run, ...]:
    """On CUDA, :func:`_attend_native`'s work in flash attention's variable-length kernel
    (:mod:`~poolrunner.core.kernels.cuda_attention`): one call per window, every length at once."""
    windows, rest = layout.windowed_runs(rule, q, k, lambda _run, window: cuda_attention.supported(q, k, window))
    for window, members in windows.items():
        rows, cu_seqlens, longest = layout.varlen_spans(members, q.device)
        output[rows] = cuda_attention.attend(q[rows], k[rows], v[rows], cu_seqlens, longest, window, scaling)
    return rest


def _keys_seen(window: tuple[int, int], length: int) -> int:
    """The keys a query row of a ``length``-token request sees on average, about."""
    if window == cpu_kernels.CAUSAL:
        return length // 2
    before, after = (length if side < 0 else side for side in window)
    return min(length, before + after + 1)


def _kernel_layout(tokens: torch.Tensor) -> torch.Tensor:
    """``tokens`` as the kernel reads it: ``head_dim`` contiguous, and bf16 rows starting at even
    offsets (it reads bf16 pairs); a copy only for a layout a model seldom produces."""
    strides = tokens.stride()
    if strides[-1] == 1 and (tokens.dtype != torch.bfloat16 or all(stride % 2 == 0 for stride in strides[:-1])):
        return tokens
    return tokens.contiguous()


def _attend_long(
    rule: MaskRule, run: _Run, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor,
    scaling: float | None, softcap: float | None, sinks: torch.Tensor | None,
) -> None:
    """A run of requests longer than :data:`LONG_ROWS` into ``output``, never with a whole mask:
    a full or causal one through SDPA's own paths, any other in tiles of :data:`TILE_ROWS` query
    rows, each over the span of keys its rows see (for a sliding window, the window around the
    tile), with that part of the mask. Each query row's softmax is over the same keys as in one
    call, so the result is the same."""
    kind = rule.kind(run.length, q.device)
    queries, keys, values = (_rows(t, run) for t in (q, k, v))
    target = output[run.start : run.end].view(run.count, run.length, *q.shape[1:])
    if kind != "custom" and softcap is None and sinks is None:
        attended = F.scaled_dot_product_attention(queries, keys, values, is_causal=kind == "causal", scale=scaling,
                                                  enable_gqa=keys.shape[1] != queries.shape[1])
        target.copy_(attended.transpose(1, 2))
        return
    for tile in rule.tiles(run.length, q.device):
        span = slice(tile.first, tile.last)
        attended = _attend(queries[:, :, tile.start : tile.end], keys[:, :, span], values[:, :, span], tile.block,
                           scaling, softcap, sinks)
        target[:, tile.start : tile.end] = attended.transpose(1, 2)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: _Block,
    scaling: float | None, softcap: float | None, sinks: torch.Tensor | None,
) -> torch.Tensor:
    """``[rows, heads, length, head_dim]`` queries over keys with ``block``'s rule."""
    eager = softcap is not None or sinks is not None
    # SDPA's own causal path needs no mask, and a full block none at all.
    is_causal = block.kind == "causal" and not eager
    mask = None if block.kind == "full" or is_causal else block.mask
    if eager:
        return _eager(q, k, v, mask, scaling, softcap, sinks)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scaling, enable_gqa=k.shape[1] != q.shape[1],
    )


def _eager(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    scaling: float | None, softcap: float | None, sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention with soft-capped logits and/or sinks, as transformers' eager paths compute it."""
    if k.shape[1] != q.shape[1]:
        repeats = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)
    # A sink is one more logit per head in the softmax; its share of the weight goes nowhere.
    sink = sinks.reshape(1, -1, 1, 1).to(scores.dtype).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=scores.dtype)
    return torch.matmul(probs[..., :-1], v)


def _attend_chunk(
    module: nn.Module, rule: MaskRule, span: _CachedSpan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    scaling: float | None, softcap: float | None, sinks: torch.Tensor | None,
) -> torch.Tensor:
    """A chunk over its request's cached keys and values plus its own: ``[chunk, heads, dim]``."""
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError(f"chunked prefill needs attention layers with a layer_idx; {type(module).__name__} has none")
    keys, values = (t[span.start : span.end].transpose(0, 1).unsqueeze(0) for t in (k, v))  # [1, kv, chunk, d]
    past_kv = span.cache.layers.get(layer)
    if past_kv is not None:
        keys, values = torch.cat([past_kv[0], keys], dim=2), torch.cat([past_kv[1], values], dim=2)
    if span.store:  # a first chunk is a view of this step's buffers: copy it out
        span.cache.layers[layer] = (keys, values) if past_kv is not None else (keys.clone(), values.clone())
    chunk = span.end - span.start
    block = rule.block(keys.shape[2] - chunk, chunk, keys.shape[2], q.device)
    if block.attends_future:  # the runner enables chunking only for layers that never do
        raise RuntimeError(f"{type(module).__name__} layer {layer} attends to later tokens: it cannot run in chunks")
    query = q[span.start : span.end].transpose(0, 1).unsqueeze(0)
    return _attend(query, keys, values, block, scaling, softcap, sinks)[0].transpose(0, 1)


def _rows(tokens: torch.Tensor, run: _Run) -> torch.Tensor:
    """``[num_tokens, heads, head_dim]`` -> the run's ``[count, heads, length, head_dim]``, a view."""
    return tokens[run.start : run.end].view(run.count, run.length, *tokens.shape[1:]).transpose(1, 2)


def probe_attention(backbone: nn.Module, architecture: str, device: torch.device, position_offset: int) -> bool:
    """Run one short prompt through ``backbone`` and report whether every layer is causal.

    :returns: ``True`` when no layer lets a query see a later token (prompts may then run in
        chunks), ``False`` when some layer is bidirectional.
    :raises UnsupportedAttentionError: naming ``architecture`` and what a layer asked for that the
        packed attention does not implement.
    """
    probe: list[bool] = []
    layout = PackedLayout.build([PROBE_TOKENS], probe=probe)
    input_ids = torch.arange(PROBE_TOKENS, device=device)[None] % 2 + 5
    positions = torch.arange(PROBE_TOKENS, device=device)[None] + position_offset
    try:
        with torch.inference_mode():
            backbone(input_ids=input_ids, position_ids=positions, attention_mask=torch.ones_like(input_ids),
                     use_cache=False, **{LAYOUT_KWARG: layout})
    except UnsupportedAttentionError as exc:
        raise UnsupportedAttentionError(f"{architecture} cannot run on packed batches: {exc}") from exc
    if not probe:
        raise UnsupportedAttentionError(f"{architecture} never called poolrunner's attention function")
    return not any(probe)


def _keep_mask_rule(
    *, mask_function: Callable[..., Any], use_vmap: bool = False, **_kwargs: Any,
) -> MaskRule:
    # The model's mask function, kept whole: the packed layout decides which requests meet.
    return MaskRule(mask_function, use_vmap)


AttentionInterface.register(ATTENTION_NAME, packed_attention)
AttentionMaskInterface.register(ATTENTION_NAME, _keep_mask_rule)
