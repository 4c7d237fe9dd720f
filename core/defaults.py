"""Core's own default hook implementations, registered as the plugin named ``core``.

They are ``trylast``: any other plugin that answers ``pool`` or ``process_output`` wins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from poolrunner.core.plugin_api.hookspec import hookimpl

if TYPE_CHECKING:  # torch loads with the first model, not with the plugin manager
    import torch

    from poolrunner.core.plugin_api.batch import PoolingMetadata
    from poolrunner.core.plugin_api.output import OutputHandle
    from poolrunner.core.plugin_api.pooler import Pooler, PoolerOutput


@hookimpl(trylast=True)
def pool(pooler: Pooler, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> PoolerOutput:
    return pooler(hidden_states, metadata)


@hookimpl(trylast=True)
def process_output(output: PoolerOutput) -> OutputHandle:
    from poolrunner.core.plugin_api.output import SyncOutputHandle

    return SyncOutputHandle(output)
