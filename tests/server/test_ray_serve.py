"""``poolrunner serve --ray-serve``: the server's app as two Ray Serve replicas on a local Ray cluster
(``ray.init(num_cpus=2)``), behind Ray Serve's HTTP proxy.

Every answer must equal the offline :meth:`Runtime.embed` of the same texts, both replicas must
serve, and when one replica is killed under load every request gets exactly one outcome: its own
correct answer, or the proxy's JSON 503 saying it was not answered (a 504 at the proxies' request
timeout, for one Ray's router lost); later requests fail over to the other replica, and Ray Serve
replaces the dead one.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import httpx
import numpy as np
import pytest

from poolrunner.core.cli.main import main
from poolrunner.core.distributed.replicas import (
    PROXY_CALLBACK,
    PROXY_CALLBACK_ENV,
    REPLICA_HEADER,
    REPLICA_LOST_MESSAGE,
    REPLICA_TIMEOUT_MESSAGE,
    ReplicaHeaderMiddleware,
    ReplicaLostMiddleware,
    _replica_error,
    deployment_options,
)
from poolrunner.core.errors import InvalidRequestError
from poolrunner.distributed import serve_replicas
from tests.server.process import free_port, wait_healthy

pytestmark = [
    pytest.mark.slow,
    # Ray Serve's own DeploymentConfig passes pydantic's deprecated Field extras (update_type=) as
    # `ray.serve` is first imported; nothing poolrunner does.
    pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecatedSince20:ray.serve._private.config"),
]

ATOL = 1e-5  # as the server's load test: batch composition changes float sums in the last bits
CLIENTS = 6
KEPT_UP_AFTER_KILL = 10
"""Requests answered from :data:`FAIL_OVER_S` after the kill on, before the load stops."""
FAIL_OVER_S = 2.0
REQUEST_TIMEOUT_S = 30.0
"""The proxies' request timeout here: a request Ray's router loses as it sends it again after the
kill gets its 504 then, well before the clients' own 120 s."""
"""Seconds after the kill within which Ray's proxies stop sending requests to the dead replica
(they hear of its death within milliseconds; CI's load makes it longer)."""


# --------------------------------------------------------------------------- without a cluster


def test_deployment_options_pass_autoscaling_through() -> None:
    fixed = deployment_options(num_replicas=3, num_cpus_per_replica=2, num_gpus_per_replica=0.5, drain_timeout=7)
    assert fixed == {"num_replicas": 3, "ray_actor_options": {"num_cpus": 2, "num_gpus": 0.5},
                     "max_ongoing_requests": 64, "graceful_shutdown_timeout_s": 7}
    scaled = deployment_options(num_replicas=2, autoscaling_config={"min_replicas": 1, "max_replicas": 4,
                                                                    "target_ongoing_requests": 8})
    assert "num_replicas" not in scaled
    assert scaled["autoscaling_config"] == {"initial_replicas": 2, "min_replicas": 1, "max_replicas": 4,
                                            "target_ongoing_requests": 8}
    assert deployment_options(autoscaling_config={"max_replicas": 4})["autoscaling_config"] == {"max_replicas": 4}


@pytest.mark.parametrize(("options", "message"), [
    ({"num_replicas": 0}, "^num_replicas must be a positive integer, got 0$"),
    ({"num_cpus_per_replica": 0}, "^num_cpus_per_replica must be a number > 0, got 0$"),
    ({"autoscaling_config": {"min_replicas": 3, "max_replicas": 1}},
     r"is invalid: .*max_replicas \(1\) must be greater than or equal to min_replicas \(3\)"),
    ({"autoscaling_config": {"max_replica": 3}}, r"^autoscaling_config has unknown keys max_replica \(known: "),
])
def test_bad_deployment_options_are_named(options: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        deployment_options(**options)


def test_replica_error_is_the_replicas_own_exception(monkeypatch) -> None:
    """Ray Serve's status message of a deployment whose replicas failed ends with the replica's traceback."""
    from ray import serve

    message = ("The deployment failed to start 3 times in a row. Error:\nRuntimeError: Traceback (most recent "
               "call last):\n  File \"replicas.py\", line 1, in __init__\npoolrunner.core.errors.ModelLoadError: "
               "model '/nowhere' is not a local model folder with a config.json")
    deployment = type("Deployment", (), {"message": message})
    application = type("Application", (), {"deployments": {"PoolrunnerReplica": deployment}})
    monkeypatch.setattr(serve, "status", lambda: type("Status", (), {"applications": {"app": application}}))
    assert _replica_error("app") == "ModelLoadError: model '/nowhere' is not a local model folder with a config.json"
    assert _replica_error("other") is None


def _call(middleware: Any, headers: list[tuple[bytes, bytes]] = ()) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(middleware({"type": "http", "path": "/v1/embeddings", "headers": list(headers)}, receive, send))
    return sent


def test_proxy_answers_a_request_its_replica_never_answered() -> None:
    async def lost(scope, receive, send) -> None:
        return None  # what Ray's proxy does when the replica died: no answer at all

    start, body = _call(ReplicaLostMiddleware(lost))
    assert start["status"] == 503 and (b"retry-after", b"1") in start["headers"]
    assert json.loads(body["body"]) == {"error": {"message": REPLICA_LOST_MESSAGE, "type": "service_unavailable",
                                                  "param": None, "code": 503}}


def test_proxy_timeout_is_a_json_504() -> None:
    async def timed_out(scope, receive, send) -> None:  # what Ray's proxy sends at its request_timeout_s
        await send({"type": "http.response.start", "status": 408, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"Request abc timed out after 30.0s."})

    start, body = _call(ReplicaLostMiddleware(timed_out))
    assert start["status"] == 504 and (b"retry-after", b"1") in start["headers"]
    assert json.loads(body["body"]) == {"error": {"message": REPLICA_TIMEOUT_MESSAGE, "type": "server_error",
                                                  "param": None, "code": 504}}


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), float("nan"), "5", True])
def test_bad_request_timeout_is_named_before_ray_starts(timeout) -> None:
    import ray

    with pytest.raises(InvalidRequestError, match=rf"^request_timeout must be a finite number of seconds > 0, "
                                                  rf"got {re.escape(repr(timeout))}$"):
        serve_replicas(request_timeout=timeout)
    assert not ray.is_initialized()


@pytest.mark.parametrize("timeout", ["0", "-1", "inf", "nan", "abc"])
def test_bad_request_timeout_flag_is_named_before_ray_starts(timeout, capsys) -> None:
    import ray

    assert main(["serve", "--ray-serve", "--ray-request-timeout", timeout]) == 2
    assert f"expected a finite number of seconds > 0, got '{timeout}'" in capsys.readouterr().err
    assert not ray.is_initialized()


def test_replica_header_names_the_replica_once_with_one_request_id() -> None:
    async def answer(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-request-id", b"r1")]})
        await send({"type": "http.response.body", "body": b"{}"})

    start, body = _call(ReplicaLostMiddleware(ReplicaHeaderMiddleware(answer, replica="abc")),
                        [(b"x-request-id", b"r1")])
    assert start["headers"] == [(REPLICA_HEADER.encode(), b"abc")]  # Ray's proxy adds x-request-id itself
    assert body["body"] == b"{}"
    start, _ = _call(ReplicaHeaderMiddleware(answer, replica="abc"), [(b"x-request-id", b"other")])
    assert (b"x-request-id", b"r1") in start["headers"]  # the app's own id, unlike the client's, stays


def test_ray_serve_flags_need_ray_serve(capsys) -> None:
    assert main(["serve", "--replicas", "2", "--max-replicas", "4", "--ray-request-timeout", "9"]) == 2
    assert "--replicas, --max-replicas, --ray-request-timeout need --ray-serve" in capsys.readouterr().err


def test_bad_autoscaling_flags_fail_before_ray_starts(capsys) -> None:
    import ray

    assert main(["serve", "--ray-serve", "--min-replicas", "3", "--max-replicas", "1"]) == 2
    assert "max_replicas (1) must be greater than or equal to min_replicas (3)" in capsys.readouterr().err
    assert not ray.is_initialized()


def test_runtime_lora_loading_is_refused_before_ray_starts(capsys, monkeypatch) -> None:
    """An adapter loaded at run time would reach the one replica that answered the call."""
    from poolrunner.core.distributed import replicas

    connected = []
    monkeypatch.setattr(replicas, "connect", lambda address: connected.append(address) or False)
    assert main(["serve", "--ray-serve", "--replicas", "2", "--allow-runtime-lora"]) == 2
    assert ("allow_runtime_lora (--allow-runtime-lora) is not served by Ray Serve replicas: an adapter loaded at run "
            "time would reach only the replica that answered the call") in capsys.readouterr().err
    assert connected == []


def test_serve_help_imports_neither_ray_nor_torch() -> None:
    code = ("import contextlib, io, json, sys\nfrom poolrunner.core.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
            "    main(['serve', '--help'])\n"
            "print(json.dumps(['--ray-serve' in out.getvalue(), [m for m in ('ray', 'torch') if m in sys.modules]]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(result.stdout.splitlines()[-1]) == [True, []]


@pytest.mark.parametrize("signalled_at", ["poolrunner: serving on", "poolrunner.core.loading: loaded"],
                         ids=["serving", "replica starting"])
def test_the_command_stops_cleanly_when_its_whole_process_group_is_signalled(signalled_at) -> None:
    """SIGTERM to the process group (``timeout``, systemd's control-group kill) reaches the local
    Ray instance the command started too: the command still exits 0, in seconds, not after Ray's
    minute of waiting for a GCS that is gone (exit 1); also while the replica is still starting
    (its model loaded, the deployment not yet done), when the half-deployed application would be
    removed."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "poolrunner", "serve", "--ray-serve", "--replicas", "1", "--port", str(port),
         "--dtype", "float32"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _line_with(process, signalled_at)
        began = time.monotonic()
        os.killpg(process.pid, signal.SIGTERM)
        _, stderr = process.communicate(timeout=50)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 0, stderr[-3000:]
    assert time.monotonic() - began < 40 and "Failed to connect to GCS" not in stderr


# --------------------------------------------------------------------------- two replicas on a local cluster


@pytest.fixture(scope="module")
def ray_cluster():
    """A local cluster whose proxies load :data:`PROXY_CALLBACK`, as README's ``ray start`` does;
    its address."""
    import ray
    from ray import serve

    saved = os.environ.get(PROXY_CALLBACK_ENV)
    os.environ[PROXY_CALLBACK_ENV] = PROXY_CALLBACK  # the cluster's processes inherit it as they start
    try:
        context = ray.init(num_cpus=2, include_dashboard=False)
    finally:
        if saved is None:
            os.environ.pop(PROXY_CALLBACK_ENV)
        else:
            os.environ[PROXY_CALLBACK_ENV] = saved
    yield context.address_info["gcs_address"]
    serve.shutdown()
    ray.shutdown()


def test_command_line_joins_a_cluster_and_serves_until_sigterm(ray_cluster, lee_docs, expected) -> None:
    """``poolrunner serve --ray-serve --ray-address`` joins the cluster (as on another node), takes
    the server's flags, and SIGTERM removes its application, leaving the cluster: exit status 0."""
    from ray import serve

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "poolrunner", "serve", "--ray-serve", "--ray-address", ray_cluster, "--replicas", "1",
         "--ray-request-timeout", str(REQUEST_TIMEOUT_S), "--port", str(port), "--dtype", "float32",
         "--served-model-name", "minilm", "--api-key", "key"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(process, url)
        serving = _line_with(process, "poolrunner: serving on")  # the replicas are up: SIGTERM removes them
        assert serving.startswith(f"poolrunner: serving on {url} (Ray Serve application 'poolrunner')")
        response = httpx.post(f"{url}/v1/embeddings", headers={"Authorization": "Bearer key"},
                              json={"model": "minilm", "input": [lee_docs[3]]}, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "minilm" and response.headers[REPLICA_HEADER]
        np.testing.assert_allclose(response.json()["data"][0]["embedding"], expected[3], atol=ATOL)
        assert httpx.post(f"{url}/v1/embeddings", json={"input": "x"}).status_code == 401
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr[-3000:]
    assert "poolrunner" not in serve.status().applications


def _line_with(process: subprocess.Popen, text: str) -> str:
    """The first line of the process's stderr (read from where it is) that holds ``text`` (a
    replica's log lines, which Ray forwards, begin with the replica's name)."""
    while line := process.stderr.readline():
        if text in line:
            return line
    raise AssertionError(f"the process ended without a line holding {text!r}")


@pytest.fixture(scope="module")
def replicas(ray_cluster):
    with serve_replicas(num_replicas=2, port=free_port(), runtime_options={"dtype": "float32"},
                        request_timeout=REQUEST_TIMEOUT_S) as served:
        yield served


@pytest.fixture(scope="module")
def expected(runtime, lee_docs) -> np.ndarray:
    """The offline API's embedding of each Lee document (the same model, float32)."""
    return runtime.embed(lee_docs)


class Load:
    """Clients sending ``/v1/embeddings`` requests one after another, each request two Lee
    documents and a unique ``request_id``; every outcome is recorded under that id."""

    def __init__(self, url: str, docs: list[str]) -> None:
        self.url = url
        self.docs = docs
        self.outcomes: dict[str, list[dict[str, Any]]] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def request(self, client: httpx.Client, request_id: str, first: int) -> dict[str, Any]:
        indices = [first % len(self.docs), (first + 7) % len(self.docs)]
        started = time.monotonic()
        try:
            response = client.post(f"{self.url}/v1/embeddings", json={
                "input": [self.docs[i] for i in indices], "request_id": request_id})
        except httpx.HTTPError as exc:  # a transport error is neither an answer nor a clear error
            return {"started": started, "error": repr(exc)}
        return {"started": started, "indices": indices, "status": response.status_code,
                "replica": response.headers.get(REPLICA_HEADER), "retry_after": response.headers.get("retry-after"),
                "body": response.json()}

    def client(self, number: int, count: int | None) -> None:
        with httpx.Client(timeout=120) as client:
            sent = 0
            while not self.stop.is_set() and (count is None or sent < count):
                request_id = f"c{number}-{sent}"
                outcome = self.request(client, request_id, number * 1000 + sent)
                with self.lock:
                    self.outcomes.setdefault(request_id, []).append(outcome)
                sent += 1

    def run(self, count: int | None = None) -> list[threading.Thread]:
        threads = [threading.Thread(target=self.client, args=(number, count)) for number in range(CLIENTS)]
        for thread in threads:
            thread.start()
        return threads

    def answered_by(self, replica: str | None = None, after: float = 0.0) -> list[dict[str, Any]]:
        with self.lock:
            return [outcome for outcomes in self.outcomes.values() for outcome in outcomes
                    if outcome.get("status") == 200 and outcome["started"] >= after
                    and replica in (None, outcome["replica"])]


def assert_correct(request_id: str, outcome: dict[str, Any], expected: np.ndarray) -> None:
    assert outcome["body"]["id"] == f"embd-{request_id}", "an answer to another request"
    vectors = np.array([item["embedding"] for item in outcome["body"]["data"]], dtype=np.float32)
    np.testing.assert_allclose(vectors, expected[outcome["indices"]], atol=ATOL, err_msg=request_id)


def test_concurrent_requests_equal_the_offline_api_on_both_replicas(replicas, lee_docs, expected) -> None:
    load = Load(replicas.url, lee_docs)
    for thread in load.run(count=8):
        thread.join()
    assert len(load.outcomes) == CLIENTS * 8
    for request_id, (outcome,) in load.outcomes.items():
        assert outcome.get("status") == 200, outcome
        assert_correct(request_id, outcome, expected)
    served = Counter(outcome["replica"] for outcome in load.answered_by())
    assert len(served) == 2, served


def test_a_request_past_the_proxies_timeout_is_a_json_504(replicas, lee_docs, expected) -> None:
    """Past its timeout (here Ray's per-request ``x-request-timeout-seconds``) a request is
    answered the JSON 504, not Ray's plain-text 408; the next request is served."""
    with httpx.Client(timeout=120) as client:
        response = client.post(f"{replicas.url}/v1/embeddings", json={"input": lee_docs * 8},
                               headers={"x-request-timeout-seconds": "0.01"})
        assert response.status_code == 504, response.text
        assert response.json()["error"]["message"] == REPLICA_TIMEOUT_MESSAGE
        outcome = Load(replicas.url, lee_docs).request(client, "next", 0)
    assert outcome["status"] == 200
    assert_correct("next", outcome, expected)


def test_killing_a_replica_under_load(replicas, lee_docs, expected) -> None:
    """Requests in flight at the killed replica get the proxy's 503 (or, lost by Ray's router as it
    sent them again, the 504 of the proxies' timeout: never a hang); every other request, and
    every later one, is answered by the other replica; none gets two outcomes; Ray Serve starts a
    new replica, which serves."""
    import ray
    from ray.serve.context import _get_global_client

    assert _get_global_client().http_config.request_timeout_s == REQUEST_TIMEOUT_S

    load = Load(replicas.url, lee_docs)
    threads = load.run()
    try:
        victim = _wait_for(lambda: _busiest(load), "both replicas serving the load")
        killed_at = time.monotonic()
        ray.kill(ray.get_actor(_replica_actor(victim), namespace="serve"), no_restart=True)
        _wait_for(lambda: len(load.answered_by(after=killed_at + FAIL_OVER_S)) >= KEPT_UP_AFTER_KILL,
                  "answers after the kill")
    finally:
        load.stop.set()
        for thread in threads:
            thread.join()
    lost = []
    for request_id, outcomes in load.outcomes.items():
        assert len(outcomes) == 1, f"{request_id} got {len(outcomes)} outcomes"
        outcome = outcomes[0]
        if outcome.get("status") == 200:
            assert_correct(request_id, outcome, expected)
            continue
        assert outcome["started"] < killed_at + FAIL_OVER_S, f"sent after the kill, not failed over: {outcome}"
        if outcome.get("status") == 504:  # one Ray's router lost as it sent it again after the kill
            assert outcome["body"]["error"]["message"] == REPLICA_TIMEOUT_MESSAGE
        else:
            assert outcome.get("status") == 503 and outcome["retry_after"] == "1", outcome
            assert outcome["body"]["error"]["message"] == REPLICA_LOST_MESSAGE
        lost.append(request_id)
    assert len(lost) <= CLIENTS, lost  # at most those in flight at the victim
    late = load.answered_by(after=killed_at + FAIL_OVER_S)
    assert late and victim not in {outcome["replica"] for outcome in late}
    survivors = {outcome["replica"] for outcome in load.answered_by()} - {victim}
    with httpx.Client(timeout=120) as client:
        _wait_for(lambda: load.request(client, "after", 0)["replica"] not in {victim, *survivors},
                  "a new replica answering", timeout=90)


def _busiest(load: Load) -> str | None:
    """The replica with the most answers, once both have answered a few."""
    served = Counter(outcome["replica"] for outcome in load.answered_by())
    if len(served) < 2 or min(served.values()) < 3:
        return None
    return served.most_common(1)[0][0]


def _replica_actor(replica: str) -> str:
    """The Ray actor name of the replica whose id is ``replica`` (Ray Serve's ``#``-joined names)."""
    import ray

    names = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)]
    (name,) = [name for name in names if name.startswith("SERVE_REPLICA::") and name.endswith(f"#{replica}")]
    return name


def _wait_for(check: Any, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return result
