"""Scoring and reranking: vLLM's ``POST /score`` and ``/v1/score`` (its four body forms), and
``/rerank``, ``/v1/rerank``, ``/v2/rerank`` (vLLM's, Jina's, Cohere's v1/v2, TEI's and infinity's
bodies). Every body carries the plugins' request options as fields (BGE-M3's weights), so
these routes are added per app (:mod:`.dependencies`)."""

from __future__ import annotations

import math
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from poolrunner.core.server import infinity_protocol as i
from poolrunner.core.server import protocol as p
from poolrunner.core.server.errors import SHARED_WITH_TEI, in_tei_shape
from poolrunner.core.server.routes import infinity
from poolrunner.core.server.routes.answers import answer_id, usage
from poolrunner.core.server.routes.dependencies import OptionBodies, Served, with_body
from poolrunner.core.server.service import PoolingService
from poolrunner.core.server.tei import tei_rerank

RERANK_PATHS = (("/rerank", None), ("/v1/rerank", "1"), ("/v2/rerank", "2"))
"""Each rerank path and the Cohere API version its answers' ``meta`` names (none: vLLM's, no ``meta``)."""


async def score(body: p.ScoreRequest, request: Request, served: Served) -> p.ScoreResponse:
    """vLLM's score: the first side against the second (1:1, 1:N or N:N), one score per pair in
    pair order; the body is ``queries``/``documents``, ``queries``/``items``, ``data_1``/``data_2``
    or ``text_1``/``text_2``. The plugins' request options (BGE-M3's weights) are body fields."""
    service = served.pick(body.model, "score")
    scores, num_tokens = await service.answer(request, body.to_request(), priority=body.priority)
    data = [p.ScoreData(index=i, score=float(s)) for i, s in enumerate(scores)]
    return p.ScoreResponse(id=answer_id("score", body.request_id), created=int(time.time()),
                           model=service.answered_name, data=data, usage=usage(num_tokens))


async def rerank(body: p.RerankRequest, request: Request, served: Served,
                 version: str | None) -> p.RerankResponse | list[p.TeiRank] | Response:
    """Documents best first by relevance to ``query`` (ties keep input order), as vLLM, Jina
    and Cohere answer; TEI's body (``query``, ``texts``) gets TEI's list of ``{index, score, text?}``,
    infinity's (``documents`` with ``raw_scores``) infinity's answer. The plugins' request options
    (BGE-M3's weights) are body fields."""
    api = body.api()
    if api == "tei":  # TEI's errors too, and its model rule (tei.named)
        return await in_tei_shape(request, tei_rerank(served, body, request))
    service = served.pick(body.model, "score")
    if api == "infinity":  # a Response: no other union member may take its fields; `document: null` kept
        return JSONResponse((await infinity.rerank(service, body, request)).model_dump())
    return await _rerank(service, body, request, version)


def option_routes(bodies: OptionBodies) -> APIRouter:
    """Every scoring route, its body the app's (a field per plugin request option)."""
    router = APIRouter()
    for path in ("/score", "/v1/score"):  # vLLM serves both
        router.add_api_route(path, with_body(score, bodies.score), methods=["POST"], response_model=p.ScoreResponse)
    for path, version in RERANK_PATHS:
        router.add_api_route(path, with_body(rerank, bodies.rerank, version=version), methods=["POST"],
                             response_model=p.RerankResponse | list[p.TeiRank] | i.InfinityRerankResponse,
                             response_model_exclude_none=True, responses=SHARED_WITH_TEI)
    return router


async def _rerank(service: PoolingService, body: p.RerankRequest, request: Request,
                  version: str | None) -> p.RerankResponse:
    """vLLM's, Jina's and Cohere's rerank; ``meta`` only for a Cohere ``version``."""
    documents = body.document_list()
    ranked, num_tokens = await service.answer(request, body.to_request(documents), priority=body.priority)
    results = [p.RerankData(index=r.index, relevance_score=r.score,
                            document=_document(documents[r.index]) if r.document is not None else None)
               for r in ranked]
    meta = None
    if version is not None:  # Cohere bills one search unit per (up to) 100 documents
        meta = p.RerankMeta(api_version=p.ApiVersion(version=version),
                            billed_units=p.BilledUnits(search_units=max(1, math.ceil(len(documents) / 100))))
    return p.RerankResponse(id=answer_id("rerank", body.request_id), model=service.answered_name,
                            usage=usage(num_tokens), results=results, meta=meta)


def _document(document: str | p.RerankDocumentInput) -> p.RerankDocument:
    """A result's document as sent: the text, and a Cohere v1 object's other fields too."""
    if isinstance(document, str):
        return p.RerankDocument(text=document)
    return p.RerankDocument(**document.model_dump())
