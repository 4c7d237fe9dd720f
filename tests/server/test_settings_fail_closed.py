"""``poolrunner serve``'s settings fail closed and fast.

An empty key (``POOLRUNNER_API_KEY=""``) used to start an open server, and a key read from a
file with its trailing newline locked every client out; both are refused before any model
loads, without the key in the message. A drain timeout must be a finite number of seconds. A
request's ``priority`` is honoured only under ``--scheduling-policy priority`` (vLLM's rule),
within a bounded range; otherwise any client could push its work ahead of everyone's.
"""

from __future__ import annotations

import math
import time

import httpx
import pytest

from poolrunner.core.cli.main import main
from poolrunner.core.server import ServerSettings
from poolrunner.core.testing.server import ServerThread

EMPTY = ("the API key is empty or only whitespace, which would leave the server open to anyone; set a key, or "
         "leave --api-key and POOLRUNNER_API_KEY unset for an open server")
PADDED = ("the API key has leading or trailing whitespace (a newline read from a file?), which no client sends, "
          "so every request would be refused; strip it")


@pytest.mark.parametrize(("key", "message"), [
    ("", EMPTY), ("   ", EMPTY), ("\n", EMPTY), ("s3cret\n", PADDED), (" s3cret", PADDED),
])
def test_an_unusable_key_is_refused(key, message):
    with pytest.raises(ValueError) as error:
        ServerSettings(api_key=key)
    assert str(error.value) == message
    assert ServerSettings(api_key="s3cret").api_key == "s3cret" and ServerSettings().api_key is None


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_serve_refuses_an_empty_key_before_loading_a_model(how, monkeypatch, capsys):
    argv = ["serve", "--model", "/nonexistent/model/folder"]
    if how == "flag":
        argv += ["--api-key", ""]
    else:
        monkeypatch.setenv("POOLRUNNER_API_KEY", "")
    started = time.monotonic()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"poolrunner: error: {EMPTY}" in err and "Traceback" not in err
    assert "/nonexistent" not in err  # refused before the model folder is even looked at
    assert time.monotonic() - started < 2


@pytest.mark.parametrize("value", ["-5", "nan", "inf", "soon"])
def test_serve_refuses_a_drain_timeout_that_is_not_finite_seconds(value, capsys):
    started = time.monotonic()
    assert main(["serve", "--model", "/nonexistent/model/folder", "--drain-timeout", value]) == 2
    err = capsys.readouterr().err
    assert f"error: argument --drain-timeout: expected a finite number of seconds >= 0, got {value!r}" in err
    assert time.monotonic() - started < 2


@pytest.mark.parametrize("value", [-5.0, math.nan, math.inf])
def test_settings_refuse_a_drain_timeout_that_is_not_finite_seconds(value):
    with pytest.raises(ValueError, match=f"^drain_timeout must be a finite number of seconds >= 0, got {value!r}$"):
        ServerSettings(drain_timeout=value)
    assert ServerSettings(drain_timeout=0).drain_timeout == 0


def _priority_error(answer: httpx.Response) -> str:
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "priority"
    return error["message"]


def test_priority_needs_priority_scheduling(server, runtime):
    """vLLM's rule: under fcfs (the default) a priority other than 0 is refused, 0 is accepted."""
    for path, body in [("/v1/embeddings", {"input": ["a cat"]}), ("/score", {"queries": "a", "documents": ["b"]})]:
        assert _priority_error(httpx.post(f"{server.url}{path}", json={**body, "priority": -1000})) == (
            "priority -1000 needs priority scheduling, which this server does not use: send 0 or leave it out, "
            "or ask the operator for --scheduling-policy priority")
    answer = httpx.post(f"{server.url}/v1/embeddings", json={"input": ["a cat"], "priority": 0})
    assert answer.status_code == 200
    assert answer.json()["data"][0]["embedding"] == pytest.approx(runtime.embed("a cat").tolist(), abs=2e-6)


def test_priority_scheduling_bounds_the_priority(runtime):
    with ServerThread(runtime, ServerSettings(scheduling_policy="priority")) as running:
        for value in (1001, -1001):
            assert _priority_error(httpx.post(f"{running.url}/v1/embeddings", json={
                "input": ["a cat"], "priority": value})) == f"priority {value} is out of range: -1000..1000"
        answer = httpx.post(f"{running.url}/v1/embeddings", json={"input": ["a cat"], "priority": -1000})
        assert answer.status_code == 200


def test_a_host_outside_allowed_hosts_is_refused(runtime):
    """A DNS-rebinding page reaches a loopback server under its own name in ``Host``: refused, on
    every path; the loopback names, with or without a port, are answered."""
    settings = ServerSettings(allowed_hosts=["localhost", "127.0.0.1", "::1"])
    with ServerThread(runtime, settings) as running, httpx.Client(base_url=running.url) as client:
        for path in ("/health", "/v1/models"):
            answer = client.get(path, headers={"host": "rebound.attacker.example:8000"})
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["message"] == (
                "the Host header 'rebound.attacker.example' is not one this server answers (allowed_hosts, the "
                "--allowed-hosts flag: localhost, 127.0.0.1, ::1)")
        for host in ("localhost", "LOCALHOST:8000", "127.0.0.1:1", "[::1]:8000"):
            assert client.get("/health", headers={"host": host}).status_code == 200, host
        answer = client.post("/v1/embeddings", json={"input": ["a cat"]})
        assert answer.json()["data"][0]["embedding"] == pytest.approx(runtime.embed("a cat").tolist(), abs=2e-6)


@pytest.mark.parametrize(("names", "allowed"), [
    (None, None), (["*"], None), (["API.example.com", "*.internal"], ("api.example.com", "*.internal")),
])
def test_allowed_hosts_settings(names, allowed):
    assert ServerSettings(allowed_hosts=names).allowed_hosts == allowed
    with pytest.raises(ValueError, match=r"^allowed_hosts must be one or more host names, got \[''\]$"):
        ServerSettings(allowed_hosts=[""])
