"""Connections of ``poolrunner serve``: idle and slow clients are disconnected, the connection cap
refuses cleanly, the SIGTERM drain ends within ``--drain-timeout`` with a slow client, and
repeated errors are rate-limited in the log.

The servers here run :func:`~poolrunner.core.server.serve.server_config` under
:class:`~poolrunner.core.server.serve.DrainingServer` in a thread (SIGTERM is its
``handle_exit``), as ``poolrunner serve`` runs them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import signal
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from poolrunner.core.server import ServerSettings, create_app
from poolrunner.core.server.connections import ConnectionLimits
from poolrunner.core.server.logs import RepeatFilter, log_config
from poolrunner.core.server.serve import SHUTDOWN_GRACE, DrainingServer, server_config
from tests.conftest import SANITY_TEXT
from tests.helpers import captured_logs

SLACK_S = 2.0
"""Seconds allowed beyond a timeout for the event loop's ticks and a loaded 2-core machine (a CI run
once saw a 1.0 s read timeout close after 2.09 s). Every default timeout the tests tell apart is
longer than timeout + slack: keep-alive 5 s, read 30 s."""


@contextlib.contextmanager
def running(runtime, limits: ConnectionLimits, drain_timeout: float = 30.0,
            settings: ServerSettings | None = None) -> Iterator[tuple[DrainingServer, int, threading.Thread]]:
    """A draining server on a free port of 127.0.0.1: ``(server, port, thread)``."""
    app = create_app(runtime, settings)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    config = server_config(app, host="127.0.0.1", port=0, drain_timeout=drain_timeout, limits=limits,
                           log_level="warning", log_format=None)
    server = DrainingServer(config, app, drain_timeout)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield server, listener.getsockname()[1], thread
    finally:
        server.should_exit = True
        thread.join(30)
        listener.close()
        assert not thread.is_alive(), "the server did not stop"


def closed_after(connection: socket.socket, limit: float) -> float:
    """Seconds until the server closes ``connection`` (read until EOF), at most ``limit``; then
    ``connection`` is closed here too."""
    return read_until_closed(connection, limit)[0]


def read_until_closed(connection: socket.socket, limit: float) -> tuple[float, bytes]:
    """What the server sends on ``connection`` until it closes it, at most ``limit`` seconds,
    and how long that took; then ``connection`` is closed here too."""
    began = time.monotonic()
    received = b""
    connection.settimeout(limit)
    try:
        while chunk := connection.recv(65536):
            received += chunk
    except TimeoutError:
        pytest.fail(f"the connection was still open after {limit} s")
    except ConnectionResetError:
        pass
    finally:
        connection.close()
    return time.monotonic() - began, received


def assert_read_timeout_answer(received: bytes, read_timeout: float) -> None:
    """``received`` is the JSON 408 naming ``--read-timeout``, and nothing else."""
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 Request Timeout\r\n") and b"connection: close" in head, received
    assert json.loads(body) == {"error": {
        "message": f"the request did not arrive whole within {read_timeout:g} s (--read-timeout); send it at once, "
                   "or raise the limit", "type": "request_timeout", "param": None, "code": 408}}


def embed_request(text: str = SANITY_TEXT) -> bytes:
    body = json.dumps({"input": [text]}).encode()
    return (b"POST /v1/embeddings HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)


def test_idle_slow_and_kept_alive_clients_are_disconnected(runtime):
    limits = ConnectionLimits(keep_alive_timeout=0.5, read_timeout=1.5)
    with running(runtime, limits) as (_, port, _):
        kept = socket.create_connection(("127.0.0.1", port))
        kept.sendall(embed_request())
        assert kept.recv(65536).startswith(b"HTTP/1.1 200")
        assert 0.3 < closed_after(kept, 5) < 0.5 + SLACK_S  # idle after an answer: the keep-alive timeout
        idle = socket.create_connection(("127.0.0.1", port))  # sends nothing at all: closed without an answer
        seconds, received = read_until_closed(idle, 5)
        assert 1.2 < seconds < 1.5 + SLACK_S and received == b""
        slow = socket.create_connection(("127.0.0.1", port))
        began = time.monotonic()
        with contextlib.suppress(OSError):  # a byte every 0.1 s (slowloris) until the server answers
            for byte in b"POST /v1/embeddings HTTP/1.1\r\nHost: test\r\nX-Padding: " + b"a" * 100:
                slow.send(bytes([byte]))
                time.sleep(0.1)
                if select.select([slow], [], [], 0)[0]:
                    break
        assert_read_timeout_answer(read_until_closed(slow, 5)[1], 1.5)
        assert 1.2 < time.monotonic() - began < 1.5 + SLACK_S
        assert httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"input": "still serving"}).status_code == 200


def test_a_request_body_that_stalls_is_cut_at_the_read_timeout(runtime):
    with running(runtime, ConnectionLimits(read_timeout=1.0)) as (server, port, _):
        stalled = socket.create_connection(("127.0.0.1", port))
        stalled.sendall(embed_request()[:-10])  # all but the body's end
        seconds, received = read_until_closed(stalled, 5)
        assert seconds < 1.0 + SLACK_S
        assert_read_timeout_answer(received, 1.0)
        deadline = time.monotonic() + 5
        while server._state.in_flight:  # its request ended (the route saw the client gone)
            assert time.monotonic() < deadline, "the stalled request is still in flight"
            time.sleep(0.01)
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200


@pytest.mark.parametrize("pieces", [1, 3])
def test_a_request_head_over_16_kib_is_a_json_431_whole_or_in_pieces(runtime, pieces):
    """h11's own limit counts only a head still incomplete: a whole big head would pass it."""
    def head(size: int) -> bytes:
        return b"GET /health HTTP/1.1\r\nHost: test\r\nX-Big: " + b"a" * size + b"\r\n\r\n"

    with running(runtime, ConnectionLimits()) as (_, port, _):
        big = head(17_000)
        connection = socket.create_connection(("127.0.0.1", port))
        step = -(-len(big) // pieces)
        for start in range(0, len(big), step):
            connection.sendall(big[start:start + step])
            time.sleep(0.05)
        received = read_until_closed(connection, 5)[1]
        status, _, body = received.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), received[:200]
        assert json.loads(body)["error"] == {
            "message": "the request head (request line and headers) is larger than 16384 bytes",
            "type": "request_too_large", "param": None, "code": 431}
        fits = socket.create_connection(("127.0.0.1", port))
        fits.sendall(head(16_000))
        assert fits.recv(65536).startswith(b"HTTP/1.1 200")
        fits.close()


def test_a_request_framed_by_both_length_and_chunks_is_refused_and_its_connection_closed(runtime):
    """RFC 9112 section 6.3: the two framings may disagree (request smuggling past a proxy)."""
    body = json.dumps({"input": SANITY_TEXT}).encode()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    with running(runtime, ConnectionLimits()) as (_, port, _):
        connection = socket.create_connection(("127.0.0.1", port))
        connection.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked)
        received = read_until_closed(connection, 5)[1]  # closed: nothing more is read from it
        head, _, answer = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n") and b"connection: close" in head, received[:200]
        assert json.loads(answer)["error"] == {
            "message": "the request has both Content-Length and Transfer-Encoding headers: send one of them "
                       "(RFC 9112, section 6.3)",
            "type": "invalid_request_error", "param": None, "code": 400}
        good = socket.create_connection(("127.0.0.1", port))
        good.sendall(embed_request())
        assert good.recv(65536).startswith(b"HTTP/1.1 200")
        good.close()


@pytest.mark.parametrize("request_bytes", [
    b"HELLO\r\n\r\n",
    b"POST /v1/embeddings HTTP/1.1\r\nHost: test\r\nContent-Length: -5\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: test\r\nBad Header Name: x\r\n\r\n",
], ids=["request line", "negative length", "header name"])
def test_bytes_that_are_not_http_get_a_json_400_and_the_server_serves_on(runtime, request_bytes):
    with running(runtime, ConnectionLimits()) as (_, port, _):
        connection = socket.create_connection(("127.0.0.1", port))
        connection.sendall(request_bytes)
        received = read_until_closed(connection, 5)[1]
        head, _, body = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n") and b"connection: close" in head, received[:200]
        assert json.loads(body)["error"] == {
            "message": "the request is not valid HTTP/1.1: its request line or a header could not be parsed",
            "type": "invalid_request_error", "param": None, "code": 400}
        good = socket.create_connection(("127.0.0.1", port))
        good.sendall(embed_request())
        assert good.recv(65536).startswith(b"HTTP/1.1 200")
        good.close()


def test_connections_past_the_cap_are_refused_with_a_json_503_then_served_again(runtime, caplog):
    """The cap counts open connections that have sent something (here, half a request head): the
    4th of 4 is served, the 5th gets OpenAI's error shape and is closed after the answer (read to
    EOF, nothing after it), ``/health`` is still answered, and once connections close requests
    are served again."""
    with running(runtime, ConnectionLimits(max_connections=4)) as (_, port, _), captured_logs(caplog):
        url = f"http://127.0.0.1:{port}/v1/embeddings"
        held = [_started(port) for _ in range(3)]
        time.sleep(0.2)
        assert httpx.post(url, json={"input": "x"}).status_code == 200  # the 4th connection
        held.append(_started(port))
        time.sleep(0.2)
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200  # never refused
        refused = httpx.post(url, json={"input": "x"})
        message = "the server is at its limit of 4 connections (--max-connections); try again later"
        assert (refused.status_code, refused.json()) == (503, {"error": {
            "message": message, "type": "service_unavailable", "param": None, "code": 503}})
        assert refused.headers["connection"] == "close"
        assert refused.headers["content-type"] == "application/json"
        raw = socket.create_connection(("127.0.0.1", port))
        raw.sendall(embed_request())
        answer = b""
        raw.settimeout(5)
        while chunk := raw.recv(65536):  # EOF right after the answer: the server closed it
            answer += chunk
        raw.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ") and b"connection: close" in head.lower()
        assert json.loads(body)["error"]["message"] == message
        for connection in held:
            connection.close()
        time.sleep(0.2)
        assert httpx.post(url, json={"input": "x"}).status_code == 200
    refusals = {r.getMessage() for r in caplog.records if r.getMessage().startswith("refused a request")}
    assert refusals == {"refused a request: the server is at its limit of 4 connections (--max-connections)"}


def _started(port: int) -> socket.socket:
    """A connection that sent the start of a request head and then waits."""
    connection = socket.create_connection(("127.0.0.1", port))
    connection.sendall(b"POST /v1/embeddings HTTP/1.1\r\n")
    return connection


def test_silent_connections_make_room_for_a_request_past_the_cap(runtime):
    """Sockets opened and left silent (an attacker's, at no cost) used to hold every request at
    503 until the read timeout; now a request past the cap closes them and is answered."""
    with running(runtime, ConnectionLimits(max_connections=4)) as (_, port, _):
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]
        time.sleep(0.2)
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"input": [SANITY_TEXT]})
        assert answer.status_code == 200, answer.text
        assert answer.json()["data"][0]["embedding"] == pytest.approx(runtime.embed(SANITY_TEXT).tolist(), abs=2e-6)
        for connection in silent:
            closed_after(connection, 5)


def test_drain_with_a_slow_client_ends_within_the_drain_timeout(runtime, caplog):
    """The slow client's request never completes: at the drain deadline its connection is closed,
    its request ends (no task cancelled, no traceback) and the server exits."""
    drain_timeout = 2.0
    with running(runtime, ConnectionLimits(read_timeout=60), drain_timeout) as (server, port, thread):
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(embed_request()[:-10])
        while server._state.in_flight < 1:
            time.sleep(0.01)
        with captured_logs(caplog):
            began = time.monotonic()
            server.handle_exit(signal.SIGTERM, None)
            thread.join(drain_timeout + SHUTDOWN_GRACE + 10)
            took = time.monotonic() - began
        assert not thread.is_alive()
        closed_after(slow, 1)
    assert drain_timeout <= took <= drain_timeout + SHUTDOWN_GRACE + SLACK_S, took
    messages = [record.getMessage() for record in caplog.records]
    assert "drain timeout (2 s): closing 1 connection(s) whose requests are unfinished" in messages
    assert not [record for record in caplog.records if record.exc_info], messages
    assert not any("Cancel" in message for message in messages), messages


def test_drain_ends_at_once_when_no_request_is_in_flight(runtime):
    with running(runtime, ConnectionLimits(), drain_timeout=30) as (server, port, thread):
        idle = socket.create_connection(("127.0.0.1", port))
        began = time.monotonic()
        server.handle_exit(signal.SIGTERM, None)
        thread.join(10)
        assert time.monotonic() - began < 1.0 + SLACK_S
        closed_after(idle, 1)


def test_repeated_errors_are_rate_limited_with_a_summary_line():
    now = [0.0]
    flood = RepeatFilter(limit=3, window=60, clock=lambda: now[0])

    def record(message: str, level: int = logging.ERROR) -> logging.LogRecord:
        try:
            raise OSError(24, "Too many open files")
        except OSError as exc:
            return logging.LogRecord("asyncio", level, __file__, 1, message, (), (type(exc), exc, exc.__traceback__))

    passed = [r for r in (record("socket.accept() out of system resource") for _ in range(20)) if flood.filter(r)]
    assert len(passed) == 4
    assert [r.exc_info is not None for r in passed] == [True, True, True, False]
    assert passed[3].getMessage() == ("socket.accept() out of system resource (logged 3 times in 60 s: more like it "
                                      "are dropped for the rest of that time)")
    assert flood.filter(record("another error"))  # another kind has its own count
    assert flood.filter(record("info lines always pass", logging.INFO))
    now[0] = 61.0
    first = record("socket.accept() out of system resource")
    assert flood.filter(first)
    assert first.getMessage() == ("socket.accept() out of system resource (16 more like it were dropped in the "
                                  "previous 60 s)")


def test_log_config_rate_limits_every_server_logger():
    config = log_config("info", "text")
    assert config["handlers"]["stderr"]["filters"] == ["repeats"]
    assert config["filters"]["repeats"]["()"] is RepeatFilter
    assert config["loggers"]["asyncio"]["handlers"] == ["stderr"]


def test_limits_are_serve_flags_and_environment_variables(monkeypatch):
    from poolrunner.core.cli.main import build_parser

    args = build_parser().parse_args(["serve"])
    assert (args.max_connections, args.keep_alive_timeout, args.read_timeout) == (1024, 5.0, 30.0)
    assert args.max_request_bytes == 2_000_000 and args.max_inputs_per_request == 2048
    monkeypatch.setenv("POOLRUNNER_READ_TIMEOUT", "12.5")
    monkeypatch.setenv("POOLRUNNER_MAX_CONNECTIONS", "64")
    args = build_parser().parse_args(["serve", "--keep-alive-timeout", "2"])
    assert (args.max_connections, args.keep_alive_timeout, args.read_timeout) == (64, 2.0, 12.5)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--read-timeout", "0"])
    assert ServerSettings().max_request_bytes == 2_000_000
