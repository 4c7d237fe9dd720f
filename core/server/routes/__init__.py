"""The server's routes, one module per API family, each route a module-level function on its
module's ``APIRouter``: :mod:`.embeddings` (OpenAI's and vLLM's embeddings, ``/pooling``,
``/classify``), :mod:`.scoring` (score and rerank: vLLM, Jina, Cohere), :mod:`.cohere`
(Cohere's v2 embed, texts and images), :mod:`.tei` (Text
Embeddings Inference's), :mod:`.infinity` (infinity's ``/models``, and its answers on the routes it
shares), :mod:`.admin` (health, metrics, models, tokenize), :mod:`.adapters`
(vLLM's run-time LoRA loading) and
:mod:`.invocations` (SageMaker). What a route needs of its app comes from ``app.state``
through FastAPI dependencies (:mod:`.dependencies`, which also says why the routes whose bodies
carry plugin request options are added per app).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute

from poolrunner.core.server.errors import ErrorAnswer, TeiErrorAnswer, documented_errors
from poolrunner.core.server.models import ModelRouter
from poolrunner.core.server.routes import adapters, admin, cohere, embeddings, infinity, invocations, scoring, tei
from poolrunner.core.server.routes.dependencies import OptionBodies


def include_routes(app: FastAPI, served: ModelRouter) -> None:
    """Every route on ``app``, for the ``served`` models (the bodies of :class:`OptionBodies`);
    sets ``app.state.invocations`` (``/invocations``' table)."""
    bodies = OptionBodies.of(served)
    routers = [embeddings.router, embeddings.option_routes(bodies), scoring.option_routes(bodies), cohere.router,
               admin.router, infinity.router, invocations.router]
    if served.settings.allow_runtime_lora:  # vLLM too serves them only when allowed
        routers.append(adapters.router)
    # The routes TEI shares (/rerank, /tokenize, /invocations) name both shapes themselves (SHARED_WITH_TEI).
    for router in routers:
        app.include_router(router, responses=documented_errors(ErrorAnswer))
    app.include_router(tei.router, responses=documented_errors(TeiErrorAnswer))
    app.state.invocations = invocations.Dispatch.build(
        served, bodies, (route for route in every_route(app.routes) if isinstance(route, APIRoute)))


def every_route(routes: Iterable[Any]) -> Iterator[Any]:
    """Each route of ``routes``, those of included routers too (FastAPI keeps an included
    router as one entry, which has no path of its own)."""
    for route in routes:
        if hasattr(route, "original_router"):
            yield from every_route(route.original_router.routes)
        else:
            yield route
