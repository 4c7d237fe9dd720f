"""Built-in plugin: sequence pooling for ``embed`` (CLS, MEAN, LAST, MAX, WEIGHTEDMEAN,
MEAN_SQRT_LEN) and the model's own head for ``classify``."""

from __future__ import annotations

from torch import nn

from poolrunner.core import ModelConfig, Pooler, PoolingTask, hookimpl

from .classify import ClassifierPooler
from .embed import EmbeddingPooler

TASKS: frozenset[PoolingTask] = frozenset({"embed", "classify"})


@hookimpl
def supported_tasks() -> frozenset[PoolingTask]:
    return TASKS


@hookimpl(trylast=True)  # a built-in default: any third-party pooler wins
def get_pooler(model_config: ModelConfig, task: PoolingTask, model: nn.Module) -> Pooler | None:
    if task == "embed":
        return EmbeddingPooler.from_model_config(model_config)
    if task == "classify":
        return ClassifierPooler(model_config, model)
    return None
