"""infinity's API (``michaelfeil/infinity``'s ``infinity_server.py``, what ``infinity_client``
calls): its own ``GET /models``, and the answers to its bodies on the routes it shares with vLLM
(``/embeddings``, ``/rerank``, ``/classify``), which those routes hand over once
:meth:`~poolrunner.core.server.protocol.RerankRequest.api` or
:meth:`~poolrunner.core.server.protocol.ClassificationRequest.api` tells the body is infinity's
(:mod:`poolrunner.core.server.infinity_protocol`)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from poolrunner.core.server import infinity_protocol as i
from poolrunner.core.server import protocol as p
from poolrunner.core.server.routes.answers import answer_id, usage
from poolrunner.core.server.routes.dependencies import Created, Served
from poolrunner.core.server.service import PoolingService

router = APIRouter(tags=["infinity"])


@router.get("/models", response_model=i.InfinityModelList)
async def models(served: Served, created: Created) -> i.InfinityModelList:
    """Each served model under the name its answers report, with infinity's ``capabilities``
    and ``stats`` (OpenAI's and vLLM's listing, every alias and adapter, is ``/v1/models``)."""
    limit = served.settings.max_waiting_requests
    return i.InfinityModelList(data=[
        i.InfinityModel(id=service.model_name, created=created, capabilities=capabilities(service),
                        stats=i.InfinityStats(queue_absolute=service.waiting, results_pending=service.pending,
                                              queue_fraction=service.waiting / limit))
        for service in served.services
    ])


def capabilities(service: PoolingService) -> list[i.Capability]:
    """What infinity would say the model does: ``embed`` (it embeds), ``image_embed`` (images
    too), ``classify`` (it has a label head) and ``rerank`` (a one-label head: a cross-encoder;
    poolrunner also reranks with an embedder's similarity, which infinity does not)."""
    frontend = service.frontend
    tasks = service.runtime.supported_tasks
    found: list[i.Capability] = []
    if "embed" in tasks:
        found += ["embed", "image_embed"] if frontend.images is not None else ["embed"]
    if "classify" in tasks:
        found += ["classify", "rerank"] if len(frontend.model_config.labels) == 1 else ["classify"]
    return found


async def rerank(service: PoolingService, body: p.RerankRequest, request: Request) -> i.InfinityRerankResponse:
    """infinity's rerank: the documents best first (at most ``top_n``), each with its text
    only with ``return_documents``; ``raw_scores`` answers the logits."""
    documents = body.document_list()
    ranked, num_tokens = await service.answer(request, body.to_request(documents), priority=body.priority)
    return i.InfinityRerankResponse(
        id=answer_id("rerank", body.request_id), model=service.answered_name, usage=usage(num_tokens),
        results=[i.InfinityRank(relevance_score=r.score, index=r.index, document=r.document) for r in ranked])


async def classify(service: PoolingService, body: p.ClassificationRequest,
                   request: Request) -> i.InfinityClassifyResponse:
    """infinity's classify: per input every label's score, best first (ties keep label order);
    ``raw_scores`` answers the logits (infinity itself ignores it)."""
    results, num_tokens = await service.answer_prompts(request, body)
    labels = service.frontend.model_config.labels
    data = [[i.InfinityLabel(score=float(result.probs[k]), label=labels[k])
             for k in sorted(range(len(labels)), key=lambda k: -result.probs[k])] for result in results]
    return i.InfinityClassifyResponse(id=answer_id("classify", body.request_id), model=service.answered_name,
                                      usage=usage(num_tokens), data=data)
