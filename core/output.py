"""Handles through which a step's pooled results reach the CPU."""

from __future__ import annotations

from typing import Protocol

import torch

from poolrunner.core.pooler import PoolerOutput


class OutputHandle(Protocol):
    """What the ``process_output`` hook returns: call :meth:`get_output` exactly once."""

    def get_output(self) -> list[torch.Tensor]:
        """Block until the results are on the CPU; one float tensor per request, packing order."""
        ...


class SyncOutputHandle:
    """Copies results to the CPU at construction; the default when no plugin overlaps copies."""

    def __init__(self, output: PoolerOutput) -> None:
        self._output: list[torch.Tensor] | None = [row.cpu() for row in output]

    def get_output(self) -> list[torch.Tensor]:
        if self._output is None:
            raise RuntimeError("get_output() was already called on this handle")
        output, self._output = self._output, None
        return output
