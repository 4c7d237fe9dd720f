"""poolrunner's own kernels for x86 CPUs: packed attention (``packed_attention.cpp``), RMSNorm
(``rms_norm.cpp``), rotary embeddings (``rotary.cpp``), DeBERTa's attention bias
(``relative_bias.cpp``) and the passes around a dynamic int8 product (``int8_linear.cpp``) with
AVX-512; all but int8's, in float32, with AVX2 (and FMA).

Attention: one call attends every request of a packed step that shares an attention window
(full, causal or sliding), instead of one torch SDPA call per run of equal lengths. On 2 Zen 4
cores (AVX512-BF16, no AMX) it is 2.4-8.7x faster in bfloat16 and 1.6-3x in float32 than torch's
CPU flash kernel at the lengths embedding models see (6-300 tokens, 32- and 64-wide heads), with
the same numerics (see the source's header). With AMX (Intel Xeon, 4th generation on) its
bfloat16 products run on tiles: 1.4-4x faster than torch's kernel up to 197 tokens (2 cores).

RMSNorm: transformers' ``LlamaRMSNorm`` in one pass per row instead of five to seven element-wise
passes, with its numerics; SmolLM2-135M embeds 7% faster with it in bfloat16 (2 Zen 4 cores).

Rotary embeddings: Llama's ``apply_rotary_pos_emb`` for one tensor in one pass instead of five,
bit for bit; SmolLM2-135M embeds 10% faster with it in bfloat16, 5% in float32 (2 AMX Xeon cores).

The kernels are C++, built once per machine and torch release on first use by torch's extension
builder (``torch.utils.cpp_extension``: g++ and the ``ninja`` package), 5-20 s on 2 cores,
and cached in torch's extension folder (``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``); later loads take milliseconds. Where they cannot be built (not
x86 with AVX2, no C++ compiler) attention, RMSNorm and rotary embeddings run on torch as before,
with one log line saying why.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import torch

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in (
    "packed_attention.cpp", "rms_norm.cpp", "rotary.cpp", "relative_bias.cpp", "int8_linear.cpp"))
HEAD_DIM_MULTIPLE = 16
TILE_HEAD_DIM_MULTIPLE = 32
"""bfloat16 attention runs on AMX tiles for head sizes of this multiple (one tile row of scores'
products); others on the vector units."""
STALE_LOCK_S = 600.0
"""A build lock older than this was left by a process that died while building: removed."""
# -fopenmp: at::parallel_for is a header template, parallel only where OpenMP is on; the
# OpenMP runtime is the one torch ships and has loaded (same soname), so one thread pool.
_AVX512_FLAGS = ("-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma")
_AVX2_FLAGS = ("-O3", "-fopenmp", "-mavx2", "-mfma")


@attrs.frozen
class Build:
    """The kernels one instruction set builds."""

    name: str
    flags: tuple[str, ...]
    sources: tuple[Path, ...]
    dtypes: frozenset[torch.dtype]
    """The dtypes attention and RMSNorm run in (int8's passes: with bfloat16 only)."""
    float32_keys: int
    """The most keys a float32 query row may see on average for the kernel to attend it (a full
    request: its length; causal: half of it; a sliding window: its width); past it torch's SDPA
    is faster: its flash kernel's key and value blocks stay in cache."""
    tiles: bool = False
    """bfloat16 attention runs on AMX tiles."""


AVX512_BF16 = Build("avx512_bf16", (*_AVX512_FLAGS, "-mavx512bf16"), SOURCES,
                    frozenset({torch.float32, torch.bfloat16}), float32_keys=1024)
"""Measured on one request of 12 heads of 64 (2 Zen 4 cores), the kernel's float32 time over
SDPA's: full 0.93x at 768 tokens, 1.12x at 1,024, 1.42x at 2,048, 1.82x at 8,192; causal 0.96x
at 2,048, 1.17x at 4,096. In bfloat16 it is faster at every length measured (0.59-0.83x up to
8,192), so it keeps them all."""
AMX = attrs.evolve(AVX512_BF16, name="amx", flags=(*AVX512_BF16.flags, "-mamx-tile", "-mamx-bf16"), tiles=True)
"""AVX512_BF16's kernels, with bfloat16 attention on AMX tiles (``packed_attention.cpp``)."""
AVX512 = attrs.evolve(AVX512_BF16, name="avx512", flags=_AVX512_FLAGS, dtypes=frozenset({torch.float32}))
AVX2 = Build("avx2", _AVX2_FLAGS, tuple(source for source in SOURCES if source.name != "int8_linear.cpp"),
             frozenset({torch.float32}), float32_keys=256)
"""Every kernel but int8's, in float32: int8 serves bfloat16 products, which such
a CPU does not run natively. Measured on requests of 12 heads of 64 (2 Zen 3 cores), the kernel's
GFLOP/s over SDPA's: 1.24-1.33x at 16-31 tokens, 1.0-1.16x at 128, 0.95-1.08x at 256, 0.81-0.87x
at 512, 0.61x at 2,048."""


def has_tiles() -> bool:
    """Whether this machine's build runs bfloat16 attention on AMX tiles (building the kernels on
    first call)."""
    build = _load()
    return build is not None and build.tiles


def supported_dtypes() -> frozenset[torch.dtype]:
    """The dtypes the attention and RMSNorm kernels run in on this machine, building the kernels
    on first call; empty when they cannot be built."""
    build = _load()
    return frozenset() if build is None else build.dtypes


AMX_KEY_ELEMENTS = 2560
"""On a CPU with AMX tiles (Intel Xeon, 4th generation on), the most key elements (keys times
``head_dim``) a query row of a full or causal request may see for the kernel to attend it, in
either dtype: past it torch's SDPA is faster (its flash kernel runs bf16 products on AMX).
Measured there (2 cores, 12 heads, one SDPA call per request), the kernel's time over SDPA's:
bf16 32 wide 0.90x at 64 keys, 1.12x at 96, 1.4-2.6x from 128 to 2,048; 64 wide 1.03x at 48,
1.38x at 64, 2.5-3.8x from 128; fp32 32 wide 0.92x at 64, 1.03-1.3x from 96; 64 wide 1.2-2.2x
from 48 (bench/README.md). Short requests, most of an embedding model's, stay."""


def has_amx() -> bool:
    """Whether this CPU has AMX tiles (Intel Xeon, 4th generation on) that torch's oneDNN uses."""
    return torch.cpu._is_amx_tile_supported()


TILE_KEYS = 256
"""With the kernel's bfloat16 on AMX tiles (:attr:`Build.tiles`, ``head_dim`` a multiple of 32),
the most keys a query row of a full or causal request may see on average for the kernel to attend
it. Measured (2 AMX Xeon cores, 4,096 tokens of equal-length requests, one SDPA call per request),
the tiles' time over SDPA's: full, 12 heads of 32: 0.37x at 32 tokens, 0.60x at 197, 1.00x at
256, 0.94x at 512; of 64: 0.44x, 0.74x, 1.00x, 1.15x; causal, 9 / 3 heads of 64: 0.39x at 32
tokens, 0.55x at 197, 0.64x at 512 (bench/README.md). SDPA is at its best at these multiples of
16; ragged lengths cost it more."""


def kernel_keys(dtype: torch.dtype, head_dim: int, banded: bool = False) -> int:
    """The most keys a query row may see, on average, for the kernel to attend its request in
    ``dtype``; past it torch's SDPA is the faster (0 where no kernel was built).

    :param banded: A sliding window: SDPA would need a mask for it, so AMX's limits
        (:data:`AMX_KEY_ELEMENTS`, :data:`TILE_KEYS`) do not apply.
    """
    build = _load()
    if build is None:
        return 0
    keys = build.float32_keys if dtype == torch.float32 else sys.maxsize
    if banded or not has_amx():
        return keys
    if build.tiles and dtype == torch.bfloat16 and head_dim % TILE_HEAD_DIM_MULTIPLE == 0:
        return TILE_KEYS
    return min(keys, AMX_KEY_ELEMENTS // head_dim)


FULL = (-1, -1)
CAUSAL = (-1, 0)
"""The ``window`` of :func:`attend` for full and causal attention."""


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    starts: torch.Tensor, lengths: torch.Tensor, window: tuple[int, int], scale: float, tiles: bool = True,
) -> None:
    """Attention within each request of a packed step, written into ``out``.

    :param q: ``[num_tokens, num_heads, head_dim]``, float32 or bfloat16 (a dtype of
        :func:`supported_dtypes`); any token and head strides, ``head_dim`` contiguous and a
        multiple of 16.
    :param k: ``[num_tokens, num_kv_heads, head_dim]``; ``num_heads`` a multiple of ``num_kv_heads``.
    :param v: Same shape as ``k``.
    :param out: Contiguous, shaped and typed like ``q``; rows outside every request are left as is.
    :param starts: int64 ``[num_requests]``, each request's first token.
    :param lengths: int64 ``[num_requests]``, its token count.
    :param window: ``(before, after)``: query ``i`` of a request sees its keys ``i - before ..
        i + after`` (-1: no bound on that side): :data:`FULL`, :data:`CAUSAL`, or a sliding window
        (ModernBERT's local layers: ``(64, 64)``; Mistral's ``sliding_window=w``: ``(w - 1, 0)``).
    :param scale: Softmax scale of the scores.
    :param tiles: bfloat16 with a ``head_dim`` multiple of 32 on AMX tiles where the build has them
        (:attr:`Build.tiles`); ``False``: on the vector units, as without AMX.
    """
    torch.ops.poolrunner_cpu.packed_attention(q, k, v, out, starts, lengths, *window, scale, tiles)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x**2) + eps))`` per row as transformers' ``LlamaRMSNorm``
    computes it: in float32, the bfloat16 case rounding ``x * rsqrt(...)`` to bfloat16 before the
    weight multiplies it.

    :param x: ``[..., hidden]`` in a dtype of :func:`supported_dtypes`.
    :param weight: ``[hidden]``, of ``x``'s dtype.
    :param unit_offset: Gemma's RMSNorm instead: ``x * rsqrt(...) * (1 + weight)`` in float32,
        rounded to ``x``'s dtype once.
    :returns: Shaped and typed like ``x``.
    """
    x = x.contiguous()
    out = torch.empty_like(x)
    torch.ops.poolrunner_cpu.rms_norm(x, weight, out, eps, unit_offset)
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, round_once: bool = False) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` as transformers' ``apply_rotary_pos_emb`` computes it
    for one tensor, with its roundings, in one pass (``rotary.cpp``).

    :param x: ``[batch, heads, tokens, head_dim]`` in a dtype of :func:`supported_dtypes`,
        ``head_dim`` even and contiguous (other strides free).
    :param cos: ``[batch or 1, tokens, head_dim]``, of ``x``'s dtype, ``head_dim`` contiguous.
    :param sin: Shaped and laid out like ``cos``.
    :param round_once: ModernBERT's formula (products and sum in float32, the result rounded to
        ``x``'s dtype once) instead of Llama's (each operation rounded to ``x``'s dtype).
    :returns: Shaped, strided and typed like ``x``.
    """
    out = torch.empty_like(x)
    torch.ops.poolrunner_cpu.rotary(x, cos, sin, round_once, out)
    return out


def relative_bias(rows: torch.Tensor | None, cols: torch.Tensor | None, index: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """DeBERTa's disentangled attention bias, masked, in one pass (``relative_bias.cpp``):
    ``out[g, i, j] = rows[g, i, r] + cols[g, j, r]`` with ``r = index[i, j]`` where
    ``mask[g % batch, i, j]``, the dtype's lowest finite value elsewhere.

    :param rows: ``[groups, tokens, positions]`` (``groups = heads * batch``, head-major) in a
        dtype of :func:`supported_dtypes`, or ``None``.
    :param cols: Shaped and typed like ``rows``, or ``None``; at least one of the two is given.
    :param index: int64 ``[tokens, tokens]``, values in ``[0, positions)``.
    :param mask: bool ``[batch, tokens, tokens]``: the pairs that may attend.
    :returns: ``[groups, tokens, tokens]``, of the terms' dtype.
    :raises RuntimeError: (torch's) for shapes, dtypes or an index out of range.
    """
    terms = [term for term in (rows, cols) if term is not None]
    out = torch.empty((terms[0].shape[0], *index.shape), dtype=terms[0].dtype)
    empty = torch.empty(0, dtype=out.dtype)
    torch.ops.poolrunner_cpu.relative_bias(*(empty if term is None else term.contiguous() for term in (rows, cols)),
                                           index.contiguous(), mask.contiguous(), out)
    return out


def quantize_rows(x: torch.Tensor, inv_smooth: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                  offset: torch.Tensor, block: int = 0) -> None:
    """Quantize each row of ``x / smooth`` (rotated, with ``block``) to int8 with its own scale and
    zero point (the formulas are in ``int8_linear.cpp``), written into ``q``, ``scale`` and ``offset``.

    :param x: float32 or bfloat16 ``[rows, in]``, contiguous.
    :param inv_smooth: float32 ``[in]``, the reciprocal smoothing factor of each input channel.
    :param q: int8 ``[rows, in]``: ``round(y / scale) + zero - 128``, ``y = x * inv_smooth``, or
        with ``block``, ``y`` times the block-diagonal Hadamard matrix of :func:`hadamard`.
    :param scale: float32 ``[rows]``, each row's step.
    :param offset: int32 ``[rows]``, ``128 - zero``.
    :param block: 0, or the rotation's block: a power of two from 16 to 128 dividing ``in``.
    """
    torch.ops.poolrunner_cpu.quantize_rows(x, inv_smooth, q, scale, offset, block)


def hadamard(block: int) -> torch.Tensor:
    """float32 ``[block, block]``: the unnormalized Hadamard matrix of Sylvester's order (entries
    +-1, ``H @ H == block * I``), as :func:`quantize_rows` multiplies by it."""
    matrix = torch.ones(1, 1)
    while len(matrix) < block:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    return matrix


def dequantize_rows(acc: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, col_scale: torch.Tensor,
                    col_sum: torch.Tensor, bias: torch.Tensor, out: torch.Tensor, activation: int = 0,
                    other: torch.Tensor | None = None) -> None:
    """``out = act((acc + offset * col_sum) * scale * col_scale + bias) * other``, row by row, the sum
    exact in int32, the rest in float32.

    :param acc: int32 ``[rows, out]``, the int8 product of :func:`quantize_rows`'s ``q`` and the weight.
    :param scale: float32 ``[rows]`` and ``offset`` int32 ``[rows]``, from :func:`quantize_rows`.
    :param col_scale: float32 ``[out]``, each output channel's weight step.
    :param col_sum: int32 ``[out]``, each output channel's sum of int8 weights.
    :param bias: float32 ``[out]``, or empty for none.
    :param out: float32 or bfloat16 ``[rows, out]``, contiguous.
    :param activation: :data:`ACTIVATIONS`' code of the activation (0: none), computed within 1e-6
        (relative) of its float64 value (the approximations are in ``int8_linear.cpp``).
    :param other: ``None``, or a factor shaped and typed like ``out``, contiguous.
    """
    other = torch.empty(0, dtype=out.dtype) if other is None else other
    torch.ops.poolrunner_cpu.dequantize_rows(acc, scale, offset, col_scale, col_sum, bias, activation, other, out)


ACTIVATIONS = {("none", ""): 0, ("gelu", "none"): 1, ("gelu", "tanh"): 2, ("relu", ""): 3, ("swish", ""): 4}
"""oneDNN's post-op names (:func:`poolrunner.core.kernels.onednn._post_op`) -> :func:`dequantize_rows`' codes."""


@functools.cache
def _load() -> Build | None:
    builds = _instruction_sets()
    if not builds:
        logger.info("poolrunner's CPU kernels need AVX2 or AVX-512; attention and RMSNorm run on torch")
        return None
    for build in builds[:-1]:  # a compiler too old for AMX's flags still builds the next one
        if _build(build, quiet=True):
            return build
    return builds[-1] if _build(builds[-1]) else None


def _build(build: Build, quiet: bool = False) -> bool:
    # One build per instruction set and torch release: a cached build never meets another's headers.
    # And per installed copy: ninja rebuilds when the sources' paths change, so two checkouts (or
    # virtual environments) sharing one build folder would rebuild each other's at every start.
    torch_release = torch.__version__.replace(".", "_").replace("+", "_")
    copy = hashlib.sha256(str(SOURCES[0].parent.resolve()).encode()).hexdigest()[:8]
    name = f"poolrunner_cpu_kernels_{build.name}_torch{torch_release}_{copy}"
    started = time.perf_counter()
    try:
        from torch.utils import cpp_extension

        _remove_stale_lock(Path(cpp_extension._get_build_directory(name, verbose=False)))
        with _ninja_on_path():
            cpp_extension.load(name, [str(source) for source in build.sources], extra_cflags=list(build.flags),
                               extra_ldflags=["-fopenmp"], is_python_module=False)
    except (ImportError, OSError, RuntimeError) as exc:  # no compiler, no ninja, a failed build
        if quiet:
            logger.info("poolrunner's CPU kernels for %s could not be built: %s", build.name, _reason(exc))
        else:
            logger.warning("poolrunner's CPU kernels could not be built, attention and RMSNorm run on torch: %s",
                           _reason(exc))
        return False
    logger.info("CPU kernels %s ready in %.1f s", name, time.perf_counter() - started)
    return True


def _instruction_sets() -> tuple[Build, ...]:
    """The builds this CPU runs, widest first; empty below AVX2."""
    if torch.cpu._is_avx512_supported():
        if not torch.cpu._is_avx512_bf16_supported():
            return (AVX512,)
        return (AMX, AVX512_BF16) if has_amx() else (AVX512_BF16,)
    return (AVX2,) if torch.cpu._is_avx2_supported() else ()


def _reason(exc: BaseException) -> str:
    """The line of a failed build that says why (``/bin/sh: 1: g++: not found``), not ninja's summary."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip() and not line.startswith("ninja:")]
    return lines[-1] if lines else type(exc).__name__


def _remove_stale_lock(build_directory: Path) -> None:
    # torch's builder waits for a lock file to go away; one left by a killed build never does.
    lock = build_directory / "lock"
    with contextlib.suppress(FileNotFoundError):
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            logger.warning("removing a stale build lock %s", lock)
            lock.unlink()


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """The ``ninja`` package's binary on ``PATH`` while building: torch's builder runs ``ninja``
    from ``PATH``, which lacks a virtual environment's ``bin`` when it is not activated."""
    try:
        import ninja
    except ImportError:
        yield
        return
    saved = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, saved])
    try:
        yield
    finally:
        os.environ["PATH"] = saved
