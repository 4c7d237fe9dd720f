"""Step shapes rounded up to a few sizes, so the CPU's compiled kernels are reused.

oneDNN builds (JIT-compiles) a matrix-multiply kernel for every new input shape and caches it.
A packed step has ``num_tokens`` rows, which differs from step to step, so without rounding
nearly every step would pay kernel creation again: on 2 Zen 4 cores a bf16
``[n, 384] x [384, 1536]`` product took 0.86 ms for a new ``n`` near 8 against 0.23 ms cached,
which dominates a short request. Rounding ``num_tokens`` up to a bucket is the CPU analogue of
CUDA graph capture sizes; the padding rows are computed and dropped.
"""

from __future__ import annotations

# Buckets get coarser as steps grow: the rounding wastes at most 1/32 of a step's compute.
_MIN_GRANULARITY = 8
_SLACK_SHIFT = 5


def bucket_num_tokens(num_tokens: int) -> int:
    """The bucket ``num_tokens`` rounds up to: a multiple of ``max(8, 2**(floor(log2 n) - 5))``.

    :param num_tokens: Real tokens of a step, ``>= 1``.
    :returns: ``>= num_tokens`` and less than ``num_tokens * 33 / 32 + 8``. E.g. 5 -> 8,
        100 -> 104, 2000 -> 2016.
    """
    granularity = max(_MIN_GRANULARITY, 1 << max(0, num_tokens.bit_length() - 1 - _SLACK_SHIFT))
    return -(-num_tokens // granularity) * granularity
