"""Handles through which a step's pooled results reach the CPU."""

from __future__ import annotations

from typing import Protocol

import torch

from poolrunner.core.plugin_api.pooler import PoolerOutput

RequestOutput = torch.Tensor | dict[str, torch.Tensor]
"""One request's result on the CPU: a tensor, or named tensors for multi-output tasks."""


class OutputHandle(Protocol):
    """What the ``process_output`` hook returns: call :meth:`get_output` exactly once."""

    def get_output(self) -> list[RequestOutput]:
        """Block until the results are on the CPU; one per request, in packing order."""
        ...


def to_cpu(row: RequestOutput) -> RequestOutput:
    if isinstance(row, dict):
        return {name: tensor.cpu() for name, tensor in row.items()}
    return row.cpu()


class SyncOutputHandle:
    """Copies results to the CPU at construction; the default when no plugin overlaps copies."""

    def __init__(self, output: PoolerOutput) -> None:
        self._output: list[RequestOutput] | None = [to_cpu(row) for row in output]

    def get_output(self) -> list[RequestOutput]:
        if self._output is None:
            raise RuntimeError("get_output() was already called on this handle")
        output, self._output = self._output, None
        return output
