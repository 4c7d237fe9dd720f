"""SageMaker's ``POST /invocations``, which vLLM and TEI both serve: a TEI body (``inputs``) is
answered by TEI's ``POST /``, any other by the first route of the app's :class:`Dispatch` table
whose body it is, as vLLM dispatches it (request bodies refuse unknown fields, so one form fits).
The chosen route itself answers (:class:`_Forwarded`): its status, headers, response model and
error shape."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any

import pydantic
from attrs import frozen
from fastapi import APIRouter, Body, Depends, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.types import Message, Receive, Scope, Send

from poolrunner.core.server import protocol as p
from poolrunner.core.server.errors import SHARED_WITH_TEI, ApiError
from poolrunner.core.server.models import ModelRouter
from poolrunner.core.server.routes.dependencies import OptionBodies

TEI_PATH = "/"
"""Where a TEI body goes: TEI's own default route."""


@frozen
class Dispatch:
    """``/invocations``' table: ``(body model, route)`` in vLLM's order, and TEI's route."""

    table: tuple[tuple[type[BaseModel], APIRoute], ...]
    tei: APIRoute

    @classmethod
    def build(cls, served: ModelRouter, bodies: OptionBodies, routes: Iterable[APIRoute]) -> Dispatch:
        """The table for the served tasks (embeddings and classify only where a model serves them),
        with the app's bodies, over its POST ``routes``."""
        tasks = frozenset().union(*(service.runtime.supported_tasks for service in served.services))
        forms: list[tuple[type[BaseModel], str]] = [
            *([(p.EmbeddingRequest, "/v1/embeddings")] if "embed" in tasks else []),
            *([(p.ClassificationRequest, "/classify")] if "classify" in tasks else []),
            (bodies.score, "/score"), (bodies.rerank, "/rerank"), (bodies.pooling, "/pooling"),
        ]
        by_path = {route.path: route for route in routes if "POST" in route.methods}
        return cls(tuple((model, by_path[path]) for model, path in forms), by_path[TEI_PATH])

    def route(self, body: dict[str, Any]) -> APIRoute:
        """The route answering ``body``.

        :raises ApiError: 400 for a body of none of the table's routes, nor TEI's.
        """
        if "inputs" in body:
            return self.tei
        route = next((route for model, route in self.table if _fits(model, body)), None)
        if route is None:
            names = ", ".join(model.__name__ for model, _ in self.table)
            raise ApiError(400, f"/invocations takes the body of one of {names}, or TEI's (inputs); this body is "
                                "none of them")
        return route


async def _dispatch(request: Request) -> Dispatch:
    return request.app.state.invocations


router = APIRouter()


@router.post("/invocations", responses=SHARED_WITH_TEI)
async def invocations(request: Request, body: Annotated[dict[str, Any], Body()],
                      dispatch: Annotated[Dispatch, Depends(_dispatch)]) -> Response:
    return _Forwarded(dispatch.route(body), await request.body())


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
