"""Leading blocks replayed from a recorded run instead of computed again.

int8's load measures each linear layer's sensitivity with one run per layer, that layer alone in
int8 (:func:`poolrunner.core.precision.quantize_checked`). Every block before that layer's block
then computes exactly what it computed in the reference run, on the same requests: this module
records each block's outputs once and hands them back in the same order, so a run over a layer
in block ``b`` of ``n`` computes only blocks ``b`` to ``n - 1``: about half of the work over all
layers. A block is an item of the outermost ``nn.ModuleList`` on a layer's path
(``layers.3.mlp.down_proj`` is in block 3 of ``layers``); a layer outside any list (BERT's
pooler) has no block and its run computes everything.

A replayed block is called as before (its hooks, its attributes), only its ``forward`` returns
the recorded output, a copy of it: a later block may change its input in place. Every run must
make the calls the recording saw, in the same order (the same requests, the same steps); a run
that makes more raises ``RuntimeError`` rather than compute on the wrong outputs. Replay only
ranks layers: the model as served is judged by full runs of the probe.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map


def block_of(model: nn.Module, name: str) -> tuple[str, int] | None:
    """``(path of the ModuleList, index in it)`` of the block holding module ``name``; ``None``
    when no ``nn.ModuleList`` is on its path."""
    parts = name.split(".")
    module = model
    for depth, part in enumerate(parts[:-1]):
        module = getattr(module, part)
        if isinstance(module, nn.ModuleList) and parts[depth + 1].isdigit():
            return ".".join(parts[: depth + 1]), int(parts[depth + 1])
    return None


def _copy(value: Any) -> Any:
    return tree_map(lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf, value)


class BlockReplay:
    """The outputs of the blocks of ``model``'s lists, recorded during one run (:meth:`recording`)
    and replayed for the leading blocks of a later one (:meth:`replaying`)."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._outputs: dict[tuple[str, int], list[Any]] = {}

    @contextlib.contextmanager
    def recording(self, lists: set[str]) -> Iterator[None]:
        """Record every output of every block of the ``lists`` (ModuleList paths) in the run inside."""
        self._outputs = {}
        handles = []
        for path in lists:
            for index, block in enumerate(self._model.get_submodule(path)):
                calls = self._outputs.setdefault((path, index), [])
                handles.append(block.register_forward_hook(
                    lambda _module, _args, output, calls=calls: calls.append(_copy(output))))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def replaying(self, block: tuple[str, int] | None) -> Iterator[None]:
        """In the run inside, the blocks before ``block`` (in its list) return their recorded
        outputs; ``None``: every block computes."""
        patched = []
        if block is not None:
            path, stop = block
            for index, module in enumerate(self._model.get_submodule(path)[:stop]):
                patched.append((module, module.__dict__.get("forward")))  # a wrapper of its own, if any
                module.forward = self._replay(path, index)  # an instance attribute: hooks still run
        try:
            yield
        finally:
            for module, own in patched:
                if own is None:
                    del module.forward
                else:
                    module.forward = own

    def _replay(self, path: str, index: int):
        recorded = iter(self._outputs[(path, index)])

        def forward(*_args: Any, **_kwargs: Any) -> Any:
            try:
                return _copy(next(recorded))
            except StopIteration:
                raise RuntimeError(f"block {index} of {path} was called more often than in the recorded run") from None

        return forward
