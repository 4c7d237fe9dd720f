"""poolrunner plugin: ColBERT late interaction.

Serves ``token_embed`` for ColBERT model folders (a PyLate ``modules.json`` naming
``pylate.models.Dense.Dense``, or a Stanford ColBERT checkpoint with architecture
``HF_ColBERT``; the plugin claims both, so they are served by it alone): every token's hidden
state through the model's linear projection, L2-normalized. ``Runtime.score`` and ``rerank``
score pairs with MaxSim. Every other model is left to the built-ins.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from poolrunner.core import ModelConfig, PoolingTask, hookimpl, read_modules

if TYPE_CHECKING:  # import-cheap: torch loads with the pooler, never at plugin import
    import torch

    from poolrunner.core import RequestOutput

    from .pooler import ColbertPooler

__version__ = "0.1.0"
NAME = "colbert"
TASK: PoolingTask = "token_embed"


# Stanford ColBERT (colbert-ai) saves its checkpoints under this architecture name.
_COLBERT_ARCHITECTURE = "HF_ColBERT"


@hookimpl
def claim_model_folder(folder: Path, architecture: str) -> str | None:
    """PyLate folders and Stanford ColBERT checkpoints are ours alone."""
    pylate = next((module.type for module in read_modules(folder) if module.type.startswith("pylate.")), None)
    if pylate is not None:
        return f"modules.json lists {pylate}"
    if architecture == _COLBERT_ARCHITECTURE:
        return f"config.json names the architecture {architecture}"
    return None


def serves(model_config: ModelConfig) -> bool:
    """A folder this plugin claimed (see ``ModelConfig.required_plugin``)."""
    return model_config.required_plugin is not None and model_config.required_plugin.name == NAME


@hookimpl
def supported_tasks(model_config: ModelConfig) -> frozenset[PoolingTask]:
    return frozenset({TASK}) if serves(model_config) else frozenset()


@hookimpl
def get_pooler(model_config: ModelConfig, task: PoolingTask) -> ColbertPooler | None:
    if task != TASK or not serves(model_config):
        return None  # not a ColBERT folder: the built-in token_pooling keeps serving token_embed
    from .pooler import ColbertPooler

    return ColbertPooler.from_model_config(model_config)


@hookimpl
def score_outputs(
    model_config: ModelConfig, task: PoolingTask, queries: Sequence[RequestOutput], documents: Sequence[RequestOutput]
) -> torch.Tensor | None:
    if task != TASK or not serves(model_config):
        return None
    from .scoring import maxsim

    return maxsim(queries, documents)
