"""The interface every pooler implements, whichever plugin provides it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TypeAlias

import torch
from torch import nn

from poolrunner.core.errors import InvalidRequestError
from poolrunner.core.plugin_api.batch import PoolingMetadata
from poolrunner.core.types import PoolingParams, PoolingTask

PoolerOutput: TypeAlias = torch.Tensor | list[torch.Tensor] | list[dict[str, torch.Tensor]]
"""One result per scheduled request, in packing order: either one tensor ``[num_reqs, ...]``
when every result has the same shape, or a list with one entry per request (heterogeneous
shapes, such as mixed Matryoshka ``dimensions`` or per-token outputs). An entry may be a dict
of named tensors when a task has several outputs (``embed&token_classify``)."""


class Pooler(nn.Module, ABC):
    """Turns a step's packed hidden states into per-request results.

    A pooler is an ``nn.Module`` so that its weights (a Dense projection, a classifier head)
    move with the model to its device and dtype. Plugins hand poolers to the runner from the
    ``get_pooler`` hook.
    """

    @abstractmethod
    def get_supported_tasks(self) -> frozenset[PoolingTask]:
        """The tasks this pooler can compute."""

    reads_rows: str = "all"
    """Which rows of the hidden states :meth:`forward` reads: ``"all"``, or only each request's
    ``"first"`` (CLS pooling, a head on the CLS row) or ``"last"`` (LAST pooling, a decoder's
    score head on its last token). In a step where every pooler reads the same first or last
    rows, the last layer of a model that allows it computes those rows only and leaves the others
    zero (:mod:`~poolrunner.core.model.inlined_blocks`). Another value fails the load. The plugin
    test kit's conformance suite checks that a pooler's outputs are the same with every row computed."""

    accepted_params: frozenset[str] = frozenset()
    """Names of the :class:`PoolingParams` options this pooler honours; others are rejected."""

    def check_params(self, params: PoolingParams) -> None:
        """Reject parameters this pooler cannot honour, before the request is admitted.

        The default rejects every option set on the request that is not in
        :attr:`accepted_params`; subclasses extend it with range checks.

        :raises InvalidRequestError: naming the value and what is allowed.
        """
        for name in sorted(params.given() - self.accepted_params):
            value = getattr(params, name)
            shown = list(value) if isinstance(value, tuple) else value  # as the caller wrote it
            raise InvalidRequestError(f"{name} does not apply to task {params.task!r} (got {shown!r})")

    @abstractmethod
    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> PoolerOutput:
        """Pool one step.

        :param hidden_states: ``[num_tokens, hidden_size]`` in the model's dtype, packed.
        :param metadata: Which rows belong to which request, and each request's params.
        :returns: One result per request, in packing order (see :data:`PoolerOutput`).
        """
