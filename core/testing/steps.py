"""The step recorder: which requests ran in which engine step, and which chunk of each.

Built on the public plugin hooks alone (``add_request``, ``prepare_inputs``, ``remove_request``),
watched through pluggy's hook-call monitoring, so it registers nothing and works on any loaded
:class:`~poolrunner.Runtime`, also while it serves. Example::

    from poolrunner.core.testing.steps import record_steps

    runtime = Runtime(decoder_folder, max_num_batched_tokens=10)  # causal: prompts run in chunks
    with record_steps(runtime) as log:
        runtime.embed([list(range(3, 15)), list(range(20, 25))])  # 12 and 5 tokens
    first, second = log.admitted  # request ids, in admission order
    [step.request_ids for step in log.steps]          # [(first,), (first, second)]
    [step.num_scheduled_tokens for step in log.steps]  # [(10,), (2, 5)]
    [chunk.span for chunk in log.chunks(first)]        # [(0, 10), (10, 12)]
    assert not log.in_flight  # every request that entered has left
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from attrs import define, field, frozen

if TYPE_CHECKING:
    from poolrunner.core.plugin_api.batch import InputBatch
    from poolrunner.core.runtime import Runtime


@frozen
class Chunk:
    """The part of one request's prompt that one step ran.

    :ivar request_id: The request's id.
    :ivar task: The task it is pooled for (``"embed"``, ``"classify"``...).
    :ivar start: Index of the first prompt token run in this step (0 for the first chunk).
    :ivar stop: One past the last one; ``stop - start`` tokens ran.
    :ivar finished: This is the prompt's last chunk: the request is pooled in this step.
    """

    request_id: str
    task: str
    start: int
    stop: int
    finished: bool

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start

    @property
    def span(self) -> tuple[int, int]:
        return self.start, self.stop


@frozen
class Step:
    """One forward pass of the engine: its requests' chunks in packing order."""

    chunks: tuple[Chunk, ...]

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(chunk.request_id for chunk in self.chunks)

    @property
    def num_scheduled_tokens(self) -> tuple[int, ...]:
        """Tokens of each request run in this step, in packing order."""
        return tuple(chunk.num_tokens for chunk in self.chunks)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


@define
class StepLog:
    """What a runtime's engine did while recorded, in order.

    :ivar steps: Every forward pass (a step that failed and is retried in halves shows each try).
    :ivar admitted: Request ids as they entered the engine (``add_request``); a request refused
        before its hooks ran (a duplicate id, a prompt over ``max_model_len``) never enters.
    :ivar left: Request ids as they left it (``remove_request``): finished, aborted or refused.
    """

    steps: list[Step] = field(factory=list)
    admitted: list[str] = field(factory=list)
    left: list[str] = field(factory=list)

    @property
    def in_flight(self) -> list[str]:
        """Requests that entered while recorded and have not left, in admission order."""
        remaining = list(self.admitted)
        for request_id in self.left:
            if request_id in remaining:
                remaining.remove(request_id)
        return remaining

    def chunks(self, request_id: str) -> list[Chunk]:
        """The chunks of ``request_id`` in the order they ran (one, unless it was prefilled in chunks)."""
        return [chunk for step in self.steps for chunk in step.chunks if chunk.request_id == request_id]

    def clear(self) -> None:
        self.steps.clear()
        self.admitted.clear()
        self.left.clear()

    def _observe(self, hook_name: str, kwargs: dict[str, Any]) -> None:
        if hook_name == "prepare_inputs":
            self.steps.append(_step(kwargs["batch"]))
        elif hook_name == "add_request":
            self.admitted.append(kwargs["state"].request_id)
        elif hook_name == "remove_request":
            self.left.append(kwargs["state"].request_id)


def _step(batch: InputBatch) -> Step:
    # Read before the step runs: num_computed_tokens still counts the earlier chunks only.
    return Step(tuple(
        Chunk(state.request_id, state.request.params.task, state.num_computed_tokens,
              state.num_computed_tokens + count, state.num_computed_tokens + count == state.num_tokens)
        for state, count in zip(batch.requests, batch.num_scheduled_tokens, strict=True)
    ))


@contextlib.contextmanager
def record_steps(runtime: Runtime) -> Iterator[StepLog]:
    """Record ``runtime``'s engine steps and request entries and exits inside this block.

    Calls from any thread are recorded (the serving loop's too). Blocks may nest, with
    :func:`~poolrunner.core.testing.pytest_plugin.poolrunner_hook_recorder` too; leave them in
    reverse order of entry.

    :returns: The :class:`StepLog`, filled as the engine runs; it keeps its contents after the block.
    """
    log = StepLog()

    def before(hook_name: str, _impls: Any, kwargs: dict[str, Any]) -> None:
        log._observe(hook_name, kwargs)

    def after(*_args: Any) -> None:
        pass

    undo = runtime.plugin_manager.add_hookcall_monitoring(before, after)
    try:
        yield log
    finally:
        undo()
