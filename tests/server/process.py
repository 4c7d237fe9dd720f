"""``poolrunner serve`` as a real process in a test: a free port, and waiting until it serves."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_healthy(process: subprocess.Popen, url: str, timeout: float = 120) -> None:
    """Return once ``url``'s ``/health`` answers 200; fail if the process exits or ``timeout`` s pass."""
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
