"""What a model can do, judged from its head, and which task it gets by default."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from poolrunner.core.types import TASK_PREFERENCE, PoolingTask

# BGE-M3's folder layout: a Linear(hidden, 1) that weighs each token (its sparse head).
TOKEN_WEIGHT_HEAD_FILE = "sparse_linear.pt"


def token_weight_head(folder: Path) -> Path | None:
    path = folder / TOKEN_WEIGHT_HEAD_FILE
    return path if path.is_file() else None


def model_tasks(architecture: str, folder: Path) -> frozenset[PoolingTask]:
    """Tasks the model's own head can produce, whatever plugins are installed.

    A classification head yields labels (per sequence or per token); any other model
    (a bare backbone, a causal or masked LM) yields hidden states to embed, and with a
    BGE-M3 token-weight head (``sparse_linear.pt``) also ``token_classify`` (its weights) and
    ``embed&token_classify``, as vLLM's ``BgeM3EmbeddingModel`` serves them.
    """
    if architecture.endswith("ForSequenceClassification"):
        return frozenset({"classify"})
    if architecture.endswith("ForTokenClassification"):
        return frozenset({"token_classify"})
    tasks: set[PoolingTask] = {"embed", "token_embed"}
    if token_weight_head(folder) is not None:
        tasks |= {"token_classify", "embed&token_classify"}
    return frozenset(tasks)


def default_task(architecture: str, supported: Iterable[PoolingTask]) -> PoolingTask | None:
    """vLLM's pick when the user names no task: the first supported in :data:`TASK_PREFERENCE`,
    except that a ``*ForTokenClassification`` model gets ``token_classify``; when only
    plugin-declared tasks are served, the first of them by name."""
    supported = frozenset(supported)
    if architecture.endswith("ForTokenClassification") and "token_classify" in supported:
        return "token_classify"
    return next((task for task in TASK_PREFERENCE if task in supported), min(supported, default=None))
