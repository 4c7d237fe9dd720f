"""A real uvicorn server on 127.0.0.1 in a thread of the test process, on a free port.

Part of the plugin test kit: a plugin's tests drive its endpoints (``/pooling``, ``/score``) with
it. Imported only by the tests that use it, so the kit itself never imports uvicorn.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from poolrunner.core.server import ServerSettings, create_app


class ServerThread:
    """``with ServerThread(runtime, settings) as server:`` serves until the block ends;
    ``models`` is what :func:`~poolrunner.core.server.app.create_app` takes (a runtime, or several
    ``ServedModel``).

    :ivar url: ``http://127.0.0.1:PORT``.
    :ivar app: The FastAPI app.
    """

    def __init__(self, models: Any, settings: ServerSettings | None = None) -> None:
        self.app = create_app(models, settings)
        # IPPROTO_TCP, as uvicorn's own sockets: asyncio sets TCP_NODELAY on the connections of such a
        # socket only; without it every answer on a kept-alive connection waited ~40 ms (Nagle).
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        # h11, as `poolrunner serve` runs (uvicorn's auto picks httptools when it is installed, which
        # answers a malformed head in plain text where the server's own protocol answers JSON).
        config = uvicorn.Config(self.app, log_level="warning", ws="none", lifespan="on", http="h11")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    @property
    def serving(self) -> Any:
        """The (first) runtime's serving loop while the server runs (``pending``, ``alive``)."""
        return self.app.state.router.default.serving

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._socket.close()
        assert not self._thread.is_alive(), "the server did not stop"
