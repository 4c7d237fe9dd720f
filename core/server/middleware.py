"""One ASGI middleware in front of every route: draining, auth, body size, request metrics, the
access log line, the request id, and whether request bodies may carry unknown fields
(``allow_extra_fields``).

Plain ASGI rather than Starlette's ``BaseHTTPMiddleware``, so that routes still receive the
client's ``http.disconnect`` (they abort their engine requests on it).
"""

from __future__ import annotations

import logging
import re
import secrets
import time
import uuid
from contextvars import ContextVar
from typing import Any

from attrs import Factory, define
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from poolrunner.core.memory import TRIM_AFTER_CHARS, release_memory
from poolrunner.core.server.admission import Lease
from poolrunner.core.server.errors import TeiErrorType, send_error
from poolrunner.core.server.metrics import ServerMetrics
from poolrunner.core.server.protocol import BODY_SETTINGS
from poolrunner.core.server.settings import ServerSettings

OPEN_PATHS = frozenset({"/health", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
"""Paths always answered without the API key (``/metrics`` too unless ``protect_metrics``): the
health check and the API's own documentation, which a browser cannot send a key for."""
HEALTH_PATHS = frozenset({"/health", "/ping", "/"})
"""The health check's paths for GET and HEAD: vLLM's and TEI's ``/health``, TEI's and SageMaker's
``/ping`` and TEI's ``GET /`` (``POST /`` is TEI's inference route, behind the key)."""
OPEN_PREFIX = "/static-offline-docs/"
"""The documentation pages' scripts and styles (fastapi-offline's mount), open as the pages are."""
REQUEST_ID_HEADER = "x-request-id"
# A client's own request id is echoed and logged only in this shape: nothing else reaches the log.
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")

logger = logging.getLogger("poolrunner.core.server")
access_logger = logging.getLogger("poolrunner.access")


@define
class RequestStats:
    """What one HTTP request ran, for its access log line (and its body's size, ``body_bytes``):
    counts only, never its text; and the output budget's ``leases`` it holds, released once its
    answer has been sent (:mod:`~poolrunner.core.server.admission`)."""

    inputs: int = 0
    tokens: int = 0
    body_bytes: int = 0
    leases: list[Lease] = Factory(list)


REQUEST_STATS: ContextVar[RequestStats | None] = ContextVar("poolrunner_request_stats", default=None)
"""The current request's :class:`RequestStats`; the service adds to it."""


class BodyTooLargeError(HTTPException):
    """Raised from ``receive`` once the body passes the limit; FastAPI lets HTTP errors through
    its body parsing (any other error there becomes a generic 400).

    :param size: The body's size, where its ``Content-Length`` gives it (``announced``); else the
        bytes that had arrived when they passed the limit (the rest is never read).
    """

    def __init__(self, limit: int, size: int, announced: bool) -> None:
        super().__init__(413, f"the request body has {'' if announced else 'at least '}{size} bytes, more than the "
                              f"limit of {limit} bytes (max_request_bytes, the --max-request-bytes flag)")


class ServerState:
    """Mutable state shared by the middleware, the routes and the signal handler.

    :ivar draining: Set on SIGTERM: new requests get a JSON 503 (and their connection closed after
        it) while those in flight finish.
    :ivar in_flight: HTTP requests being answered now.
    """

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0


class GuardMiddleware:
    """Answers 400 for a ``Host`` not in ``allowed_hosts``, 503 while draining, 401 without the
    key, 413 for a body over the limit, and counts every answer by endpoint and status. The
    request's body models read ``settings`` (:data:`~.protocol.BODY_SETTINGS`).

    :param open_paths: Paths answered without the API key.
    :param tei_paths: TEI's own routes: their refusals in TEI's shape (as their other errors),
        but for the 401 (TEI answers it without a body).
    """

    def __init__(self, app: ASGIApp, *, state: ServerState, metrics: ServerMetrics, settings: ServerSettings,
                 endpoints: frozenset[str], open_paths: frozenset[str] = OPEN_PATHS,
                 tei_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.state = state
        self.metrics = metrics
        self.settings = settings
        self.api_key = settings.api_key
        self.open_paths = open_paths
        self.max_request_bytes = settings.max_request_bytes
        self.endpoints = endpoints
        self.tei_paths = tei_paths
        self.allowed_hosts = settings.allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        path = scope["path"]
        endpoint = path if path in self.endpoints else "other"
        status: list[int | None] = [None]  # set once the answer starts
        request_id = _request_id(scope)
        scope.setdefault("state", {})["request_id"] = request_id  # for the error handlers' texts

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REQUEST_ID_HEADER.encode(), request_id.encode())]}
            await send(message)

        self.state.in_flight += 1
        stats = RequestStats()
        stats_token = REQUEST_STATS.set(stats)
        body_settings = BODY_SETTINGS.set(self.settings)  # this request's task only
        try:
            refusal = self._refusal(scope, path)
            if refusal is not None:
                await _send_error(counted_send, *refusal, tei=path in self.tei_paths)
                return
            await self.app(scope, self._limited(receive, stats), counted_send)
        except Exception:
            if status[0] is not None:  # the answer is on its way: nothing valid can follow it
                raise
            # A bug, not the client's doing: a JSON 500 in the API's shape, on a connection that
            # stays open, and the traceback in the log under an id the client can quote.
            logger.exception("unexpected error %s answering %s %s", request_id, scope.get("method"), endpoint)
            await _send_error(counted_send, 500, f"internal server error (id {request_id}); the server logged it")
        finally:
            for lease in stats.leases:
                lease.release()
            BODY_SETTINGS.reset(body_settings)
            REQUEST_STATS.reset(stats_token)
            self.state.in_flight -= 1
            seconds = time.perf_counter() - began
            self.metrics.requests.labels(endpoint, str(status[0] or 500)).inc()
            self.metrics.request_duration.labels(endpoint).observe(seconds)
            _log_access(request_id, scope.get("method", ""), endpoint, status[0] or 500, stats, seconds)
        if stats.body_bytes >= TRIM_AFTER_CHARS:  # its body and texts are freed by now: return the memory
            await run_in_threadpool(release_memory)

    def _refusal(self, scope: Scope, path: str) -> tuple[int, str] | None:
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        host = _host_name(headers.get("host", ""))
        if self.allowed_hosts is not None and not _host_allowed(host, self.allowed_hosts):
            return 400, (f"the Host header {host[:100]!r} is not one this server answers (allowed_hosts, the "
                         f"--allowed-hosts flag: {', '.join(self.allowed_hosts)})")
        if self.state.draining:
            return 503, "the server is shutting down and takes no new requests"
        if self.api_key is not None and not self._open(scope.get("method", ""), path):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
                return 401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'"
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            return 413, str(BodyTooLargeError(self.max_request_bytes, int(length), announced=True).detail)
        return None

    def _open(self, method: str, path: str) -> bool:
        """Whether ``method path`` is answered without the API key."""
        return (path in self.open_paths or path.startswith(OPEN_PREFIX)
                or (method in ("GET", "HEAD") and path in HEALTH_PATHS))

    def _limited(self, receive: Receive, stats: RequestStats) -> Receive:
        """``receive`` that counts the body's bytes into ``stats`` and raises once more than the
        limit arrived (chunked uploads too)."""

        async def limited() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                stats.body_bytes += len(message.get("body", b""))
                if stats.body_bytes > self.max_request_bytes:
                    raise BodyTooLargeError(self.max_request_bytes, stats.body_bytes, announced=False)
            return message

        return limited


def _host_name(header: str) -> str:
    """The name or address of a ``Host`` header, lower case, without its port (``[::1]:80`` -> ``::1``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


def _host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    return any(host == name or (name.startswith("*.") and host.endswith(name[1:])) for name in allowed)


def _request_id(scope: Scope) -> str:
    """The client's ``x-request-id`` when it is a plain token, else a new random one."""
    for name, value in scope["headers"]:
        if name.lower() == REQUEST_ID_HEADER.encode():
            given = value.decode("latin-1")
            if _CLIENT_REQUEST_ID.fullmatch(given):
                return given
    return uuid.uuid4().hex[:16]


def _log_access(request_id: str, method: str, endpoint: str, status: int, stats: RequestStats, seconds: float) -> None:
    """One line per answered request; the fields also go to ``--log-format json`` as keys."""
    latency_ms = round(1000 * seconds, 2)
    access_logger.info(
        "%s %s %d inputs=%d tokens=%d %.2f ms id=%s", method, endpoint, status, stats.inputs, stats.tokens,
        latency_ms, request_id,
        extra={"request_id": request_id, "method": method, "route": endpoint, "status": status,
               "inputs": stats.inputs, "tokens": stats.tokens, "latency_ms": latency_ms},
    )


_REFUSAL_HEADERS = {401: [(b"www-authenticate", b"Bearer")],
                    # draining: the client's kept-alive connection ends with this answer, rather than
                    # under a request it sends as the server's shutdown closes its idle connections
                    503: [(b"connection", b"close")]}


_TEI_REFUSALS: dict[int, TeiErrorType] = {400: "Validation", 413: "Validation", 503: "Unhealthy"}
"""The middleware's refusals in TEI's terms (its 401 stays OpenAI's)."""


async def _send_error(send: Any, status: int, message: str, tei: bool = False) -> None:
    await send_error(send, status, message, _REFUSAL_HEADERS.get(status, []),
                     tei_error_type=_TEI_REFUSALS.get(status) if tei else None)
