"""One ASGI middleware in front of every route: draining, auth, body size, request metrics, and
whether request bodies may carry unknown fields (``allow_extra_fields``).

Plain ASGI rather than Starlette's ``BaseHTTPMiddleware``, so that routes still receive the
client's ``http.disconnect`` (they abort their engine requests on it).
"""

from __future__ import annotations

import json
import logging
import secrets
import uuid
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from poolrunner.core.server.errors import error_body
from poolrunner.core.server.metrics import ServerMetrics
from poolrunner.core.server.protocol import ALLOW_EXTRA_FIELDS

OPEN_PATHS = frozenset({"/health"})
"""Paths answered without the API key."""

logger = logging.getLogger("poolrunner.core.server")


class BodyTooLargeError(HTTPException):
    """Raised from ``receive`` once the body passes the limit; FastAPI lets HTTP errors through
    its body parsing (any other error there becomes a generic 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the limit of {limit} bytes (max_request_bytes)")


class ServerState:
    """Mutable state shared by the middleware, the routes and the signal handler.

    :ivar draining: Set on SIGTERM: new requests get 503 while those in flight finish.
    :ivar in_flight: HTTP requests being answered now.
    """

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0


class GuardMiddleware:
    """Answers 503 while draining, 401 without the key, 413 for a body over the limit, and
    counts every answer by endpoint and status. With ``allow_extra_fields`` the request's body
    models drop (and log) fields they do not know (:data:`~.protocol.ALLOW_EXTRA_FIELDS`)."""

    def __init__(self, app: ASGIApp, *, state: ServerState, metrics: ServerMetrics, api_key: str | None,
                 max_request_bytes: int, endpoints: frozenset[str], allow_extra_fields: bool = False) -> None:
        self.app = app
        self.state = state
        self.metrics = metrics
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.endpoints = endpoints
        self.allow_extra_fields = allow_extra_fields

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in self.endpoints else "other"
        status: list[int | None] = [None]  # set once the answer starts

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        self.state.in_flight += 1
        extra_fields = ALLOW_EXTRA_FIELDS.set(self.allow_extra_fields)  # this request's task only
        try:
            refusal = self._refusal(scope, path)
            if refusal is not None:
                await _send_error(counted_send, *refusal)
                return
            await self.app(scope, self._limited(receive), counted_send)
        except Exception:
            if status[0] is not None:  # the answer is on its way: nothing valid can follow it
                raise
            # A bug, not the client's doing: a JSON 500 in the API's shape, on a connection that
            # stays open, and the traceback in the log under an id the client can quote.
            error_id = uuid.uuid4().hex[:12]
            logger.exception("unexpected error %s answering %s %s", error_id, scope.get("method"), path)
            await _send_error(counted_send, 500, f"internal server error (id {error_id}); the server logged it")
        finally:
            ALLOW_EXTRA_FIELDS.reset(extra_fields)
            self.state.in_flight -= 1
            self.metrics.requests.labels(endpoint, str(status[0] or 500)).inc()

    def _refusal(self, scope: Scope, path: str) -> tuple[int, str] | None:
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        if self.state.draining:
            return 503, "the server is shutting down and takes no new requests"
        if self.api_key is not None and path not in OPEN_PATHS:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
                return 401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'"
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            return 413, str(BodyTooLargeError(self.max_request_bytes).detail)
        return None

    def _limited(self, receive: Receive) -> Receive:
        """``receive`` that raises once more body than the limit arrived (chunked uploads too)."""
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_request_bytes:
                    raise BodyTooLargeError(self.max_request_bytes)
            return message

        return limited


async def _send_error(send: Any, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
