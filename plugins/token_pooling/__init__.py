"""Built-in plugin: token pooling (ALL, STEP) for ``token_embed``, ``token_classify`` and
``embed&token_classify``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from poolrunner.core import PoolingTask, hookimpl

if TYPE_CHECKING:  # the poolers (and torch) load with a model, not with `poolrunner plugins`
    from torch import nn

    from poolrunner.core import ModelConfig, Pooler

TASKS: frozenset[PoolingTask] = frozenset({"token_embed", "token_classify", "embed&token_classify"})


@hookimpl
def supported_tasks() -> frozenset[PoolingTask]:
    return TASKS


@hookimpl(trylast=True)  # a built-in default: any third-party pooler wins
def get_pooler(model_config: ModelConfig, task: PoolingTask, model: nn.Module) -> Pooler | None:
    from .poolers import EmbedTokenClassifyPooler, TokenClassifierPooler, TokenEmbedPooler, TokenWeightsPooler

    if task == "token_embed":
        return TokenEmbedPooler(model_config)
    if task == "token_classify" and model_config.token_classify_weights:
        return TokenWeightsPooler.from_model_config(model_config)  # BGE-M3's sparse_linear.pt
    if task == "token_classify":
        return TokenClassifierPooler(model_config, model)
    if task == "embed&token_classify":
        return EmbedTokenClassifyPooler.from_model_config(model_config)
    return None
