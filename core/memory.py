"""The C heap: handing freed memory back to the operating system after a large request, and
keeping a model step's buffers mapped between steps.

Tokenizing megabytes of text allocates hundreds of megabytes in many small blocks (the Rust
tokenizer's strings and offsets, Python's token lists) across glibc's per-thread arenas; once
freed, glibc keeps most of it, so the process's resident size stays at its peak. glibc's
``malloc_trim(0)`` returns the free pages of every arena. Elsewhere (macOS, musl, Windows) there
is no such call and nothing happens.

A server also caps glibc's arenas (:func:`limit_malloc_arenas`): each of the many worker threads
that read request bodies and tokenize otherwise gets an arena of its own, and a megabyte body
freed in one of them, among small blocks still in use, leaves pages no trim can return.

A model on the CPU keeps its steps' buffers mapped between steps (:func:`keep_step_buffers`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the heap functions need none
    from torch import nn


logger = logging.getLogger(__name__)

TRIM_AFTER_CHARS = 1_000_000
"""Characters tokenized by one call (or bytes of one request's body, in the server) from which
:func:`release_memory` runs after it."""

_trim_lock = threading.Lock()


def _glibc_function(name: str, argtypes: list[type]) -> Callable[..., int] | None:
    """The C library's function ``name`` (returning ``int``), or ``None`` off Linux, without
    glibc, or if it cannot be loaded."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(None), name)  # the process's own C library; musl has neither: AttributeError
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or ``None`` where there is none (:func:`_glibc_function`)."""
    return _glibc_function("malloc_trim", [ctypes.c_size_t])


M_ARENA_MAX = -8
"""glibc's ``mallopt`` parameter for the most arenas (``malloc.h``)."""
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MAX_STEP_MMAP_THRESHOLD = 64 << 20
STEP_BLOCK_HEADROOM = 64 << 10
"""Added to a step's largest block for the threshold: glibc maps a request whose size with its
chunk header reaches the threshold, and torch asks for 64-byte-aligned blocks (glibc adds the
alignment to the request), so a threshold of exactly ``[tokens, widest]``'s bytes mapped that very
block fresh at every step: all-MiniLM-L6-v2 in int8 ran its MLPs' int32 products 1.6x slower."""
STEP_TRIM_THRESHOLD = 256 << 20
_step_threshold = 0  # the largest heap threshold set so far: one per process, for every model in it
_step_lock = threading.Lock()


def limit_malloc_arenas(count: int) -> bool:
    """Let glibc create at most ``count`` malloc arenas from now on (``mallopt(M_ARENA_MAX)``,
    as the ``MALLOC_ARENA_MAX`` variable does); call it before the process starts its threads.
    Measured with 16 clients of short requests and three 15 MB bodies at a time: resident memory
    ended within 2% of its level before, against +13% with glibc's default of 8 per core.
    Never raises.

    :returns: Whether the limit was set (``False`` without glibc).
    """
    mallopt = _glibc_function("mallopt", [ctypes.c_int, ctypes.c_int])
    return mallopt is not None and bool(mallopt(M_ARENA_MAX, count))


def keep_step_buffers(step_block_bytes: int) -> bool:
    """Let glibc reuse the blocks of a model step's activations instead of mapping fresh pages for
    each: blocks up to ``step_block_bytes`` come from the heap (``M_MMAP_THRESHOLD``) and up to
    256 MiB of free heap stays mapped (``M_TRIM_THRESHOLD``). glibc's defaults map every block
    from 128 KiB up anew until its adaptive threshold catches up, and hand the pages back between
    steps, so each step pays page faults on its ``[tokens, intermediate]`` products. Measured on 2
    Zen 4 cores: 9-15% faster passes for SmolLM2-135M in bfloat16 and all-MiniLM-L6-v2 in float32,
    peak memory unchanged.

    Larger blocks (a request longer than the token budget runs as a step of its own) are still
    mapped fresh and unmapped when freed: on the heap, blocks of ever larger sizes cannot reuse
    each other's holes, and resident memory grew faster than the length (a ModernBERT-base-shaped
    model in float32, one request, with every block under 64 MiB on the heap: 130 / 367 / 956 MiB
    of work memory at 2,048 / 4,096 / 8,192 tokens; mapped fresh: 77 / 146 / 284, at the same speed
    at 8,192 tokens; 2 Zen 3 cores).

    A ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` set by the user wins. With several
    models in one process the largest threshold asked for holds. :func:`release_memory` still
    returns everything free after a large request. Never raises.

    :param step_block_bytes: The largest block a step within the token budget makes (see
        :func:`step_block_bytes`); at most 64 MiB is used.
    :returns: Whether the thresholds were set (``False`` without glibc or when the user set them).
    """
    global _step_threshold
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    mallopt = _glibc_function("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None:
        return False
    with _step_lock:
        _step_threshold = max(_step_threshold, min(step_block_bytes + STEP_BLOCK_HEADROOM, MAX_STEP_MMAP_THRESHOLD))
        return bool(mallopt(M_MMAP_THRESHOLD, _step_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, STEP_TRIM_THRESHOLD))


def step_block_bytes(model: nn.Module, max_num_batched_tokens: int) -> int:
    """The largest activation block a step of ``max_num_batched_tokens`` tokens makes, about: the
    widest layer's ``[tokens, width]`` output in float32, in bytes. A layer's width is its
    ``out_features`` or the larger side of its 2-D weight (GPT-2's ``Conv1D`` stores ``[in, out]``);
    embedding tables are lookups, not outputs. :data:`MAX_STEP_MMAP_THRESHOLD` where no layer tells."""
    import torch
    from torch import nn

    widest = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and not isinstance(module, nn.Embedding):
            widest = max(widest, *weight.shape)
        widest = max(widest, getattr(module, "out_features", 0))
    return max_num_batched_tokens * widest * 4 if widest else MAX_STEP_MMAP_THRESHOLD


def release_memory() -> bool:
    """Return the free memory of the C heap to the operating system (glibc's ``malloc_trim(0)``);
    one call at a time, others return at once. Never raises.

    :returns: Whether memory was released (``False`` without glibc, or while another call runs).
    """
    trim = _malloc_trim()
    if trim is None or not _trim_lock.acquire(blocking=False):
        return False
    try:
        return bool(trim(0))
    except OSError:  # a ctypes call failing inside libc: never worth failing a request over
        logger.debug("malloc_trim failed", exc_info=True)
        return False
    finally:
        _trim_lock.release()
