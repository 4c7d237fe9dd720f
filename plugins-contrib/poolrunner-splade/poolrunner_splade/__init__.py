"""poolrunner plugin: SPLADE sparse embeddings from a masked-LM head.

Serves the plugin-declared task ``sparse_embed`` for ``*ForMaskedLM`` models and scores pairs of
its outputs with a sparse dot product (``Runtime.score``, ``Runtime.rerank``). The request
option ``top_k`` keeps only the ``k`` largest weights (sentence-transformers' ``max_active_dims``). A
sentence-transformers ``SparseEncoder`` folder (``modules.json`` with ``MLMTransformer`` /
``SpladePooling``) is served by this plugin alone, with ``sparse_embed`` as its default task, its
``similarity_fn_name`` (dot or cosine) and ``max_active_dims`` as sentence-transformers reads them
(core applies its prompts and its Transformer's ``max_seq_length`` and ``do_lower_case``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from poolrunner.core import ModelConfig, PoolingTask, RequestOption, hookimpl, read_modules

if TYPE_CHECKING:  # import-cheap: torch loads with the pooler, never at plugin import
    import torch
    from torch import nn

    from poolrunner.core import RequestOutput

    from .pooler import SpladePooler

__version__ = "0.1.0"
NAME = "splade"
TASK: PoolingTask = "sparse_embed"


# sentence-transformers SparseEncoder modules (class names) that make a folder a SPLADE pipeline.
_SPARSE_ENCODER_MODULES = frozenset({"MLMTransformer", "SpladePooling"})


@hookimpl
def claim_model_folder(folder: Path) -> str | None:
    """A sentence-transformers ``SparseEncoder`` folder is ours alone."""
    for module in read_modules(folder):
        package, _, name = module.type.rpartition(".")
        if package.startswith("sentence_transformers") and name in _SPARSE_ENCODER_MODULES:
            return f"modules.json lists {module.type}"
    return None


def serves(model_config: ModelConfig) -> bool:
    """A masked-LM model: SPLADE needs the MLM logits over the vocabulary."""
    return model_config.architecture.endswith("ForMaskedLM")


@hookimpl
def supported_tasks(model_config: ModelConfig) -> frozenset[PoolingTask]:
    return frozenset({TASK}) if serves(model_config) else frozenset()


def _at_least_one(value: int) -> str | None:
    return None if value >= 1 else "must be at least 1"


TOP_K = RequestOption(
    name="top_k", type=int, tasks={TASK}, check=_at_least_one,
    help="Keep only the k largest sparse weights (sentence-transformers' max_active_dims); all when unset.",
)


@hookimpl
def request_options(model_config: ModelConfig) -> list[RequestOption]:
    return [TOP_K] if serves(model_config) else []


@hookimpl
def get_pooler(model_config: ModelConfig, task: PoolingTask, model: nn.Module) -> SpladePooler | None:
    if task != TASK or not serves(model_config):
        return None  # not ours: the built-ins keep serving embed, token_embed...
    from .pooler import SpladePooler

    return SpladePooler.from_model(model_config, model)


@hookimpl
def score_outputs(
    model_config: ModelConfig, task: PoolingTask, queries: Sequence[RequestOutput], documents: Sequence[RequestOutput]
) -> torch.Tensor | None:
    if task != TASK:
        return None
    from .pooler import encoder_settings
    from .scoring import sparse_similarity

    return sparse_similarity(queries, documents, encoder_settings(model_config)[0])
