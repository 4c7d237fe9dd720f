"""The handle of the async_output plugin: copies started at once, read once they finished."""

from __future__ import annotations

import torch

from poolrunner.core import PoolerOutput, RequestOutput


class AsyncOutputHandle:
    """Copies started at construction; :meth:`get_output` waits for them, once."""

    def __init__(self, output: PoolerOutput, device: torch.device) -> None:
        self._event: torch.cuda.Event | None = None
        if device.type == "cuda":
            self._stream = _copy_stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))  # the step's results are ready
            with torch.cuda.stream(self._stream):
                self._output = self._copy(output, _to_pinned_host)
            self._event = torch.cuda.Event()
            self._event.record(self._stream)
        else:
            self._output = self._copy(output, torch.Tensor.clone)
        self._taken = False

    @staticmethod
    def _copy(output: PoolerOutput, copy) -> list[RequestOutput]:
        if isinstance(output, torch.Tensor):  # fast path: one copy for the whole step
            return list(copy(output).unbind(0))
        return [{name: copy(t) for name, t in row.items()} if isinstance(row, dict) else copy(row) for row in output]

    def get_output(self) -> list[RequestOutput]:
        if self._taken:
            raise RuntimeError("get_output() was already called on this handle")
        self._taken = True
        if self._event is not None:
            self._event.synchronize()  # never read pinned buffers before the copies finished
        return self._output


def _to_pinned_host(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    tensor.record_stream(torch.cuda.current_stream(tensor.device))  # keep the source alive until copied
    return host


# One side stream per device, made on first use (never at import): a device resource shared by
# all runtimes of the process, not per-request state.
_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]
