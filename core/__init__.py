"""poolrunner's core: the plugin system, the engine and the public API plugins build on.

Plugins import only from here (an import-linter contract checks it). Names that need torch or
transformers load on first use, so ``poolrunner --help`` and ``poolrunner plugins`` start fast.
"""

import importlib
from typing import TYPE_CHECKING, Any

# Nothing here touches os.environ: no code path reaches a model hub because every load passes
# local_files_only=True, not because the process (and every project beside it) is forced offline.
from poolrunner.core.config import ModelOverrides, RuntimeConfig
from poolrunner.core.errors import (
    DimensionsNotSupportedError,
    InputTooLongError,
    InvalidRequestError,
    ModelLoadError,
    PluginConflictError,
    PluginHookError,
    PluginLoadError,
    PoolerOutputError,
    PoolrunnerError,
    PromptTooLongError,
    UnsupportedAttentionError,
    UnsupportedTaskError,
)
from poolrunner.core.manager import ENTRY_POINT_GROUP, build_plugin_manager
from poolrunner.core.plugin_api.hookspec import hookimpl
from poolrunner.core.plugin_api.options import RequestOption
from poolrunner.core.plugin_api.request import RequestState
from poolrunner.core.types import (
    POOLING_TASKS,
    DenseLayerSpec,
    LoraRequest,
    ModelConfig,
    PluginInfo,
    PoolingParams,
    PoolingRequest,
    PoolingTask,
    PoolingType,
)

_LAZY = {
    "check_dimensions": "poolrunner.core.matryoshka",
    "ImageURL": "poolrunner.core.inputs.images",
    "classifier_activation": "poolrunner.core.activation",
    "InputBatch": "poolrunner.core.plugin_api.batch",
    "PoolingMetadata": "poolrunner.core.plugin_api.batch",
    "OutputHandle": "poolrunner.core.plugin_api.output",
    "RequestOutput": "poolrunner.core.plugin_api.output",
    "Pooler": "poolrunner.core.plugin_api.pooler",
    "PoolerOutput": "poolrunner.core.plugin_api.pooler",
    "Runtime": "poolrunner.core.runtime",
    "SequenceHead": "poolrunner.core.model.heads",
    "StModule": "poolrunner.core.model.st_metadata",
    "read_modules": "poolrunner.core.model.st_metadata",
    "load_weights": "poolrunner.core.model.weight_files",
    "sequence_classifier_head": "poolrunner.core.model.heads",
    "token_classifier_head": "poolrunner.core.model.heads",
    "ClassificationResult": "poolrunner.core.frontend.results",
    "RerankResult": "poolrunner.core.frontend.results",
}

if TYPE_CHECKING:
    from poolrunner.core.activation import classifier_activation
    from poolrunner.core.frontend.results import ClassificationResult, RerankResult
    from poolrunner.core.inputs.images import ImageURL
    from poolrunner.core.matryoshka import check_dimensions
    from poolrunner.core.model.heads import SequenceHead, sequence_classifier_head, token_classifier_head
    from poolrunner.core.model.st_metadata import StModule, read_modules
    from poolrunner.core.model.weight_files import load_weights
    from poolrunner.core.plugin_api.batch import InputBatch, PoolingMetadata
    from poolrunner.core.plugin_api.output import OutputHandle, RequestOutput
    from poolrunner.core.plugin_api.pooler import Pooler, PoolerOutput
    from poolrunner.core.runtime import Runtime


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ENTRY_POINT_GROUP",
    "POOLING_TASKS",
    "ClassificationResult",
    "DenseLayerSpec",
    "DimensionsNotSupportedError",
    "ImageURL",
    "InputBatch",
    "InvalidRequestError",
    "ModelConfig",
    "ModelLoadError",
    "ModelOverrides",
    "OutputHandle",
    "PluginConflictError",
    "PluginHookError",
    "PluginInfo",
    "PluginLoadError",
    "Pooler",
    "PoolerOutput",
    "PoolerOutputError",
    "PoolingMetadata",
    "LoraRequest",
    "PoolingParams",
    "PoolingRequest",
    "PoolingTask",
    "PoolingType",
    "PoolrunnerError",
    "InputTooLongError",
    "PromptTooLongError",
    "RequestOption",
    "RequestState",
    "RequestOutput",
    "RerankResult",
    "Runtime",
    "RuntimeConfig",
    "SequenceHead",
    "StModule",
    "UnsupportedAttentionError",
    "UnsupportedTaskError",
    "build_plugin_manager",
    "check_dimensions",
    "classifier_activation",
    "hookimpl",
    "load_weights",
    "read_modules",
    "sequence_classifier_head",
    "token_classifier_head",
]
