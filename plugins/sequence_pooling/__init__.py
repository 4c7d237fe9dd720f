"""Built-in plugin: sequence pooling for ``embed`` (CLS, MEAN, LAST, MAX, WEIGHTEDMEAN,
MEAN_SQRT_LEN) and the model's own head for ``classify``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from poolrunner.core import PoolingTask, hookimpl

if TYPE_CHECKING:  # the poolers (and torch) load with a model, not with `poolrunner plugins`
    from torch import nn

    from poolrunner.core import ModelConfig, Pooler

TASKS: frozenset[PoolingTask] = frozenset({"embed", "classify"})


@hookimpl
def supported_tasks() -> frozenset[PoolingTask]:
    return TASKS


@hookimpl(trylast=True)  # a built-in default: any third-party pooler wins
def get_pooler(model_config: ModelConfig, task: PoolingTask, model: nn.Module) -> Pooler | None:
    if task == "embed":
        from .embed import EmbeddingPooler

        return EmbeddingPooler.from_model_config(model_config)
    if task == "classify":
        from .classify import ClassifierPooler

        return ClassifierPooler(model_config, model)
    return None
