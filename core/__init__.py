"""poolrunner's core: the plugin system, the engine and the public API plugins build on.

Plugins import only from here (an import-linter contract checks it).
"""

import os

# No code path may reach a model hub: every model is a local folder.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from poolrunner.core.config import ModelOverrides, RuntimeConfig  # noqa: E402
from poolrunner.core.engine.batch import InputBatch  # noqa: E402
from poolrunner.core.engine.request import RequestState  # noqa: E402
from poolrunner.core.errors import (  # noqa: E402
    InvalidRequestError,
    ModelLoadError,
    PluginConflictError,
    PluginLoadError,
    PoolrunnerError,
    UnsupportedTaskError,
)
from poolrunner.core.hookspec import hookimpl  # noqa: E402
from poolrunner.core.manager import ENTRY_POINT_GROUP, build_plugin_manager  # noqa: E402
from poolrunner.core.output import OutputHandle  # noqa: E402
from poolrunner.core.pooler import Pooler, PoolerOutput  # noqa: E402
from poolrunner.core.runtime import Runtime  # noqa: E402
from poolrunner.core.types import (  # noqa: E402
    POOLING_TASKS,
    DenseLayerSpec,
    ModelConfig,
    PluginInfo,
    PoolingMetadata,
    PoolingParams,
    PoolingRequest,
    PoolingTask,
    PoolingType,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "POOLING_TASKS",
    "DenseLayerSpec",
    "InputBatch",
    "InvalidRequestError",
    "ModelConfig",
    "ModelLoadError",
    "ModelOverrides",
    "OutputHandle",
    "PluginConflictError",
    "PluginInfo",
    "PluginLoadError",
    "Pooler",
    "PoolerOutput",
    "PoolingMetadata",
    "PoolingParams",
    "PoolingRequest",
    "PoolingTask",
    "PoolingType",
    "PoolrunnerError",
    "RequestState",
    "Runtime",
    "RuntimeConfig",
    "UnsupportedTaskError",
    "build_plugin_manager",
    "hookimpl",
]
