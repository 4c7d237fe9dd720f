"""Which of two kernels computing the same product runs faster here, measured on first use.

oneDNN's prepacked bf16 inner product (:class:`~poolrunner.core.kernels.onednn.PackedLinear`)
is up to twice as fast as torch's own product (oneDNN's matmul over the plain weight) for most
row counts, yet for some shapes, row counts and thread counts its split of the work leaves a core
waiting: on 2 AMX Xeon cores, bf16, ``[512, 768] x [768, 768]`` took 0.35 ms prepacked against
0.25 ms for ``F.linear``, and ``[512, 1152] x [1152, 768]`` 0.62 against 0.37 ms, while 256 or 768
rows, one thread, or float32 showed no such gap. Which one wins depends on the CPU, the threads,
oneDNN's version and the shape, so it is measured where it runs, as cuDNN's benchmark mode
(``torch.backends.cudnn.benchmark``) picks its convolution algorithms: the first product of each
shape and row-count bucket runs both kernels a few times, alternately, on its real input, and the
faster one serves that bucket from then on. As with cuDNN's, a choice near a tie may differ from
one process to the next, and the outputs with it, to the kernels' rounding.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)

ROW_BUCKET = 64
"""Row counts measured together: ``rows`` falls in bucket ``ceil(rows / ROW_BUCKET)``. The gaps
seen span 100-300 rows, and one measurement per 64 rows keeps them few (64 per shape up to a step
of 4,096 tokens, each about 10 products once)."""
RUNS = 5
"""Runs of each kernel in a measurement; the fastest run of each is compared (the minimum is the
run least disturbed by other work on the machine)."""
MARGIN = 0.9
"""The alternative replaces the default only when its fastest run took at most this fraction of
the default's: a gap of a few percent may be noise, and switching would only change the rounding."""


class MeasuredChoice:
    """A cache of which kernel, the default or the alternative, is faster for a key.

    Both kernels must compute the same tensor (to their own rounding). Not locked: two threads
    measuring one key at once each choose, and the last choice stays.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        """:param clock: Seconds, monotonic (tests pass their own)."""
        self._clock = clock
        self._alternative_faster: dict[Hashable, bool] = {}

    def __call__(self, key: Hashable, default: Callable[[], T], alternative: Callable[[], T]) -> tuple[bool, T]:
        """Whether the alternative is the kernel chosen for ``key``, and its result: measured
        (:data:`RUNS` runs of each) the first time ``key`` is seen, the result then from the chosen
        kernel's last run."""
        chosen = self._alternative_faster.get(key)
        if chosen is None:
            chosen, result = self._measure(key, default, alternative)
            self._alternative_faster[key] = chosen
            return chosen, result
        return chosen, alternative() if chosen else default()

    def choices(self) -> dict[Hashable, bool]:
        """``key -> True`` where the alternative was chosen (a copy, to inspect)."""
        return dict(self._alternative_faster)

    def _measure(self, key: Hashable, default: Callable[[], T], alternative: Callable[[], T]) -> tuple[bool, T]:
        fastest, results = [math.inf, math.inf], [None, None]
        for _ in range(RUNS):
            for which, kernel in enumerate((default, alternative)):
                start = self._clock()
                results[which] = kernel()
                fastest[which] = min(fastest[which], self._clock() - start)
        chosen = fastest[1] <= MARGIN * fastest[0]
        logger.debug("measured %s: default %.3f ms, alternative %.3f ms: the %s", key, 1e3 * fastest[0],
                     1e3 * fastest[1], "alternative" if chosen else "default")
        return chosen, results[chosen]


def row_bucket(rows: int) -> int:
    """The bucket of ``rows`` rows (:data:`ROW_BUCKET`)."""
    return -(-rows // ROW_BUCKET)
