"""Built-in plugin: moves each step's results to the CPU without blocking the next step.

On CUDA the device-to-host copies are queued on a dedicated stream (after the step's compute)
into pinned host memory, and an event marks their completion; ``get_output()`` waits on that
event before anything reads the host buffers (reading first was a real race in vLLM). Meanwhile
the engine can schedule and launch the next step. On the CPU there is nothing to overlap: the
results are cloned so that they own their storage, which keeps the same contract.

Results are either one tensor for the whole step (every request finished with the same shape:
one copy, then split into per-request rows) or a list with one entry per request (different
shapes, or named outputs), each copied on its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from poolrunner.core import hookimpl

if TYPE_CHECKING:  # torch loads with a model, not with `poolrunner plugins`
    from poolrunner.core import InputBatch, OutputHandle, PoolerOutput


@hookimpl  # before core's trylast default; a third-party plugin registers later and wins
def process_output(output: PoolerOutput, batch: InputBatch) -> OutputHandle:
    from .handle import AsyncOutputHandle

    return AsyncOutputHandle(output, batch.device)
