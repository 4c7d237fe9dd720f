"""infinity's answers (``michaelfeil/infinity``'s ``fastapi_schemas/pymodels.py``, what
``infinity_client`` parses), for its bodies on the routes it shares with vLLM.

infinity's bodies are the shared routes' own (:mod:`.protocol`): its embeddings body is OpenAI's
with ``modality`` (the answer is OpenAI's too), its rerank body is ``documents`` with
``raw_scores``, its classify body ``input`` with ``raw_scores`` (its client always sends both
fields); ``model`` defaults to :data:`~poolrunner.core.server.models.UNSPECIFIED_MODEL`, which a
server answers as a request without ``model``. infinity's own ``GET /models`` answers
:class:`InfinityModelList`.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

from poolrunner.core.server.protocol import Usage


class InfinityRank(BaseModel):
    """One rerank result; ``document`` (the text) only with ``return_documents``."""

    relevance_score: float
    index: int
    document: str | None = None


class InfinityRerankResponse(BaseModel):
    """infinity's rerank answer: the results best first (at most ``top_n``)."""

    object: Literal["rerank"] = "rerank"
    results: list[InfinityRank]
    model: str
    usage: Usage
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))


class InfinityLabel(BaseModel):
    score: float
    label: str


class InfinityClassifyResponse(BaseModel):
    """infinity's classify answer: per input, every label's score, best first."""

    object: Literal["classify"] = "classify"
    data: list[list[InfinityLabel]]
    model: str
    usage: Usage
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))


Capability = Literal["embed", "rerank", "classify", "image_embed"]
"""infinity's names for what a model does (``ModelCapabilites``; poolrunner serves no audio)."""


class InfinityStats(BaseModel):
    """A model's queue now: inputs waiting for the engine, and queued or running."""

    queue_absolute: int
    results_pending: int
    queue_fraction: float = Field(description="queue_absolute over the server's --max-waiting-requests.")


class InfinityModel(BaseModel):
    """One served model as infinity lists it (its ``owned_by`` is always ``infinity``, so it is
    left out; ``backend`` is the framework the model runs on)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    backend: str = "torch"
    capabilities: list[Capability]
    stats: InfinityStats


class InfinityModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[InfinityModel]
