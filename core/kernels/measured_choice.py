"""Which of two kernels computing the same product runs faster here, measured on first use.

oneDNN's prepacked bf16 inner product (:class:`~poolrunner.core.kernels.onednn.PackedLinear`)
is up to twice as fast as torch's own product (oneDNN's matmul over the plain weight) for most
row counts, yet for some shapes, row counts and thread counts its split of the work leaves a core
waiting: on 2 AMX Xeon cores, bf16, ``[512, 768] x [768, 768]`` took 0.35 ms prepacked against
0.25 ms for ``F.linear``, and ``[512, 1152] x [1152, 768]`` 0.62 against 0.37 ms, while 256 or 768
rows, one thread, or float32 showed no such gap. Which one wins depends on the CPU, the threads,
oneDNN's version and the shape, so it is measured where it runs, as cuDNN's benchmark mode
(``torch.backends.cudnn.benchmark``) picks its convolution algorithms: the first products of each
shape and row-count bucket run the two kernels alternately, one per call, each call timed, and the
faster one serves that bucket from then on. As with cuDNN's, a choice near a tie may differ from
one process to the next, and the outputs with it, to the kernels' rounding.

Each measured call runs one kernel, not both: the measurement then costs only the slower
kernel's extra time on its few calls. Running both kernels five times on a bucket's first call,
as this module first did, cost all-MiniLM-L6-v2 bf16 about 1 s of products on its first
150 documents (16 client threads, one Zen 4 core: 36.1 against 29.4 CPU ms a document once warm).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Hashable
from typing import TypeVar

from attrs import define, field

T = TypeVar("T")
logger = logging.getLogger(__name__)

ROW_BUCKET = 64
"""Row counts measured together: ``rows`` falls in bucket ``ceil(rows / ROW_BUCKET)``. The gaps
seen span 100-300 rows, and one measurement per 64 rows keeps them few (64 per shape up to a step
of 4,096 tokens)."""
RUNS = 3
"""Timed calls of each kernel in a measurement; the fastest of each, per row, is compared (the
minimum is the run least disturbed by other work, or by a kernel built on first use). The
layers of one shape in a model (6-30 a step) usually finish it within one step, at one row count."""
MARGIN = 0.9
"""The alternative replaces the default only when its fastest run took at most this fraction of
the default's: a gap of a few percent may be noise, and switching would only change the rounding."""


@define
class _Measurement:
    """A key's timings so far: the fastest seconds per unit of work of the default and the
    alternative, and how many calls each has run."""

    fastest: list[float] = field(factory=lambda: [math.inf, math.inf])
    runs: list[int] = field(factory=lambda: [0, 0])


class MeasuredChoice:
    """A cache of which kernel, the default or the alternative, is faster for a key.

    Both kernels must compute the same tensor (to their own rounding). Thread-safe: calls of one
    key from several threads add to one measurement.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        """:param clock: Seconds, monotonic (tests pass their own)."""
        self._clock = clock
        self._alternative_faster: dict[Hashable, bool] = {}
        self._measuring: dict[Hashable, _Measurement] = {}
        self._lock = threading.Lock()

    def __call__(self, key: Hashable, default: Callable[[], T], alternative: Callable[[], T], size: int = 1) -> T:
        """The result of the kernel chosen for ``key``; while ``key`` is measured, of the kernel
        whose turn it is (default and alternative alternately, the default first, :data:`RUNS`
        calls each), timed.

        :param size: The call's work (rows): calls of one key may differ in size, and their times
            are compared per unit.
        """
        chosen = self._alternative_faster.get(key)
        if chosen is not None:
            return alternative() if chosen else default()
        with self._lock:
            measurement = self._measuring.setdefault(key, _Measurement())
            which = int(measurement.runs[1] < measurement.runs[0])
        start = self._clock()
        result = (default, alternative)[which]()
        seconds = (self._clock() - start) / size
        with self._lock:
            self._record(key, measurement, which, seconds)
        return result

    def chosen(self, key: Hashable) -> bool | None:
        """Whether the alternative is the kernel chosen for ``key``; ``None`` while it is measured
        or before its first call."""
        return self._alternative_faster.get(key)

    def choices(self) -> dict[Hashable, bool]:
        """``key -> True`` where the alternative was chosen (a copy, to inspect)."""
        return dict(self._alternative_faster)

    def _record(self, key: Hashable, measurement: _Measurement, which: int, seconds: float) -> None:
        measurement.fastest[which] = min(measurement.fastest[which], seconds)
        measurement.runs[which] += 1
        if key in self._alternative_faster:  # chosen meanwhile, by another thread's call
            self._measuring.pop(key, None)
            return
        if min(measurement.runs) < RUNS:
            return
        default, alternative = measurement.fastest
        self._alternative_faster[key] = chosen = alternative <= MARGIN * default
        del self._measuring[key]
        logger.debug("measured %s: default %.3f ms, alternative %.3f ms per unit: the %s", key, 1e3 * default,
                     1e3 * alternative, "alternative" if chosen else "default")


def row_bucket(rows: int) -> int:
    """The bucket of ``rows`` rows (:data:`ROW_BUCKET`)."""
    return -(-rows // ROW_BUCKET)
