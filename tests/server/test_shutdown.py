"""``poolrunner serve`` as a real process: startup, API key from the environment, SIGTERM drain."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from tests.conftest import SANITY_TEXT
from tests.helpers import MIN_COSINE, cosine_rows
from tests.server.process import free_port, wait_healthy

pytestmark = pytest.mark.slow


def _in_flight(url: str, headers: dict[str, str]) -> float:
    text = httpx.get(f"{url}/metrics", headers=headers).text
    return float(re.search(r"^poolrunner_http_requests_in_flight (\S+)$", text, re.MULTILINE).group(1))


def _request(connection: socket.socket, method: str, path: str, body: bytes = b"") -> tuple[bytes, bytes]:
    """One request on ``connection``; the answer's head and body (``Content-Length`` bytes)."""
    connection.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer k\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += connection.recv(65536)
    head, _, payload = answer.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
    while len(payload) < length:
        payload += connection.recv(65536)
    return head, payload


def test_sigterm_finishes_requests_in_flight_refuses_new_ones_and_exits(sanity_reference):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "poolrunner", "serve", "--port", str(port), "--log-level", "warning",
         "--no-entrypoints"], env={**os.environ, "POOLRUNNER_API_KEY": "k"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    headers = {"Authorization": "Bearer k"}
    try:
        wait_healthy(process, url)
        assert httpx.get(f"{url}/v1/models").status_code == 401  # the key came from the environment
        # bound to loopback: only loopback names are answered (DNS rebinding), /health too
        assert httpx.get(f"{url}/health", headers={"host": "rebound.example:80"}).status_code == 400
        # A request in flight for as long as the test likes: its body arrives in two parts.
        body = json.dumps({"input": [SANITY_TEXT], "encoding_format": "float"}).encode()
        kept = socket.create_connection(("127.0.0.1", port), timeout=10)  # a client's kept-alive connection
        assert _request(kept, "GET", "/v1/models")[0].startswith(b"HTTP/1.1 200")
        with socket.create_connection(("127.0.0.1", port)) as slow, kept:
            slow.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer k\r\n"
                         b"Content-Type: application/json\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode()
                         + body[:10])
            deadline = time.monotonic() + 60
            while _in_flight(url, headers) < 2:  # the metrics request itself is the other one
                assert time.monotonic() < deadline, "the slow request never arrived"
                time.sleep(0.01)
            process.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = httpx.post(f"{url}/v1/embeddings", json={"input": "late"}, headers=headers)
            assert refused.status_code == 503
            assert refused.json()["error"]["message"] == "the server is shutting down and takes no new requests"
            assert httpx.get(f"{url}/health").status_code == 503
            # on a connection opened before the signal: the same JSON 503, then the connection ends with it
            # (not later, under a request the client sends as the shutdown closes idle connections)
            head, payload = _request(kept, "POST", "/v1/embeddings", b'{"input": "late"}')
            assert head.startswith(b"HTTP/1.1 503") and b"\r\nconnection: close" in head.lower(), head
            assert json.loads(payload)["error"]["message"] == "the server is shutting down and takes no new requests"
            kept.settimeout(2)
            assert kept.recv(1) == b""  # closed by the server
            assert process.poll() is None  # still draining
            slow.sendall(body[10:])
            answer = slow.makefile("rb").read()  # the server closes the connection once it exits
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        vector = json.loads(payload)["data"][0]["embedding"]
        assert cosine_rows(np.array(vector), sanity_reference)[0] >= MIN_COSINE
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        _, stderr = process.communicate()
    assert "Traceback" not in stderr, stderr


def test_serve_rejects_contradictory_limits_before_loading(capsys):
    from poolrunner.core.cli.main import main

    assert main(["serve", "--max-inputs-per-request", "10", "--max-waiting-requests", "5"]) == 2
    error = capsys.readouterr().err
    assert "poolrunner: error: max_inputs_per_request (10) is larger than max_waiting_requests (5)" in error
    assert "hint: raise --max-waiting-requests or lower --max-inputs-per-request" in error
    assert main(["serve", "--port", "70000"]) == 2
    assert "--port must be 0..65535, got 70000" in capsys.readouterr().err
