"""Run an app under uvicorn with a graceful SIGTERM: refuse new requests, finish, then exit."""

from __future__ import annotations

import logging
import threading
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT starts draining instead of stopping at once.

    While draining, the app answers new requests 503 (``app.state.server.draining``); once no
    request is in flight, or after ``drain_timeout`` seconds, uvicorn's own shutdown runs. A
    second signal stops at once.
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout: float) -> None:
        super().__init__(config)
        self._state = app.state.server
        self._drain_timeout = drain_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._state.draining:
            super().handle_exit(sig, frame)
            return
        logger.info("draining: finishing %d request(s) in flight, refusing new ones", self._state.in_flight)
        self._state.draining = True
        threading.Thread(target=self._exit_when_idle, name="poolrunner-drain", daemon=True).start()

    def _exit_when_idle(self) -> None:
        deadline = time.monotonic() + self._drain_timeout
        while self._state.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        self.should_exit = True


def serve(app: FastAPI, *, host: str, port: int, drain_timeout: float, log_level: str = "info") -> None:
    """Serve ``app`` until SIGTERM/SIGINT (drained as :class:`DrainingServer` says)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_timeout)
    DrainingServer(config, app, drain_timeout).run()
