"""Compact embeddings with sentence-transformers' ``quantize_embeddings`` semantics.

``int8`` / ``uint8`` map each dimension's range ``[min, max]`` onto 256 buckets: given as
``ranges`` ``[2, d]`` (row 0 the minima, row 1 the maxima), or else calibrated on the
embeddings of the call itself, as sentence-transformers does without ``ranges``: a vector's
codes then depend on the other inputs of its call, so pass ``ranges`` from a representative
sample for stable codes. ``binary`` / ``ubinary`` keep one bit per dimension (``x > 0``),
packed eight to a byte, big-endian within the byte (``numpy.packbits``).
"""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np

from poolrunner.core.errors import InvalidRequestError

Precision = Literal["float32", "int8", "uint8", "binary", "ubinary"]
PRECISIONS: tuple[Precision, ...] = get_args(Precision)


def check_precision(precision: object) -> Precision:
    """:raises InvalidRequestError: unless ``precision`` is one of :data:`PRECISIONS`."""
    if precision not in PRECISIONS:
        raise InvalidRequestError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    return precision  # type: ignore[return-value]


def check_ranges(precision: str, ranges: object) -> None:
    """:raises InvalidRequestError: for ``ranges`` with a precision other than int8 / uint8 (the
    others have no range to calibrate)."""
    if ranges is not None and precision not in ("int8", "uint8"):
        raise InvalidRequestError(f"ranges applies to precision int8 or uint8, not {precision}", param="ranges")


def as_ranges(ranges: object) -> np.ndarray:
    """``ranges`` as float32 ``[2, d]``-shaped minima and maxima, checked before any work (the
    shape against the embeddings' width is the plan's check, which knows the model).

    :raises InvalidRequestError: for ragged lists, a value that is not a finite float32 (NaN, an
        infinity, or past float32's range: its codes would all be one bucket), or a minimum above
        its maximum.
    """
    try:
        exact = np.asarray(ranges, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"ranges must be two lists of d numbers (minima, maxima): {exc}",
                                  param="ranges") from None
    with np.errstate(over="ignore"):  # past float32's range: an infinity, refused below
        array = exact.astype(np.float32)
    bad = np.argwhere(~np.isfinite(array))
    if len(bad):
        where = "][".join(str(int(i)) for i in bad[0])
        raise InvalidRequestError(f"ranges[{where}] is {exact[tuple(bad[0])]:g}: ranges must be finite numbers "
                                  f"within float32's range (magnitude at most {np.finfo(np.float32).max:.4g})",
                                  param="ranges")
    if array.ndim == 2 and len(array) == 2 and (inverted := np.flatnonzero(array[0] > array[1])).size:
        d = int(inverted[0])
        raise InvalidRequestError(f"ranges: dimension {d}'s minimum {exact[0, d]:g} is above its maximum "
                                  f"{exact[1, d]:g}", param="ranges")
    return array


def quantize(embeddings: np.ndarray, precision: Precision, ranges: np.ndarray | None = None) -> np.ndarray:
    """``embeddings`` ``[n, d]`` float32 at ``precision``.

    :returns: ``float32`` ``[n, d]`` unchanged; ``int8`` / ``uint8`` ``[n, d]``; ``binary``
        (int8, each byte minus 128) / ``ubinary`` (uint8) ``[n, ceil(d / 8)]``.
    :raises InvalidRequestError: for ``ranges`` of another shape, or int8 / uint8 calibrated on
        fewer than two embeddings (one vector has no range to calibrate).
    """
    if precision == "float32":
        return embeddings
    if not len(embeddings) and precision in ("int8", "uint8"):
        return np.zeros(embeddings.shape, dtype=np.dtype(precision))  # nothing to calibrate or code
    if precision in ("binary", "ubinary"):
        packed = np.packbits(embeddings > 0, axis=-1)
        return (packed.astype(np.int16) - 128).astype(np.int8) if precision == "binary" else packed
    low, high = _ranges(embeddings, precision, ranges)
    steps = (high - low) / 255
    steps = np.where(steps == 0, 1, steps)  # a constant dimension maps to bucket 0
    buckets = np.clip(np.floor((embeddings - low) / steps), 0, 255)
    return (buckets - 128).astype(np.int8) if precision == "int8" else buckets.astype(np.uint8)


def _ranges(embeddings: np.ndarray, precision: str, ranges: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    if ranges is not None:
        ranges = np.asarray(ranges, dtype=np.float32)
        if ranges.shape != (2, embeddings.shape[-1]):
            raise InvalidRequestError(f"ranges must have shape [2, {embeddings.shape[-1]}] (minima, maxima per "
                                      f"dimension), got {list(ranges.shape)}", param="ranges")
        return ranges[0], ranges[1]
    if embeddings.shape[0] < 2:
        raise InvalidRequestError(f"{precision} needs ranges, or at least two embeddings in the call to calibrate "
                                  f"them on; got {embeddings.shape[0]}")
    return embeddings.min(axis=0), embeddings.max(axis=0)
