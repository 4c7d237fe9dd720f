"""Servers for the HTTP tests: real uvicorn on 127.0.0.1, over the session's shared runtimes."""

from __future__ import annotations

import pytest

from poolrunner.core.server import ServerSettings
from poolrunner.core.testing.server import ServerThread

API_KEY = "test-key-0123"


@pytest.fixture(scope="module")
def server(runtime):
    """The default model (all-MiniLM-L6-v2), open (no API key), default limits."""
    with ServerThread(runtime) as running:
        yield running


@pytest.fixture(scope="module")
def keyed_server(runtime):
    """The default model behind ``--api-key`` :data:`API_KEY`."""
    with ServerThread(runtime, ServerSettings(api_key=API_KEY)) as running:
        yield running
