"""What the routes take from their app, as FastAPI dependencies: the served models
(:class:`ModelRouter`), the metrics, the app's start time, and the request bodies that carry the
served models' plugin request options (:class:`OptionBodies`).

Those bodies exist only once the app knows its models, while a route's annotation is written
before any app exists; and FastAPI includes a router by reference, so a module-level route is
one object shared by every app. A route whose body has option fields is therefore added per app
(:func:`with_body`): the endpoint stays a module-level function, and FastAPI builds that app's
route from its signature with the ``body`` parameter's type replaced by the app's class. FastAPI
then validates, answers errors and writes the OpenAPI schema exactly as for any body parameter.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from attrs import frozen
from fastapi import Depends, Request
from pydantic import BaseModel

from poolrunner.core.server import protocol as p
from poolrunner.core.server.metrics import ServerMetrics
from poolrunner.core.server.models import ModelRouter


@frozen
class OptionBodies:
    """An app's ``/pooling``, ``/score`` and rerank bodies: the protocol's classes with one field
    per plugin request option of the served models (the classes themselves when none declares one)."""

    pooling: type[p.PoolingHttpRequest]
    score: type[p.ScoreRequest]
    rerank: type[p.RerankRequest]

    @classmethod
    def of(cls, served: ModelRouter) -> OptionBodies:
        """The bodies for every served model's options, each name once (the model a request goes
        to checks the options it is given)."""
        by_name = {entry.option.name: entry for service in served.services for entry in service.frontend.options}
        options = list(by_name.values())
        return cls(p.with_plugin_options(p.PoolingHttpRequest, options),
                   p.with_plugin_options(p.ScoreRequest, options), p.with_plugin_options(p.RerankRequest, options))


def with_body(endpoint: Callable[..., Awaitable[Any]], body: type[BaseModel], **bound: Any
              ) -> Callable[..., Awaitable[Any]]:
    """``endpoint`` with ``bound`` arguments fixed, as a route whose ``body`` parameter is validated
    as ``body``: ``endpoint``'s own name, docstring and signature, that one parameter's type
    replaced (``__signature__``, which ``inspect`` and so FastAPI read)."""
    route = functools.update_wrapper(functools.partial(endpoint, **bound), endpoint)
    signature = inspect.signature(endpoint, eval_str=True)
    route.__signature__ = signature.replace(parameters=[  # type: ignore[attr-defined]
        parameter.replace(annotation=body) if name == "body" else parameter
        for name, parameter in signature.parameters.items() if name not in bound
    ])
    return route


async def _served(request: Request) -> ModelRouter:
    return request.app.state.router


async def _metrics(request: Request) -> ServerMetrics:
    return request.app.state.metrics


async def _created(request: Request) -> int:
    return request.app.state.created


Served = Annotated[ModelRouter, Depends(_served)]
"""The app's served models; ``served.pick(model, task)`` is the service answering a request."""
Metrics = Annotated[ServerMetrics, Depends(_metrics)]
Created = Annotated[int, Depends(_created)]
"""When the app was created (Unix seconds): the models' ``created``."""
