"""The FastAPI app: ``create_app(runtime, settings)`` serves one :class:`Runtime` over HTTP.

Endpoints: ``POST /v1/embeddings`` (OpenAI), ``GET /v1/models``, ``POST /classify``, ``/score``,
``/rerank``, ``/pooling``, ``/tokenize`` (vLLM's shapes), ``GET /health``, ``GET /metrics``
(Prometheus); FastAPI serves the OpenAPI page at ``/docs``. While the app runs, the runtime
serves (:meth:`Runtime.serving`): one engine loop batches all clients' requests together, and
the runtime's own Python API goes through the same loop meanwhile.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from poolrunner.core.runtime import Runtime
from poolrunner.core.server import protocol as p
from poolrunner.core.server.errors import install_handlers
from poolrunner.core.server.metrics import ServerMetrics
from poolrunner.core.server.middleware import GuardMiddleware, ServerState
from poolrunner.core.server.service import PoolingService, encode_array
from poolrunner.core.server.settings import ServerSettings
from poolrunner.core.server.tei import add_tei_routes

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"



def create_app(runtime: Runtime, settings: ServerSettings | None = None) -> FastAPI:
    """An app serving ``runtime``; its engine loop runs from the app's startup to its shutdown.

    ``app.state.server`` is the :class:`ServerState` (set ``draining`` to refuse new requests
    with 503); ``app.state.service.serving`` the runtime's serving loop while the app runs.
    """
    settings = settings or ServerSettings()
    metrics = ServerMetrics()
    state = ServerState()
    model_name = settings.served_model_name or default_model_name(runtime)
    service = PoolingService(runtime, settings, metrics, model_name)
    metrics.pending.set_function(lambda: service.pending)
    metrics.in_flight.set_function(lambda: state.in_flight)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        with runtime.serving(max_pending=settings.max_waiting_requests, observer=metrics) as serving:
            service.serving = serving
            try:
                yield
            finally:
                service.serving = None

    app = FastAPI(title="poolrunner", summary="Pooling models over HTTP (OpenAI and vLLM shapes)",
                  lifespan=lifespan)
    app.state.server = state
    app.state.service = service
    app.state.metrics = metrics
    install_handlers(app)
    _add_routes(app, service, int(time.time()))
    add_tei_routes(app, service)
    endpoints = frozenset(route.path for route in app.routes)  # metrics label every other path "other"
    app.add_middleware(GuardMiddleware, state=state, metrics=metrics, api_key=settings.api_key,
                       max_request_bytes=settings.max_request_bytes, endpoints=endpoints)
    return app


def default_model_name(runtime: Runtime) -> str:
    """The model folder's name; ``all-MiniLM-L6-v2`` for the model shipped with poolrunner."""
    if runtime.config.model is None:
        return DEFAULT_MODEL_NAME
    return Path(runtime.config.model).resolve().name


def _usage(num_tokens: int) -> p.Usage:
    return p.Usage(prompt_tokens=num_tokens, total_tokens=num_tokens)


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _add_routes(app: FastAPI, service: PoolingService, created: int) -> None:  # noqa: C901 (one route each)
    runtime = service.runtime

    @app.post("/v1/embeddings", response_model=p.EmbeddingResponse)
    async def embeddings(body: p.EmbeddingRequest, request: Request) -> p.EmbeddingResponse:
        """OpenAI's embeddings: one vector per input, in input order."""
        service.check_model(body.model)
        items = service.inputs(body.input)
        vectors, num_tokens = await service.embed(request, items, body.dimensions, body.truncate_prompt_tokens)
        data = [p.EmbeddingData(index=i, embedding=encode_array(v, body.encoding_format))
                for i, v in enumerate(vectors)]
        return p.EmbeddingResponse(data=data, model=service.model_name, usage=_usage(num_tokens))

    @app.get("/v1/models", response_model=p.ModelList)
    async def models() -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=service.model_name, created=created, task=runtime.task,
                                             max_model_len=runtime.model_config.max_model_len)])

    option_names = [entry.option.name for entry in runtime.frontend.options]

    async def pooling(body: p.PoolingHttpRequest, request: Request) -> p.PoolingResponse:
        """Any task the model serves; per-token tasks answer one ``[num_tokens, d]`` list each.
        Each output keeps its dtype: integer outputs (SPLADE's ``token_ids``) are ints, or int64 in base64.
        The plugins' request options are body fields of their own."""
        service.check_model(body.model)
        items = service.inputs(body.input)
        core = {"dimensions": body.dimensions, "normalize": body.normalize, "use_activation": body.use_activation}
        options = {name: getattr(body, name) for name in option_names if getattr(body, name) is not None}
        outputs, num_tokens = await service.encode(request, items, body.task, core, options,
                                                   body.truncate_prompt_tokens)

        def encode(output: np.ndarray | dict[str, np.ndarray]) -> object:
            if isinstance(output, dict):
                return {name: encode_array(array, body.encoding_format) for name, array in output.items()}
            return encode_array(output, body.encoding_format)

        data = [p.PoolingData(index=i, data=encode(output)) for i, output in enumerate(outputs)]  # type: ignore[arg-type]
        return p.PoolingResponse(id=_id("pool"), created=int(time.time()), model=service.model_name, data=data,
                                 usage=_usage(num_tokens))

    # The body model has a field per plugin option, so it is built here; FastAPI reads the
    # annotation (a string under postponed evaluation) from the function, so set the class itself.
    pooling.__annotations__["body"] = p.pooling_request_model(runtime.frontend.options)
    app.post("/pooling", response_model=p.PoolingResponse)(pooling)

    @app.post("/classify", response_model=p.ClassificationResponse)
    async def classify(body: p.ClassificationRequest, request: Request) -> p.ClassificationResponse:
        service.check_model(body.model)
        items = service.inputs(body.input)
        results, num_tokens = await service.classify(request, items, body.use_activation,
                                                     body.truncate_prompt_tokens)
        data = [p.ClassificationData(index=i, label=r.label, probs=r.probs.tolist(), num_classes=len(r.probs))
                for i, r in enumerate(results)]
        return p.ClassificationResponse(id=_id("classify"), created=int(time.time()), model=service.model_name,
                                        data=data, usage=_usage(num_tokens))

    @app.post("/score", response_model=p.ScoreResponse)
    async def score(body: p.ScoreRequest, request: Request) -> p.ScoreResponse:
        """``text_1`` against ``text_2`` (1:1, 1:N or N:N): one score per pair, in pair order."""
        service.check_model(body.model)
        scores, num_tokens = await service.score(request, body.text_1, body.text_2, body.use_activation,
                                                 body.truncate_prompt_tokens)
        data = [p.ScoreData(index=i, score=float(s)) for i, s in enumerate(scores)]
        return p.ScoreResponse(id=_id("score"), created=int(time.time()), model=service.model_name, data=data,
                               usage=_usage(num_tokens))

    @app.post("/rerank", response_model=p.RerankResponse, response_model_exclude_none=True)
    async def rerank(body: p.RerankRequest, request: Request) -> p.RerankResponse:
        """Documents ranked best first by relevance to ``query`` (ties keep input order)."""
        service.check_model(body.model)
        ranked, num_tokens = await service.rerank(request, body.query, body.documents, body.top_n,
                                                  body.return_documents, body.truncate_prompt_tokens)
        results = [p.RerankData(index=r.index, relevance_score=r.score,
                                document=p.RerankDocument(text=r.document) if r.document is not None else None)
                   for r in ranked]
        return p.RerankResponse(id=_id("rerank"), model=service.model_name, usage=_usage(num_tokens),
                                results=results)

    @app.post("/tokenize", response_model=p.TokenizeResponse)
    async def tokenize(body: p.TokenizeRequest) -> p.TokenizeResponse:
        """The model's ``prompt_token_ids`` for ``prompt``, special tokens included."""
        service.check_model(body.model)
        tokens = await service.tokenize(body.prompt)
        return p.TokenizeResponse(count=len(tokens), max_model_len=runtime.model_config.max_model_len, tokens=tokens)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while serving; 503 once the engine loop stopped (and, from the middleware, while draining)."""
        if not service.alive:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)
