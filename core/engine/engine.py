"""The engine: admits requests, steps the scheduler and the runner, and hands back results."""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from attrs import frozen

from poolrunner.core.engine.runner import ModelRunner
from poolrunner.core.engine.scheduler import Scheduler
from poolrunner.core.errors import (
    InvalidRequestError,
    NonFiniteOutputError,
    PluginHookError,
    PoolrunnerError,
    PromptTooLongError,
)
from poolrunner.core.hooks import Hooks
from poolrunner.core.plugin_api.batch import InputBatch
from poolrunner.core.plugin_api.output import OutputHandle, RequestOutput
from poolrunner.core.plugin_api.request import RequestState, advance
from poolrunner.core.types import ModelConfig, PoolingParams, PoolingRequest


@frozen
class _Ready:
    """An :class:`OutputHandle` whose outputs are already on the CPU (collected by :meth:`Engine._bisect`)."""

    outputs: tuple[RequestOutput, ...]

    def get_output(self) -> list[RequestOutput]:
        return list(self.outputs)


@frozen
class _Inflight:
    """A launched step: what it scheduled, what it finishes, and its results on their way."""

    requests: tuple[RequestState, ...]
    finished: tuple[RequestState, ...]
    handle: OutputHandle | None


class Engine:
    """Request lifecycle around a :class:`ModelRunner`.

    ``add_request`` validates and admits; ``step`` runs one batch and returns the requests it
    finished; every request that leaves (finished, aborted or failed) goes through the
    ``remove_request`` hook exactly once.
    """

    def __init__(
        self, runner: ModelRunner, scheduler: Scheduler, hooks: Hooks, model_config: ModelConfig,
        device: torch.device, *, async_scheduling: bool = False,
    ) -> None:
        self.runner = runner
        self.async_scheduling = async_scheduling
        self.scheduler = scheduler
        self.hooks = hooks
        self.model_config = model_config
        self.device = device
        self.requests: dict[str, RequestState] = {}
        self._failures: dict[str, Exception] = {}  # requests that failed on their own, until taken
        self._inflight: _Inflight | None = None  # async scheduling: launched, not yet collected

    def add_request(self, request: PoolingRequest, *, group: Hashable = None, priority: int = 0) -> None:
        """Admit ``request``; ``group`` (one caller's requests) and ``priority`` (lower runs first)
        place it in the scheduler's turns (:class:`~poolrunner.core.engine.scheduler.Scheduler`).

        :raises InvalidRequestError: for a duplicate id, a prompt over ``max_model_len``, or
            parameters the pooler rejects. Nothing is admitted then.
        """
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in flight")
        # An image takes its vision tower's positions, whatever the text tower's maximum (a model
        # without one: the pixel_values plugin refuses the request).
        images = request.pixel_values is not None and self.model_config.image_positions
        limit = self.model_config.image_positions if images else self.model_config.max_model_len
        if request.num_tokens > limit:
            raise PromptTooLongError(
                f"request {request.request_id!r} has {request.num_tokens} tokens, more than the "
                f"maximum of {limit} (max_model_len of {self.model_config.name})"
            )
        self.check_params(request.params, f"request {request.request_id!r}")
        state = RequestState(request=request)
        self.requests[request.request_id] = state
        try:
            self.hooks.add_request(state=state, model_config=self.model_config)
        except BaseException:
            self._release(state)
            raise
        self.scheduler.add(state, group=group, priority=priority)

    def check_params(self, params: PoolingParams, who: str = "the request") -> None:
        """Check ``params`` against its task's pooler (``dimensions`` a model cannot honour...).

        :raises InvalidRequestError: for a task no pooler serves, or parameters the pooler rejects.
        """
        pooler = self.runner.poolers.get(params.task)
        if pooler is None:
            raise InvalidRequestError(f"{who} asks for task {params.task!r}, but this runtime serves "
                                      f"{sorted(self.runner.poolers)}")
        pooler.check_params(params)

    def abort_request(self, request_id: str) -> None:
        """Remove a request wherever it is; unknown or already removed ids are ignored."""
        state = self.requests.get(request_id)
        if state is not None:
            self._release(state)

    def has_unfinished_requests(self) -> bool:
        """Requests wait to be scheduled, or a launched step's results are still to collect."""
        return self.scheduler.has_unfinished() or self._inflight is not None

    def step(self) -> list[tuple[str, RequestOutput]]:
        """Run one batch; return ``(request_id, output)`` for each request that finished.

        With ``async_scheduling`` a step launches the next batch before it collects the batch
        launched by the previous step, so copying those results to the CPU overlaps with
        compute (and requests admitted meanwhile join the next batch). A request prefilled in
        chunks yields nothing until its last chunk. If the step fails and its requests ran whole
        prompts, they are retried in halves: the others finish, and each request that fails
        alone is removed, its error kept for :meth:`take_failures`.
        Otherwise the step's requests are removed (their ``remove_request`` hooks run) and the
        error propagates; waiting requests stay queued.
        """
        if not self.async_scheduling:
            inflight = self._launch()
            return self._collect(inflight) if inflight is not None else []
        launched = self._launch() if self.scheduler.has_unfinished() else None
        previous, self._inflight = self._inflight, launched
        return self._collect(previous) if previous is not None else []

    def take_failures(self) -> list[tuple[str, Exception]]:
        """``(request_id, error)`` of each request that failed on its own (see :meth:`step`)
        since the last call; those requests have left the engine."""
        failures, self._failures = list(self._failures.items()), {}
        return failures

    def run(self, requests: Sequence[PoolingRequest]) -> Iterator[tuple[str, RequestOutput]]:
        """Admit ``requests`` and yield ``(request_id, output)`` as each finishes.

        All requests are validated before any runs. If the caller stops early or a step fails,
        every remaining request of this call is aborted; a request that failed on its own
        raises its error.
        """
        admitted: list[str] = []
        try:
            for request in requests:
                self.add_request(request)
                admitted.append(request.request_id)
            while self.has_unfinished_requests():
                yield from self.step()
                for _, error in self.take_failures():  # this call's own: it is the only caller
                    raise error
        finally:
            for request_id in admitted:
                self.abort_request(request_id)

    def _launch(self) -> _Inflight | None:
        """Schedule and run one step; its results are collected later.

        When the step raises (anything but poolrunner's own errors, which every step would
        raise alike) and every request in it runs its whole prompt, the requests are run again in
        halves (:meth:`_bisect`), so only a request that fails on its own fails.
        """
        scheduled = self.scheduler.schedule()
        if not scheduled.requests:
            return None
        try:
            finished, handle = self._execute(scheduled.requests, scheduled.num_scheduled_tokens)
        except Exception as exc:
            whole = all(state.num_computed_tokens == 0 and count == state.num_tokens
                        for state, count in zip(scheduled.requests, scheduled.num_scheduled_tokens, strict=True))
            # poolrunner's own errors here (two plugins setting one input...) fail every step alike;
            # a plugin's own exception may be one input's, as a model's may
            if whole and len(scheduled.requests) > 1 and (not isinstance(exc, PoolrunnerError)
                                                          or isinstance(exc, PluginHookError)):
                return self._bisect(scheduled.requests)
            self._release_all(scheduled.requests)
            raise
        except BaseException:
            self._release_all(scheduled.requests)
            raise
        for state, count in zip(scheduled.requests, scheduled.num_scheduled_tokens, strict=True):
            advance(state, count)
        return _Inflight(scheduled.requests, tuple(finished), handle)

    def _execute(self, states: Sequence[RequestState], counts: Sequence[int]) -> tuple[list[RequestState], Any]:
        batch = InputBatch.build(states, counts, self.device)
        return self.runner.execute(batch)

    def _bisect(self, states: Sequence[RequestState]) -> _Inflight:
        """Run whole-prompt requests whose shared step failed in ever smaller steps, so the
        innocent finish: a request that fails alone leaves the engine, its error kept for
        :meth:`take_failures`. Their results are collected at once (no overlap on this rare path)."""
        finished: list[RequestState] = []
        outputs: list[RequestOutput] = []
        groups = [list(states)]
        while groups:
            group = groups.pop()
            for state in group:
                self.runner.free(state.request_id)  # nothing of the failed attempt is kept
            try:
                done, handle = self._execute(group, [state.num_tokens for state in group])
                results = handle.get_output() if handle is not None else []
            except Exception as exc:
                if len(group) == 1:
                    self._failures[group[0].request_id] = exc
                    self._release(group[0])
                else:
                    groups += [group[len(group) // 2:], group[:len(group) // 2]]
                continue
            for state in group:
                advance(state, state.num_tokens)
            finished += done
            outputs += results
        return _Inflight(tuple(finished), tuple(finished), _Ready(outputs))

    def _collect(self, inflight: _Inflight) -> list[tuple[str, RequestOutput]]:
        """Wait for a launched step's results; release the requests it finished."""
        try:
            outputs = inflight.handle.get_output() if inflight.handle is not None else []
        except BaseException:
            self._release_all(inflight.requests)
            raise
        results = []
        for state, output in zip(inflight.finished, outputs, strict=True):
            if self.requests.get(state.request_id) is state:  # not aborted (nor its id reused) meanwhile
                error = _non_finite(output)
                if error is None:
                    results.append((state.request_id, output))
                else:
                    self._failures[state.request_id] = error
                self._release(state)
        return results

    def _release_all(self, states: Sequence[RequestState]) -> None:
        for state in states:
            self._release(state)

    def _release(self, state: RequestState) -> None:
        if self.requests.pop(state.request_id, None) is not None:
            self.scheduler.remove(state)
            self.runner.free(state.request_id)
            self.hooks.remove_request(state=state)


def _non_finite(output: RequestOutput) -> NonFiniteOutputError | None:
    """The error for an output holding NaN or an infinity (its floating tensors), else ``None``."""
    tensors = output.values() if isinstance(output, dict) else (output,)
    floats = [tensor for tensor in tensors if tensor.is_floating_point()]
    finite = [np.isfinite(_numpy(tensor)) for tensor in floats]  # numpy: a quarter of torch's call cost
    if all(mask.all() for mask in finite):
        return None
    bad = sum(int(mask.size - mask.sum()) for mask in finite)
    total = sum(mask.size for mask in finite)
    return NonFiniteOutputError(
        f"the model's output holds NaN or infinite values ({bad} of {total}): the model overflowed on an input "
        "at its dtype, or its weights (or a LoRA adapter's) hold such values; the request is refused rather "
        "than answered with values that are not numbers")


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU output as numpy (bfloat16, which numpy lacks, as float32)."""
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()
