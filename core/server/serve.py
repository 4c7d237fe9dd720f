"""Run an app under uvicorn with a graceful SIGTERM: refuse new requests, finish, then exit."""

from __future__ import annotations

import logging
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

from poolrunner.core.gc_heap import freeze_loaded_objects
from poolrunner.core.server.connections import MAX_HEAD_BYTES, ConnectionLimits, ensure_open_files
from poolrunner.core.server.logs import log_config
from poolrunner.core.server.memory_trace import start_from_environment

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE = 1.0
"""Seconds uvicorn's own shutdown may take at least after the drain (closing connections, the
requests of the clients closed at the drain deadline ending)."""


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT starts draining instead of stopping at once.

    While draining, the app answers new requests a JSON 503 that closes their connection
    (``app.state.server.draining``); the listener stays open until the drain ends. Once no
    request is in flight, or ``drain_timeout`` seconds after the signal, uvicorn's own shutdown
    runs with what is left of ``drain_timeout`` (at least :data:`SHUTDOWN_GRACE`); at the deadline
    the connections of unfinished requests are closed first, so that their requests end (a
    route sees its client gone) instead of being cancelled. The whole drain takes at most
    ``drain_timeout`` plus about :data:`SHUTDOWN_GRACE` seconds. A second signal stops at once.
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout: float) -> None:
        super().__init__(config)
        self._state = app.state.server
        self._drain_timeout = drain_timeout
        self._deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._deadline is not None:
            super().handle_exit(sig, frame)
            return
        logger.info("draining: finishing %d request(s) in flight, refusing new ones", self._state.in_flight)
        self._state.draining = True
        self._deadline = time.monotonic() + self._drain_timeout

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick (every 0.1 s, in the event loop), ending the drain when it is over."""
        if self._deadline is not None and not self.should_exit:
            left = self._deadline - time.monotonic()
            if self._state.in_flight == 0 or left <= 0:
                self._end_drain(left)
        return await super().on_tick(counter)

    def _end_drain(self, left: float) -> None:
        if left <= 0:
            busy = [connection for connection in self.server_state.connections
                    if getattr(connection, "cycle", None) is not None and not connection.cycle.response_complete]
            logger.warning("drain timeout (%g s): closing %d connection(s) whose requests are unfinished",
                           self._drain_timeout, len(busy))
            for connection in busy:
                connection.transport.close()
        self.config.timeout_graceful_shutdown = max(left, SHUTDOWN_GRACE)
        self.should_exit = True


def server_config(app: FastAPI, *, host: str, port: int, drain_timeout: float, limits: ConnectionLimits,
                  log_level: str = "info", log_format: str | None = "text") -> uvicorn.Config:
    """uvicorn's settings for ``app``: the connection ``limits``, h11 with heads of at most
    :data:`~.connections.MAX_HEAD_BYTES`, logging as
    :func:`~poolrunner.core.server.logs.log_config` says (poolrunner's access lines replace
    uvicorn's); ``log_format=None`` leaves the process's logging as it is (tests)."""
    logging_config = None if log_format is None else log_config(log_level, log_format)
    return uvicorn.Config(
        app, host=host, port=port, log_config=logging_config, log_level=log_level, access_log=False,
        timeout_graceful_shutdown=drain_timeout, http=limits.protocol(), ws="none",
        timeout_keep_alive=limits.keep_alive_timeout,  # the cap is the protocol's (a JSON refusal)
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
    )


def serve(
    app: FastAPI, *, host: str, port: int, drain_timeout: float, limits: ConnectionLimits | None = None,
    log_level: str = "info", log_format: str = "text",
) -> None:
    """Serve ``app`` until SIGTERM/SIGINT (drained as :class:`DrainingServer` says), with the
    connection ``limits`` (default :class:`~.connections.ConnectionLimits`), the open-file limit
    raised to fit them, logging as :func:`server_config` says; memory traced when
    ``POOLRUNNER_TRACEMALLOC_DIR`` is set (:mod:`.memory_trace`, for debugging). The objects
    loaded so far (the models') are frozen out of the garbage collector's reach
    (:mod:`~poolrunner.core.gc_heap`): this process is the command's own."""
    limits = limits or ConnectionLimits()
    start_from_environment()
    ensure_open_files(limits.max_connections)
    config = server_config(app, host=host, port=port, drain_timeout=drain_timeout, limits=limits,
                           log_level=log_level, log_format=log_format)
    freeze_loaded_objects()
    DrainingServer(config, app, drain_timeout).run()
