"""What a model can do, judged from its head, and which task it gets by default."""

from __future__ import annotations

from collections.abc import Iterable

from poolrunner.core.types import TASK_PREFERENCE, PoolingTask


def model_tasks(architecture: str) -> frozenset[PoolingTask]:
    """Tasks the model's own head can produce, whatever plugins are installed.

    A classification head yields labels (per sequence or per token); any other model
    (a bare backbone, a causal or masked LM) yields hidden states to embed.
    """
    if architecture.endswith("ForSequenceClassification"):
        return frozenset({"classify"})
    if architecture.endswith("ForTokenClassification"):
        return frozenset({"token_classify"})
    return frozenset({"embed", "token_embed"})


def default_task(architecture: str, supported: Iterable[PoolingTask]) -> PoolingTask | None:
    """vLLM's pick when the user names no task: the first supported in :data:`TASK_PREFERENCE`,
    except that a ``*ForTokenClassification`` model gets ``token_classify``."""
    supported = frozenset(supported)
    if architecture.endswith("ForTokenClassification") and "token_classify" in supported:
        return "token_classify"
    return next((task for task in TASK_PREFERENCE if task in supported), None)
