"""The FastAPI app: ``create_app(models, settings)`` serves one :class:`Runtime`, or several
(:mod:`.models`), over HTTP.

Endpoints (:mod:`.routes`): ``POST /v1/embeddings`` and ``/embeddings`` (OpenAI), ``GET /v1/models``
and ``/v1/models/{id}``, ``POST /classify``, ``/score`` and ``/v1/score`` (vLLM's four body forms),
``/rerank``, ``/v1/rerank``, ``/v2/rerank`` (vLLM, Jina, Cohere v1/v2 bodies; TEI's on
``/rerank``), ``/pooling``, ``/tokenize`` (vLLM's or TEI's body), ``/detokenize`` (vLLM's shapes),
``GET /health``, ``GET /metrics`` (Prometheus), ``POST /invocations`` (SageMaker: vLLM's or TEI's
bodies), and TEI's own routes. FastAPI
serves the OpenAPI page at ``/docs`` (and ReDoc at ``/redoc``) with local assets. While the app runs,
each runtime serves (:meth:`Runtime.serving`): its engine loop batches all clients' requests for
that model together, and the runtime's own Python API goes through the same loop meanwhile.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence

import attrs
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi_offline import FastAPIOffline

from poolrunner.core.runtime import Runtime
from poolrunner.core.server.admission import OutputBudget
from poolrunner.core.server.errors import TeiRoute, install_handlers
from poolrunner.core.server.metrics import ServerMetrics
from poolrunner.core.server.middleware import OPEN_PATHS, GuardMiddleware, ServerState
from poolrunner.core.server.models import ModelRouter, ServedModel, served_models
from poolrunner.core.server.routes import every_route, include_routes
from poolrunner.core.server.service import PoolingService
from poolrunner.core.server.settings import ServerSettings


def create_app(models: Runtime | Sequence[ServedModel], settings: ServerSettings | None = None) -> FastAPI:
    """An app serving ``models``: one :class:`Runtime` (under ``settings.served_model_name``,
    default its folder's name), or several :class:`ServedModel` each under its own names. Each
    runtime's engine loop runs from the app's startup to its shutdown; requests go to the model
    their ``model`` field names, or else the one that fits their route (:meth:`ModelRouter.pick`).

    ``app.state.server`` is the :class:`ServerState` (set ``draining`` to refuse new requests
    with 503); ``app.state.router`` the :class:`ModelRouter` of the models' services, whose
    ``serving`` is the runtime's serving loop while the app runs; ``app.state.metrics`` the
    :class:`ServerMetrics`; ``app.state.budget`` the :class:`OutputBudget` of per-token values in
    flight, shared by the models; ``app.state.created`` the app's creation time (Unix seconds).

    :raises ValueError: as :func:`served_models` says (no model, a name two models share...), or as
        ``settings``' checks (its ``token_id_inputs`` encoding not in this machine's tiktoken cache).
    """
    settings = settings or ServerSettings()
    attrs.validate(settings)  # unpickled (a Ray replica's), they skipped it: the tiktoken file must be here too
    metrics = ServerMetrics()
    state = ServerState()
    served = served_models(models, settings.served_model_name)
    budget = OutputBudget(settings.output_budget)  # per-token values in flight, over all models
    router = ModelRouter([PoolingService(model.runtime, settings, metrics, model.names, budget) for model in served],
                         settings)
    metrics.output_values.set_function(lambda: budget.held)
    metrics.output_waiting.set_function(lambda: budget.waiting)
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
    app.state.budget = budget
    app.state.created = int(time.time())
    install_handlers(app)
    include_routes(app, router)
    # metrics label every other path "other"
    endpoints = frozenset(path for route in every_route(app.routes)
                          if isinstance(path := getattr(route, "path", None), str))
    open_paths = OPEN_PATHS if settings.protect_metrics else OPEN_PATHS | {"/metrics"}
    tei_paths = frozenset(route.path for route in every_route(app.routes) if isinstance(route, TeiRoute))
    app.add_middleware(GuardMiddleware, state=state, metrics=metrics, settings=settings, endpoints=endpoints,
                       open_paths=open_paths, tei_paths=tei_paths)
    if settings.allowed_origins:  # added last, so outermost: preflights need no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id"])
    return app
