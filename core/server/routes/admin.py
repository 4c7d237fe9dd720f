"""The server's own routes: ``GET /health``, ``GET /metrics`` (Prometheus), OpenAI's
``GET /v1/models`` and ``/v1/models/{id}``, ``POST /tokenize`` (vLLM's or TEI's body) and vLLM's
``/detokenize``."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from poolrunner.core.server import protocol as p
from poolrunner.core.server.errors import SHARED_WITH_TEI, ApiError, in_tei_shape
from poolrunner.core.server.middleware import HEALTH_PATHS
from poolrunner.core.server.routes.dependencies import Created, Metrics, Served
from poolrunner.core.server.service import PoolingService
from poolrunner.core.server.tei import named, tei_tokens

router = APIRouter()


@router.get("/v1/models", response_model=p.ModelList)
async def models(served: Served, created: Created) -> p.ModelList:
    """Every served name of every model (vLLM lists each alias), each model's reported one first,
    then each LoRA adapter with its ``parent`` (vLLM's listing)."""
    cards = [_card(service, name, created) for service in served.services for name in service.model_names]
    cards += [_adapter_card(service, name, created) for name, service in served.adapters()]
    return p.ModelList(data=cards)


@router.get("/v1/models/{model_id:path}", response_model=p.ModelCard)
async def model(model_id: str, served: Served, created: Created) -> p.ModelCard:
    """OpenAI's retrieve: the card of a served name or a loaded LoRA adapter; 404 for any other id."""
    service = served.pick(model_id)
    if model_id in dict(served.adapters()):
        return _adapter_card(service, model_id, created)
    return _card(service, model_id, created)


@router.post("/tokenize", response_model=p.TokenizeResponse | list[list[p.TeiToken]], responses=SHARED_WITH_TEI)
async def tokenize(body: p.TokenizeRequest, request: Request,
                   served: Served) -> p.TokenizeResponse | list[list[p.TeiToken]]:
    """vLLM's tokenize (``prompt``: the ``prompt_token_ids``, special tokens included unless
    ``add_special_tokens`` is false), or TEI's (``inputs``: each text's tokens with their spans)."""
    if body.api() == "tei":
        # once the body is TEI's, errors are TEI's too, and an unknown model is ignored (tei.named)
        return await in_tei_shape(request, tei_tokens(named(served, body.model), body, request))
    return await _vllm_tokens(served.pick(body.model), body, request)  # token_strs null unless asked, as vLLM answers


@router.post("/detokenize", response_model=p.DetokenizeResponse)
async def detokenize(body: p.DetokenizeRequest, served: Served) -> p.DetokenizeResponse:
    """vLLM's detokenize: ``tokens`` decoded as the tokenizer decodes them (special tokens kept)."""
    service = served.pick(body.model)
    return p.DetokenizeResponse(prompt=await run_in_threadpool(service.frontend.detokenize, body.tokens))


@router.head("/health", include_in_schema=False)  # load balancers probe with either method
@router.get("/health")
async def health(served: Served) -> JSONResponse:
    """200 while serving; 503 once the engine loop stopped (and, from the middleware, while
    draining). ``unix``: the server's clock, as infinity's ``/health`` answers. Also at ``GET /``
    and ``GET /ping``, TEI's and SageMaker's health checks."""
    alive = served.alive
    return JSONResponse({"status": "ok" if alive else "engine loop stopped", "unix": time.time()},
                        status_code=200 if alive else 503)


for path in sorted(HEALTH_PATHS - {"/health"}):  # the middleware leaves them open for GET and HEAD
    router.add_api_route(path, health, methods=["GET", "HEAD"], include_in_schema=False)


@router.get("/metrics")
async def prometheus(metrics: Metrics) -> Response:
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _card(service: PoolingService, name: str, created: int) -> p.ModelCard:
    runtime = service.runtime
    return p.ModelCard(id=name, created=created, task=runtime.task, max_model_len=runtime.model_config.max_model_len)


def _adapter_card(service: PoolingService, name: str, created: int) -> p.ModelCard:
    """vLLM's card of a LoRA adapter, with its base model as ``parent``; ``root`` is its name, not
    vLLM's folder path: no answer shows the server's paths."""
    return _card(service, name, created).model_copy(update={"root": name, "parent": service.model_name})


async def _vllm_tokens(service: PoolingService, body: p.TokenizeRequest, request: Request) -> p.TokenizeResponse:
    """vLLM's tokenize answer for ``body.prompt`` or ``body.messages``: ids, and each token's
    string when asked.

    :raises ApiError: 400 for messages that make an image (a text-image model's chat), or a text
        over ``max_input_chars``. A prompt longer than the model takes is answered whole, as
        vLLM's: ``count`` beside ``max_model_len``.
    """
    chat = None
    if body.messages is not None:
        prompt, add_special_tokens = await service.chat_prompt(body)
        if not isinstance(prompt, str):
            raise ApiError(400, "messages make an image here: /tokenize tokenizes text", param="messages")
        chat = prompt, add_special_tokens
    tokenize = body.to_request(chat)
    [tokens] = await service.tokens(request, tokenize, "prompt" if chat is None else "messages")
    ids = [token.id for token in tokens] if tokenize.with_tokens else tokens
    return p.TokenizeResponse(count=len(ids), max_model_len=service.runtime.model_config.max_model_len, tokens=ids,
                              token_strs=[token.token for token in tokens] if tokenize.with_tokens else None)
