"""Limits on the server's connections: how long a client may take to send a request, how long an
idle connection stays open, and how many connections are served at once.

uvicorn's h11 protocol closes a connection idle after an answer (``timeout_keep_alive``) but
waits forever for a first request, and for the rest of a request that trickles in (a slowloris
client holds its socket with a byte now and then). :class:`GuardedH11Protocol` adds a read
deadline (a request begun but not whole by then is answered a JSON 408 before the connection
closes), and the connection cap: past it a request is answered a JSON 503 in OpenAI's error
shape and its connection closed (uvicorn's own ``limit_concurrency`` answers plain text).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import h11
from attrs import field, frozen
from uvicorn.protocols.http.h11_impl import H11Protocol

from poolrunner.core.server.errors import error_response, send_error
from poolrunner.core.validators import positive_int

logger = logging.getLogger(__name__)

HEALTH_PATH = "/health"
"""Answered whatever the connection count: an orchestrator's probe must not fail under load."""
MAX_HEAD_BYTES = 16 * 1024
"""Largest request head (request line and headers), bytes: h11's default, set explicitly (h11
counts only a head still incomplete); a larger head, whole or in pieces, is answered a JSON 431
and the connection closed (:meth:`GuardedH11Protocol.data_received`)."""


def _positive(_instance: object, attribute: Any, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be positive, got {value!r}")


@frozen(kw_only=True)
class ConnectionLimits:
    """The connection settings of ``poolrunner serve``.

    :ivar keep_alive_timeout: Seconds an idle connection stays open after an answer (uvicorn's
        ``timeout_keep_alive``; vLLM's and uvicorn's default, 5).
    :ivar read_timeout: Seconds a client has to send a whole request (head and body), from the
        connection's opening or from its previous answer; then the connection is closed.
    :ivar max_connections: Most connections (and requests running) at once; a request on a
        connection past it is answered a JSON 503 and its connection closed
        (:meth:`GuardedH11Protocol.refuse`).
    """

    keep_alive_timeout: float = field(default=5.0, validator=_positive)
    read_timeout: float = field(default=30.0, validator=_positive)
    max_connections: int = field(default=1024, validator=positive_int)

    def protocol(self) -> Any:
        """The ``http`` protocol factory for ``uvicorn.Config``."""
        return functools.partial(GuardedH11Protocol, read_timeout=self.read_timeout,
                                 max_connections=self.max_connections)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a read deadline and a connection cap.

    A request's head and body must arrive within ``read_timeout`` seconds of the connection's
    opening or of its previous answer, else the connection is closed (a route waiting for the
    body sees the client gone), after a JSON 408 naming ``--read-timeout`` where part of a request
    had arrived (:meth:`_read_timed_out`). A request arriving while more than ``max_connections``
    connections are open (this one included), or more requests are running, first closes the
    connections that have sent nothing yet (sockets opened and left silent cost an attacker
    nothing and must not lock real clients out), and is answered by :meth:`refuse` instead of
    the app only if that leaves the count over the cap. ``/health`` is never refused. uvicorn's
    own cap (``limit_concurrency``, which must stay unset) answers plain text from a module-level
    app that cannot be replaced without patching uvicorn for every server in the process; so this
    protocol puts :meth:`_admit` in front of the app it was given, for its own connection only.

    :param read_timeout: Seconds, > 0.
    :param max_connections: The cap, >= 1.
    """

    def __init__(self, *args: Any, read_timeout: float, max_connections: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self._read_deadline: asyncio.TimerHandle | None = None
        self.max_connections = max_connections
        self.silent = True  # no byte received yet
        self._app = self.app
        self.app = self._admit

    def data_received(self, data: bytes) -> None:
        self.silent = False
        if self.conn.their_state == h11.IDLE and self._head_too_large(data):
            self._answer_and_close(431, "Request Header Fields Too Large",
                                   f"the request head (request line and headers) is larger than {MAX_HEAD_BYTES} bytes")
            return
        super().data_received(data)

    def _head_too_large(self, data: bytes) -> bool:
        """Whether the head arriving (what h11 holds unparsed, then ``data``) passes :data:`MAX_HEAD_BYTES`."""
        buffered = self.conn.trailing_data[0]
        received = buffered + data if buffered else data
        end = received.find(b"\r\n\r\n")
        return (end if end >= 0 else len(received)) > MAX_HEAD_BYTES

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_deadline()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        self._watch_reading()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._stop_deadline()  # the next request gets a whole read_timeout of its own
        self._watch_reading()

    def _watch_reading(self) -> None:
        """Start the deadline while a request is expected or arriving; stop it once one is read."""
        reading = self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing()
        if reading and self._read_deadline is None:
            self._read_deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)
        elif not reading:
            self._stop_deadline()

    def _stop_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        """Close the connection; first answer 408 if a request had begun (its head or body part
        read), written past h11 and the app (a route waiting for the body then sees the client
        gone), as nginx answers a body that stalls."""
        self._read_deadline = None
        if self.transport.is_closing():
            return
        if self.conn.their_state == h11.SEND_BODY or self.conn.trailing_data[0]:
            self._answer_and_close(408, "Request Timeout",
                                   f"the request did not arrive whole within {self.read_timeout:g} s (--read-timeout); "
                                   "send it at once, or raise the limit")
        else:
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes h11 cannot parse as HTTP/1.1 (a garbage request line, a
        negative ``Content-Length``...), in the server's JSON error shape instead of plain text."""
        self._answer_and_close(400, "Bad Request",
                               "the request is not valid HTTP/1.1: its request line or a header could not be parsed")

    def _answer_and_close(self, status: int, reason: str, message: str) -> None:
        """Write a JSON error answer past h11 and the app, then close the connection (the app, if a
        request of this connection runs, sees the client gone)."""
        body = error_response(status, message).body
        self.transport.write(f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: "
                             f"{len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
        self.transport.close()

    async def _admit(self, scope: Any, receive: Any, send: Any) -> None:
        """The app, or :meth:`refuse` past the cap, or a 400 for a request framed twice
        (:func:`_framed_twice`). Runs as the request's task, which ``self.tasks`` already holds, as
        ``self.connections`` holds this connection."""
        if _framed_twice(scope):
            await send_error(send, 400, "the request has both Content-Length and Transfer-Encoding headers: send "
                                        "one of them (RFC 9112, section 6.3)", [(b"connection", b"close")])
        elif scope.get("path") != HEALTH_PATH and self._over_cap():
            await self.refuse(send)
        else:
            await self._app(scope, receive, send)

    def _over_cap(self) -> bool:
        """More requests running than the cap, or more connections even once the silent ones close."""
        cap = self.max_connections
        if len(self.tasks) > cap:
            return True
        return len(self.connections) > cap and len(self.connections) - self._close_silent() > cap

    def _close_silent(self) -> int:
        """Close the other connections that have sent nothing yet; how many."""
        silent = [other for other in self.connections if other is not self and getattr(other, "silent", False)]
        for other in silent:
            other.transport.close()
        return len(silent)

    async def refuse(self, send: Any) -> None:
        """Answer 503 with an OpenAI-shaped JSON error naming the cap and ``--max-connections``,
        and ``Connection: close``, after which uvicorn closes the connection once the answer is
        written. The body is not read: a refused client costs no more than its head."""
        # one message template whatever the counts, so that the log's rate limit groups a flood
        logger.warning("refused a request: the server is at its limit of %d connections (--max-connections)",
                       self.max_connections)
        message = (f"the server is at its limit of {self.max_connections} connections (--max-connections); "
                   "try again later")
        await send_error(send, 503, message, [(b"connection", b"close")])


def _framed_twice(scope: Any) -> bool:
    """Whether a request carries both ``Content-Length`` and ``Transfer-Encoding``: h11 reads the
    body as the latter says, but a proxy in front may have read it as the former, and the bytes
    between the two readings are a request smuggled past the proxy. RFC 9112 (section 6.3) lets a
    server refuse such a request and has it close the connection whatever it answers; it is
    refused, as nginx does."""
    names = {name.lower() for name, _ in scope.get("headers", ())}
    return b"content-length" in names and b"transfer-encoding" in names


FILE_RESERVE = 256
"""Open files kept beside the connections: the model's files, logs, pipes, the engine's threads."""


def ensure_open_files(max_connections: int) -> None:
    """Raise the soft open-file limit (toward the hard one) so that ``max_connections`` connections
    fit beside :data:`FILE_RESERVE` other files: out of descriptors, the server can accept no
    connection, not even a good one. Logs a warning when the hard limit is too low; never raises."""
    try:
        import resource
    except ImportError:  # Windows: no such limit
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + FILE_RESERVE
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        target = soft
    if target < wanted:
        logger.warning("the open-file limit is %d, too low for max_connections=%d and %d other files: lower "
                       "--max-connections or raise the limit (ulimit -n)", target, max_connections, FILE_RESERVE)
