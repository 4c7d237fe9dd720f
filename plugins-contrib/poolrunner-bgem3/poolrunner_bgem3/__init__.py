"""poolrunner plugin: BGE-M3 in one call.

For a model folder holding BGE-M3's two heads beside its backbone (``sparse_linear.pt`` and
``colbert_linear.pt``, as FlagEmbedding saves them), serves the plugin-declared task
``m3_embed``: one forward pass returns the parts a request names in its ``outputs`` option,
among the dense vector, the sparse lexical weights already aggregated per token id (as
``{"token_ids", "weights"}``, poolrunner-splade's shape) and the ColBERT vectors.
``Runtime.score`` and ``rerank`` on an ``m3_embed`` runtime combine the parts' scores with the
weights ``dense_weight``, ``sparse_weight`` and ``colbert_weight``.

The folder is not claimed (``claim_model_folder``): without this plugin, poolrunner's built-ins
already serve such a folder's ``embed`` (the same dense vector), ``token_embed`` and
``embed&token_classify``, and they keep serving them beside ``m3_embed``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from poolrunner.core import ModelConfig, PoolingTask, RequestOption, hookimpl

from .options import OUTPUTS, TASK, WEIGHTS, score_weights

if TYPE_CHECKING:  # import-cheap: torch loads with the pooler, never at plugin import
    import torch

    from poolrunner.core import RequestOutput

    from .pooler import M3Pooler

__version__ = "0.1.0"
NAME = "bgem3"


def serves(model_config: ModelConfig) -> bool:
    """A backbone (a model that embeds) whose folder holds both BGE-M3 heads."""
    from .heads import has_heads

    return "embed" in model_config.model_tasks and has_heads(Path(model_config.path))


@hookimpl
def supported_tasks(model_config: ModelConfig) -> frozenset[PoolingTask]:
    return frozenset({TASK}) if serves(model_config) else frozenset()


@hookimpl
def request_options(model_config: ModelConfig) -> list[RequestOption]:
    return [OUTPUTS, *WEIGHTS] if serves(model_config) else []


@hookimpl
def get_pooler(model_config: ModelConfig, task: PoolingTask) -> M3Pooler | None:
    if task != TASK or not serves(model_config):
        return None  # not ours: the built-ins keep serving embed, token_embed, embed&token_classify
    from .pooler import M3Pooler

    return M3Pooler.from_model_config(model_config)


@hookimpl
def score_outputs(
    model_config: ModelConfig, task: PoolingTask, queries: Sequence[RequestOutput],
    documents: Sequence[RequestOutput], options: Mapping[str, Any],
) -> torch.Tensor | None:
    if task != TASK or not serves(model_config):
        return None
    from .scoring import combined_scores

    return combined_scores(queries, documents, score_weights(options))  # type: ignore[arg-type]
