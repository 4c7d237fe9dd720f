"""Built-in plugin: sequence pooling (CLS, MEAN, LAST) for the ``embed`` task."""

from __future__ import annotations

from poolrunner.core import ModelConfig, PoolingTask, hookimpl

from .pooler import EmbeddingPooler

TASKS: frozenset[PoolingTask] = frozenset({"embed"})


@hookimpl
def supported_tasks() -> frozenset[PoolingTask]:
    return TASKS


@hookimpl(trylast=True)  # a built-in default: any third-party pooler wins
def get_pooler(model_config: ModelConfig, task: PoolingTask) -> EmbeddingPooler | None:
    if task != "embed":
        return None
    return EmbeddingPooler.from_model_config(model_config)
