"""Packed attention on CUDA: every request of a step that shares an attention window (full,
causal or sliding) in one call of torch's variable-length flash attention
(``torch.nn.attention.varlen.varlen_attn``, as vLLM's pooling runner does with flash-attn's
``flash_attn_varlen_func``), instead of one SDPA call per run of equal lengths, that is per
distinct length and layer. A BERT-base-shaped model on an H200, bfloat16, 1,024 texts of 8 to
512 tokens: 332 texts/s on SDPA per run, 2,038 in this kernel (bench/README.md, "GPU check").

The function's signature changed across torch releases (``window_size`` replaced ``is_causal``;
``enable_gqa`` came later still, though the flash kernel under it took grouped-query heads
before: torch 2.11's takes them without the flag), so what the installed torch offers is read
from its signature, and each combination of dtype, heads and window is checked once against
SDPA on seeded inputs before it serves a request: a combination the installed kernel gets
wrong, or does not take, stays on SDPA, with one log line saying why. Float32 stays on SDPA:
flash attention takes half types only.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

DTYPES = frozenset({torch.float16, torch.bfloat16})
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
CHECK_LENGTHS = (5, 33, 130)
"""The requests of the one-time check: shorter than, near and past a 64-key window and flash's
128-row blocks."""
CHECK_TOLERANCE = 2e-2
"""Largest difference allowed between the kernel and float32 SDPA in the check (half-precision
outputs of unit scale round at 4e-3; a wrong window or layout is off by 0.1 or more)."""


@functools.cache
def _parameters() -> frozenset[str]:
    """The installed ``varlen_attn``'s parameter names, read once (every layer's call asks);
    empty where torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)


@functools.cache
def available() -> bool:
    """Whether torch has variable-length attention and CUDA is present."""
    return torch.cuda.is_available() and bool(_parameters())


def supported(q: torch.Tensor, k: torch.Tensor, window: tuple[int, int]) -> bool:
    """Whether :func:`attend` serves queries like ``q`` (``[num_tokens, num_heads, head_dim]``)
    over keys like ``k`` with ``window``; the first time for each combination, after a check
    against SDPA on the device."""
    if not q.is_cuda or q.dtype not in DTYPES:
        return False
    head_dim = q.shape[-1]
    if head_dim > MAX_HEAD_DIM or head_dim % HEAD_DIM_MULTIPLE:
        return False
    return _checked(q.device, q.dtype, q.shape[1], k.shape[1], head_dim, window)


@functools.cache
def _checked(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
             window: tuple[int, int]) -> bool:
    parameters = _parameters()
    if "scale" not in parameters:
        reason = "this torch's varlen_attn takes no scale"
    elif window not in ((-1, -1), (-1, 0)) and "window_size" not in parameters:
        reason = "this torch's varlen_attn takes no window_size"
    else:
        reason = _check(device, dtype, heads, kv_heads, head_dim, window)
    if reason:
        logger.warning("attention with window %s in %s (%d heads, %d key heads of %d) stays on SDPA: %s",
                       window, dtype, heads, kv_heads, head_dim, reason)
    return not reason


def _check(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
           window: tuple[int, int]) -> str:
    """'' when the kernel gives SDPA's float32 answer on seeded requests, else why not."""
    generator = torch.Generator().manual_seed(0)
    tokens = sum(CHECK_LENGTHS)
    q, k, v = (torch.randn(tokens, count, head_dim, generator=generator)
               for count in (heads, kv_heads, kv_heads))
    cu_seqlens = torch.tensor([0, *torch.tensor(CHECK_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    try:
        got = attend(*(t.to(device, dtype) for t in (q, k, v)), cu_seqlens.to(device), max(CHECK_LENGTHS),
                     window, head_dim ** -0.5).float().cpu()
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        return f"it raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    start = 0
    for length in CHECK_LENGTHS:
        rows = slice(start, start + length)
        expected = _reference(q[rows], k[rows], v[rows], window)
        error = float((got[rows] - expected).abs().max())
        if not error <= CHECK_TOLERANCE:  # NaN fails too
            return f"a {length}-token request was off by {error:.3g} (limit {CHECK_TOLERANCE})"
        start += length
    return ""


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: tuple[int, int]) -> torch.Tensor:
    """One request's attention in float32 SDPA with the window's dense mask: ``[length, heads, dim]``."""
    rows = torch.arange(q.shape[0])
    offset = rows[None] - rows[:, None]  # key minus query position
    mask = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool)
    if window[0] >= 0:
        mask &= offset >= -window[0]
    if window[1] >= 0:
        mask &= offset <= window[1]
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[0] != q.shape[0]).transpose(0, 1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_length: int,
           window: tuple[int, int], scale: float | None) -> torch.Tensor:
    """Attention within each request of packed tokens.

    :param q: ``[num_tokens, num_heads, head_dim]``, float16 or bfloat16, on CUDA.
    :param k: ``[num_tokens, num_kv_heads, head_dim]``; ``num_heads`` a multiple of ``num_kv_heads``.
    :param v: Same shape as ``k``.
    :param cu_seqlens: int32 ``[num_requests + 1]`` on the device: request ``i`` is tokens
        ``cu_seqlens[i]:cu_seqlens[i + 1]``.
    :param max_length: The longest request's token count.
    :param window: ``(before, after)`` as :func:`cpu_kernels.attend
        <poolrunner.core.kernels.cpu_kernels.attend>` takes it (-1: unbounded), which is flash
        attention's ``window_size``.
    :param scale: Softmax scale; ``head_dim ** -0.5`` when ``None``.
    :returns: ``[num_tokens, num_heads, head_dim]`` in ``q``'s dtype.
    """
    from torch.nn.attention.varlen import varlen_attn

    parameters = _parameters()
    options: dict[str, Any] = {"scale": scale}
    if "window_size" in parameters:
        options["window_size"] = window
    else:
        options["is_causal"] = window == (-1, 0)
    if k.shape[1] != q.shape[1] and "enable_gqa" in parameters:
        options["enable_gqa"] = True
    q, k, v = (t if t.is_contiguous() else t.contiguous() for t in (q, k, v))
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_length, max_length, **options)
