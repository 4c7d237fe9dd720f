"""The FastAPI app: ``create_app(models, settings)`` serves one :class:`Runtime`, or several
(:mod:`.models`), over HTTP.

Endpoints: ``POST /v1/embeddings`` and ``/embeddings`` (OpenAI), ``GET /v1/models`` and
``/v1/models/{id}``, ``POST /classify``, ``/score`` and ``/v1/score`` (vLLM's four body forms),
``/rerank``, ``/v1/rerank``, ``/v2/rerank`` (vLLM, Jina, Cohere v1/v2 bodies; TEI's on
``/rerank``), ``/pooling``, ``/tokenize`` (vLLM's or TEI's body), ``/detokenize`` (vLLM's shapes),
``GET /health``, ``GET /metrics`` (Prometheus), ``POST /invocations`` (SageMaker: vLLM's or TEI's
bodies); TEI's other routes come from :mod:`.tei`. FastAPI
serves the OpenAPI page at ``/docs`` (and ReDoc at ``/redoc``) with local assets. While the app runs,
each runtime serves (:meth:`Runtime.serving`): its engine loop batches all clients' requests for
that model together, and the runtime's own Python API goes through the same loop meanwhile.
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Annotated, Any

import numpy as np
import pydantic
from fastapi import Body, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.types import Message, Receive, Scope, Send

from poolrunner.core.runtime import Runtime
from poolrunner.core.server import protocol as p
from poolrunner.core.server.errors import ApiError, in_tei_shape, install_handlers
from poolrunner.core.server.metrics import ServerMetrics
from poolrunner.core.server.middleware import OPEN_PATHS, GuardMiddleware, ServerState
from poolrunner.core.server.models import ModelRouter, ServedModel, served_models
from poolrunner.core.server.payload import bytes_response, encode_array
from poolrunner.core.server.service import PoolingService
from poolrunner.core.server.settings import ServerSettings
from poolrunner.core.server.tei import add_tei_routes, tei_rerank, tei_tokens


def create_app(models: Runtime | Sequence[ServedModel], settings: ServerSettings | None = None) -> FastAPI:
    """An app serving ``models``: one :class:`Runtime` (under ``settings.served_model_name``,
    default its folder's name), or several :class:`ServedModel` each under its own names. Each
    runtime's engine loop runs from the app's startup to its shutdown; requests go to the model
    their ``model`` field names, or else the one that fits their route (:meth:`ModelRouter.pick`).

    ``app.state.server`` is the :class:`ServerState` (set ``draining`` to refuse new requests
    with 503); ``app.state.router`` the :class:`ModelRouter` of the models' services, whose
    ``serving`` is the runtime's serving loop while the app runs.

    :raises ValueError: as :func:`served_models` says (no model, a name two models share...).
    """
    settings = settings or ServerSettings()
    metrics = ServerMetrics()
    state = ServerState()
    served = served_models(models, settings.served_model_name)
    router = ModelRouter([PoolingService(model.runtime, settings, metrics, model.names) for model in served],
                         settings)
    metrics.pending.set_function(lambda: router.pending)
    metrics.waiting.set_function(lambda: router.waiting)
    metrics.running.set_function(lambda: max(0, router.pending - router.waiting))
    metrics.in_flight.set_function(lambda: state.in_flight)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        with contextlib.ExitStack() as stack:
            for service in router.services:
                service.serving = stack.enter_context(
                    service.runtime.serving(max_pending=settings.max_waiting_requests, observer=metrics))
                stack.callback(setattr, service, "serving", None)
            yield

    # /docs and /redoc load Swagger UI and ReDoc from files in fastapi-offline, never from a CDN.
    app = FastAPIOffline(title="poolrunner", summary="Pooling models over HTTP (OpenAI and vLLM shapes)",
                         lifespan=lifespan)
    app.state.server = state
    app.state.router = router
    app.state.metrics = metrics
    install_handlers(app)
    vllm_routes = _add_routes(app, router, metrics, int(time.time()))
    add_tei_routes(app, router)
    _add_invocations(app, vllm_routes)
    endpoints = frozenset(_paths(app.routes))  # metrics label every other path "other"
    open_paths = OPEN_PATHS if settings.protect_metrics else OPEN_PATHS | {"/metrics"}
    app.add_middleware(GuardMiddleware, state=state, metrics=metrics, api_key=settings.api_key,
                       max_request_bytes=settings.max_request_bytes, endpoints=endpoints,
                       allow_extra_fields=settings.allow_extra_fields, open_paths=open_paths)
    if settings.allowed_origins:  # added last, so outermost: preflights need no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id"])
    return app


def _paths(routes: Iterable[Any]) -> Iterator[str]:
    """Every route's path, those of included routers too (FastAPI keeps an included router as
    one entry; TEI's router has no prefix, so its paths are the routes' own)."""
    for route in routes:
        if isinstance(getattr(route, "path", None), str):
            yield route.path
        elif hasattr(route, "original_router"):
            yield from _paths(route.original_router.routes)


def _usage(num_tokens: int) -> p.Usage:
    return p.Usage(prompt_tokens=num_tokens, total_tokens=num_tokens)


def _id(prefix: str, request_id: str | None = None) -> str:
    """An answer's id: ``prefix-`` and the request's own ``request_id`` (vLLM), else a random one."""
    return f"{prefix}-{request_id or uuid.uuid4().hex}"


def _encoded(body: Any, arrays: list[np.ndarray] | list[Any]) -> list[Any]:
    """Each array as ``body.encoding_format`` asks (float or base64; ``embed_dtype``, ``endianness``)."""
    def encode(output: np.ndarray | dict[str, np.ndarray]) -> object:
        if isinstance(output, dict):
            return {name: encode_array(array, body.encoding_format, body.embed_dtype, body.endianness)
                    for name, array in output.items()}
        return encode_array(output, body.encoding_format, body.embed_dtype, body.endianness)

    return [encode(array) for array in arrays]


def _check_encoding(body: Any) -> None:
    """:raises ApiError: 400 for ``embed_dtype`` with a quantized ``precision`` (its payload is
    the integer codes)."""
    if body.precision != "float32" and "embed_dtype" in body.model_fields_set and body.embed_dtype != "float32":
        raise ApiError(400, f"embed_dtype={body.embed_dtype} applies to float embeddings; precision="
                            f"{body.precision} sends its {body.precision} codes", param="embed_dtype")


def _bytes(body: Any, service: PoolingService, arrays: list[Any], prefix: str, num_tokens: int) -> Response:
    """vLLM's ``bytes`` / ``bytes_only`` answer (:func:`bytes_response`) for ``arrays``.

    :raises ApiError: 400 for named outputs (one array per input is needed).
    """
    if any(isinstance(array, dict) for array in arrays):
        raise ApiError(400, f"encoding_format={body.encoding_format} needs one array per input; this task "
                            "answers named outputs: use float or base64", param="encoding_format")
    return bytes_response(arrays, embed_dtype=body.embed_dtype, endianness=body.endianness,
                          metadata=body.encoding_format == "bytes", response_id=_id(prefix, body.request_id),
                          created=int(time.time()), model=service.model_name, num_tokens=num_tokens,
                          precision=body.precision)


def _add_routes(app: FastAPI, router: ModelRouter, metrics: ServerMetrics,  # noqa: C901
                created: int) -> list[tuple[type[BaseModel], str]]:
    """vLLM's and OpenAI's routes (one handler each); returns ``(body model, path)`` of those
    ``/invocations`` dispatches to, in vLLM's order, the task-specific ones only where served."""

    async def embeddings(body: p.EmbeddingRequest, request: Request) -> p.EmbeddingResponse | Response:
        """OpenAI's embeddings with vLLM's fields: one vector per input (or one for ``messages``),
        in input order; ``bytes`` answers vLLM's octet-stream body with its ``metadata`` header."""
        service = router.pick(body.model, "embed")
        _check_encoding(body)
        items, add_special_tokens = await service.prompts(body)
        vectors, num_tokens = await service.embed(
            request, items, body.dimensions, body.truncate_prompt_tokens, normalize=body.normalize,
            use_activation=body.use_activation, add_special_tokens=add_special_tokens, precision=body.precision,
            ranges=body.ranges, priority=body.priority)
        if body.encoding_format in ("bytes", "bytes_only"):
            return _bytes(body, service, vectors, "embd", num_tokens)
        data = [p.EmbeddingData(index=i, embedding=e) for i, e in enumerate(_encoded(body, vectors))]
        return p.EmbeddingResponse(id=_id("embd", body.request_id), created=int(time.time()), data=data,
                                   model=service.model_name, usage=_usage(num_tokens))

    for path in ("/v1/embeddings", "/embeddings"):  # vLLM serves both
        app.post(path, response_model=p.EmbeddingResponse)(embeddings)

    def card(service: PoolingService, name: str) -> p.ModelCard:
        runtime = service.runtime
        return p.ModelCard(id=name, created=created, task=runtime.task,
                           max_model_len=runtime.model_config.max_model_len)

    @app.get("/v1/models", response_model=p.ModelList)
    async def models() -> p.ModelList:
        """Every served name of every model (vLLM lists each alias), each model's reported one first."""
        return p.ModelList(data=[card(service, name) for service in router.services for name in service.model_names])

    @app.get("/v1/models/{model_id:path}", response_model=p.ModelCard)
    async def model(model_id: str) -> p.ModelCard:
        """OpenAI's retrieve: the card of a served name; 404 for any other id."""
        return card(router.pick(model_id), model_id)

    options = _plugin_options(router)
    option_names = [entry.option.name for entry in options]

    async def pooling(body: p.PoolingHttpRequest, request: Request) -> p.PoolingResponse | Response:
        """Any task the model serves; per-token tasks answer one ``[num_tokens, d]`` list each.
        Each output keeps its dtype: integer outputs (SPLADE's ``token_ids``) are ints, or int64 in base64.
        The plugins' request options are body fields of their own."""
        service = router.pick(body.model, body.task)
        _check_encoding(body)
        items, add_special_tokens = await service.prompts(body)
        core = {"dimensions": body.dimensions, "normalize": body.normalize, "use_activation": body.use_activation}
        outputs, num_tokens = await service.encode(request, items, body.task, core,
                                                   p.plugin_options(body, option_names),
                                                   body.truncate_prompt_tokens, add_special_tokens=add_special_tokens,
                                                   precision=body.precision, ranges=body.ranges,
                                                   priority=body.priority)
        if body.encoding_format in ("bytes", "bytes_only"):
            return _bytes(body, service, outputs, "pool", num_tokens)
        data = [p.PoolingData(index=i, data=d) for i, d in enumerate(_encoded(body, outputs))]
        return p.PoolingResponse(id=_id("pool", body.request_id), created=int(time.time()), model=service.model_name,
                                 data=data, usage=_usage(num_tokens))

    # The body model has a field per plugin option, so it is built here; FastAPI reads the
    # annotation (a string under postponed evaluation) from the function, so set the class itself.
    pooling.__annotations__["body"] = p.with_plugin_options(p.PoolingHttpRequest, options)
    app.post("/pooling", response_model=p.PoolingResponse)(pooling)

    @app.post("/classify", response_model=p.ClassificationResponse)
    async def classify(body: p.ClassificationRequest, request: Request) -> p.ClassificationResponse:
        """vLLM's classify: texts, token ids, ``[text, text_pair]`` pairs or a chat (``messages``)."""
        service = router.pick(body.model, "classify")
        items, add_special_tokens = await service.prompts(body)
        results, num_tokens = await service.classify(request, items, body.use_activation,
                                                     body.truncate_prompt_tokens, add_special_tokens=add_special_tokens,
                                                     priority=body.priority)
        data = [p.ClassificationData(index=i, label=r.label, probs=r.probs.tolist(), num_classes=len(r.probs))
                for i, r in enumerate(results)]
        return p.ClassificationResponse(id=_id("classify", body.request_id), created=int(time.time()),
                                        model=service.model_name, data=data, usage=_usage(num_tokens))

    async def score(body: p.ScoreRequest, request: Request) -> p.ScoreResponse:
        """vLLM's score: the first side against the second (1:1, 1:N or N:N), one score per pair in
        pair order; the body is ``queries``/``documents``, ``queries``/``items``, ``data_1``/``data_2``
        or ``text_1``/``text_2``. The plugins' request options (BGE-M3's weights) are body fields."""
        service = router.pick(body.model, "score")
        form, first, second = body.sides()
        scores, num_tokens = await service.score(request, first, second, body.use_activation,
                                                 body.truncate_prompt_tokens, priority=body.priority, names=form,
                                                 options=p.plugin_options(body, option_names))
        data = [p.ScoreData(index=i, score=float(s)) for i, s in enumerate(scores)]
        return p.ScoreResponse(id=_id("score", body.request_id), created=int(time.time()), model=service.model_name,
                               data=data, usage=_usage(num_tokens))

    score.__annotations__["body"] = score_body = p.with_plugin_options(p.ScoreRequest, options)
    for path in ("/score", "/v1/score"):  # vLLM serves both
        app.post(path, response_model=p.ScoreResponse)(score)

    rerank_body = p.with_plugin_options(p.RerankRequest, options)
    for path, version in (("/rerank", None), ("/v1/rerank", "1"), ("/v2/rerank", "2")):
        app.post(path, response_model=p.RerankResponse | list[p.TeiRank],
                 response_model_exclude_none=True)(_rerank_route(router, version, rerank_body, option_names))

    @app.post("/tokenize", response_model=p.TokenizeResponse | list[list[p.TeiToken]])
    async def tokenize(body: p.TokenizeRequest, request: Request) -> JSONResponse | list[list[p.TeiToken]]:
        """vLLM's tokenize (``prompt``: the ``prompt_token_ids``, special tokens included unless
        ``add_special_tokens`` is false), or TEI's (``inputs``: each text's tokens with their spans)."""
        service = router.pick(body.model)
        if body.api() == "tei":
            # once the body is TEI's, errors are TEI's too
            return await in_tei_shape(request, tei_tokens(service, body.inputs,  # type: ignore[arg-type]
                                                          body.add_special_tokens))
        # TEI's null spans stay; vLLM's answer has token_strs only when asked
        return JSONResponse((await _vllm_tokens(service, body)).model_dump(exclude_none=True))

    @app.post("/detokenize", response_model=p.DetokenizeResponse)
    async def detokenize(body: p.DetokenizeRequest) -> p.DetokenizeResponse:
        """vLLM's detokenize: ``tokens`` decoded as the tokenizer decodes them (special tokens kept)."""
        service = router.pick(body.model)
        return p.DetokenizeResponse(prompt=await service.detokenize(body.tokens))

    @app.head("/health", include_in_schema=False)  # load balancers probe with either method
    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while serving; 503 once the engine loop stopped (and, from the middleware, while draining)."""
        if not router.alive:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    tasks = frozenset().union(*(service.runtime.supported_tasks for service in router.services))
    return [
        *([(p.EmbeddingRequest, "/v1/embeddings")] if "embed" in tasks else []),
        *([(p.ClassificationRequest, "/classify")] if "classify" in tasks else []),
        (score_body, "/score"), (rerank_body, "/rerank"), (pooling.__annotations__["body"], "/pooling"),
    ]


def _add_invocations(app: FastAPI, vllm_routes: list[tuple[type[BaseModel], str]]) -> None:
    """SageMaker's ``POST /invocations``, which vLLM and TEI both serve: a TEI body (``inputs``)
    is answered by TEI's ``POST /``, any other by the first of ``vllm_routes`` whose body it is,
    as vLLM dispatches it (request bodies refuse unknown fields, so one form fits). The route
    itself answers (:class:`_Forwarded`): its status, headers, response model and error shape.

    :raises ApiError: 400 for a body of none of these routes.
    """
    routes = {route.path: route for route in app.router.routes
              if isinstance(route, APIRoute) and "POST" in route.methods}

    @app.post("/invocations")
    async def invocations(request: Request, body: Annotated[dict[str, Any], Body()]) -> Response:
        path = "/" if "inputs" in body else next((path for model, path in vllm_routes if _fits(model, body)), None)
        if path is None:
            names = ", ".join(model.__name__ for model, _ in vllm_routes)
            raise ApiError(400, f"/invocations takes the body of one of {names}, or TEI's (inputs); this body is "
                                "none of them")
        return _Forwarded(routes[path], await request.body())


def _fits(model: type[BaseModel], body: dict[str, Any]) -> bool:
    try:
        model.model_validate(body)
    except pydantic.ValidationError:
        return False
    return True


class _Forwarded(Response):
    """The answer ``route`` gives to the request with ``body`` (already read), as if it had been
    sent there: the route reads the body again, and the client's disconnect after it."""

    def __init__(self, route: APIRoute, body: bytes) -> None:
        super().__init__()
        self.route, self.request_body = route, body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": self.request_body, "more_body": False}

        await self.route.handle(dict(scope), replay, send)


def _plugin_options(router: ModelRouter) -> list[Any]:
    """The plugins' request options of every served model, each name once (``/pooling``'s body
    has a field per option; the model a request goes to checks the ones it is given)."""
    by_name = {entry.option.name: entry for service in router.services for entry in service.frontend.options}
    return list(by_name.values())


def _rerank_route(router: ModelRouter, version: str | None, body_model: type[p.RerankRequest],
                  option_names: list[str]) -> Any:
    """The handler of one rerank path: Cohere's ``meta`` with API ``version`` ("1", "2") or
    none (``/rerank``, as vLLM); a TEI body (``texts``) is answered in TEI's shape. ``body_model``
    is :class:`~.protocol.RerankRequest` with the plugins' request options, named ``option_names``."""

    async def rerank(body: p.RerankRequest, request: Request) -> p.RerankResponse | list[p.TeiRank] | Response:
        """Documents best first by relevance to ``query`` (ties keep input order), as vLLM, Jina
        and Cohere answer; TEI's body (``query``, ``texts``) gets TEI's list of ``{index, score, text?}``.
        The plugins' request options (BGE-M3's weights) are body fields."""
        service = router.pick(body.model, "score")
        if body.api() == "tei":
            return await in_tei_shape(request, tei_rerank(service, body, request))  # TEI's errors too
        return await _rerank(service, body, request, version, p.plugin_options(body, option_names))

    rerank.__annotations__["body"] = body_model  # FastAPI reads the body's fields from the annotation
    return rerank


async def _rerank(service: PoolingService, body: p.RerankRequest, request: Request,
                  version: str | None, options: dict[str, Any]) -> p.RerankResponse:
    """vLLM's, Jina's and Cohere's rerank; ``meta`` only for a Cohere ``version``."""
    documents = body.document_list()
    texts = [d if isinstance(d, str) else d.text for d in documents]
    ranked, num_tokens = await service.rerank(request, body.query, texts, body.top_n, bool(body.return_documents),
                                              body.truncate_prompt_tokens, body.max_tokens_per_doc,
                                              priority=body.priority, options=options)
    results = [p.RerankData(index=r.index, relevance_score=r.score,
                            document=_document(documents[r.index]) if r.document is not None else None)
               for r in ranked]
    meta = None
    if version is not None:  # Cohere bills one search unit per (up to) 100 documents
        meta = p.RerankMeta(api_version=p.ApiVersion(version=version),
                            billed_units=p.BilledUnits(search_units=max(1, math.ceil(len(documents) / 100))))
    return p.RerankResponse(id=_id("rerank", body.request_id), model=service.model_name, usage=_usage(num_tokens),
                            results=results, meta=meta)


def _document(document: str | p.RerankDocumentInput) -> p.RerankDocument:
    """A result's document as sent: the text, and a Cohere v1 object's other fields too."""
    if isinstance(document, str):
        return p.RerankDocument(text=document)
    return p.RerankDocument(**document.model_dump())


async def _vllm_tokens(service: PoolingService, body: p.TokenizeRequest) -> p.TokenizeResponse:
    """vLLM's tokenize answer for ``body.prompt``."""
    max_model_len = service.runtime.model_config.max_model_len
    if body.add_special_tokens and not body.return_token_strs:  # the front end's own path, length-checked
        ids = await service.tokenize(body.prompt)  # type: ignore[arg-type]
        return p.TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids)
    tokens = (await service.tokens([body.prompt], body.add_special_tokens))[0]  # type: ignore[list-item]
    return p.TokenizeResponse(count=len(tokens), max_model_len=max_model_len, tokens=[t.id for t in tokens],
                              token_strs=[t.token for t in tokens] if body.return_token_strs else None)
