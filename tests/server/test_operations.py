"""Running the server as operators run TEI and vLLM: settings from the environment, access logs
that never hold a request's text or key, CORS, open metrics, request ids, local docs assets."""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import subprocess
import sys

import httpx
import numpy as np
import pytest

from poolrunner.core.cli.main import build_parser, main
from poolrunner.core.server import ServerSettings, create_app
from poolrunner.core.server import serve as serving
from poolrunner.core.testing.server import ServerThread
from tests.helpers import MIN_COSINE, cosine_rows
from tests.server.process import free_port, wait_healthy

SECRET_TEXT = "the quarterly numbers of project bluebird"
KEY = "op-key-9876"


@pytest.mark.slow
def test_a_server_configured_only_from_the_environment_logs_json_without_text_or_key(st_model):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "POOLRUNNER_PORT": str(port), "POOLRUNNER_API_KEY": KEY, "POOLRUNNER_DTYPE": "float32",
           "POOLRUNNER_SERVED_MODEL_NAME": "minilm,text-embedding-ada-002", "POOLRUNNER_LOG_FORMAT": "json",
           "POOLRUNNER_LOAD_ENTRYPOINTS": "false", "POOLRUNNER_ALLOWED_ORIGINS": "https://app.example"}
    process = subprocess.Popen([sys.executable, "-m", "poolrunner", "serve"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    headers = {"Authorization": f"Bearer {KEY}", "X-Request-Id": "client-req-1"}
    try:
        wait_healthy(process, url)
        assert httpx.get(f"{url}/v1/models").status_code == 401
        models = httpx.get(f"{url}/v1/models", headers=headers).json()
        assert [card["id"] for card in models["data"]] == ["minilm", "text-embedding-ada-002"]
        answer = httpx.post(f"{url}/v1/embeddings", headers=headers,
                            json={"input": [SECRET_TEXT], "model": "minilm", "encoding_format": "float"})
        assert answer.status_code == 200 and answer.headers["x-request-id"] == "client-req-1"
        expected = st_model.encode([SECRET_TEXT], convert_to_numpy=True)
        assert cosine_rows(np.array([answer.json()["data"][0]["embedding"]]), expected).min() >= MIN_COSINE
        assert httpx.get(f"{url}/metrics").status_code == 200  # open by default
        preflight = httpx.options(f"{url}/v1/embeddings", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=60)
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert len(lines) == len(stderr.splitlines()), stderr  # every line is one JSON object
    assert any(line["logger"] == "poolrunner.core.loading" and line["message"].startswith("loaded ")
               for line in lines), "poolrunner's own load log is missing"
    [access] = [line for line in lines if line.get("route") == "/v1/embeddings"]
    assert {k: access[k] for k in ("request_id", "method", "status", "inputs", "level")} == {
        "request_id": "client-req-1", "method": "POST", "status": 200, "inputs": 1, "level": "INFO"}
    assert access["tokens"] == len(st_model.tokenizer(SECRET_TEXT)["input_ids"])
    assert access["latency_ms"] > 0
    assert "bluebird" not in stderr and KEY not in stderr


def _parse(argv: list[str], monkeypatch, **env: str):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return build_parser().parse_args(argv)


def test_a_flag_wins_over_its_variable_which_wins_over_the_default(monkeypatch):
    assert _parse(["serve"], monkeypatch).max_num_seqs == 256
    assert _parse(["serve"], monkeypatch, POOLRUNNER_MAX_NUM_SEQS="8").max_num_seqs == 8
    assert _parse(["serve", "--max-num-seqs", "4"], monkeypatch).max_num_seqs == 4
    args = _parse(["serve"], monkeypatch, POOLRUNNER_PROTECT_METRICS="yes", POOLRUNNER_AUTO_TRUNCATE="false",
                  POOLRUNNER_ALLOWED_ORIGINS="https://a.example, https://b.example")
    assert (args.protect_metrics, args.auto_truncate) == (True, False)
    assert args.allowed_origins == ["https://a.example", "https://b.example"]


def test_help_names_each_variable(capsys):
    assert main(["serve", "--help"]) == 0
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    for name in ("POOLRUNNER_PORT", "POOLRUNNER_API_KEY", "POOLRUNNER_MODEL", "POOLRUNNER_LOG_FORMAT"):
        assert f"[env: {name}]" in text


@pytest.mark.parametrize(("name", "value", "message"), [
    ("POOLRUNNER_MAX_NUM_SEQS", "many", "$POOLRUNNER_MAX_NUM_SEQS='many': expected a positive integer, got 'many'"),
    ("POOLRUNNER_PROTECT_METRICS", "maybe", "$POOLRUNNER_PROTECT_METRICS='maybe': expected true or false"),
    ("POOLRUNNER_LOG_FORMAT", "xml", "$POOLRUNNER_LOG_FORMAT='xml': must be one of text, json"),
    ("POOLRUNNER_PORT", "abc", "$POOLRUNNER_PORT='abc': expected int"),
])
def test_an_invalid_variable_stops_the_server_before_loading(monkeypatch, capsys, name, value, message):
    monkeypatch.setenv(name, value)
    assert main(["serve"]) == 2
    assert message in capsys.readouterr().err
    monkeypatch.delenv(name)
    assert _parse(["serve"], monkeypatch).port == 8000  # the next start reads a clean environment


@pytest.fixture(scope="module")
def guarded(runtime):
    settings = ServerSettings(api_key=KEY, allowed_origins=("https://app.example",))
    with ServerThread(runtime, settings) as running:
        yield running


def test_metrics_are_open_and_time_each_request_by_endpoint(guarded):
    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{guarded.url}/v1/embeddings", json={"input": "timed"}, headers=headers).status_code == 200
    text = httpx.get(f"{guarded.url}/metrics").text
    count = re.search(r'^poolrunner_http_request_duration_seconds_count\{endpoint="/v1/embeddings"\} (\S+)$',
                      text, re.MULTILINE)
    assert count is not None and float(count.group(1)) >= 1
    for gauge in ("poolrunner_num_requests_running", "poolrunner_num_requests_waiting"):
        assert re.search(rf"^{gauge} 0\.0$", text, re.MULTILINE), gauge  # idle: nothing running or waiting


def test_protect_metrics_puts_metrics_behind_the_key(runtime):
    with ServerThread(runtime, ServerSettings(api_key=KEY, protect_metrics=True)) as running:
        assert httpx.get(f"{running.url}/metrics").status_code == 401
        assert httpx.get(f"{running.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_cors_answers_preflights_for_allowed_origins_only(guarded, server):
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    allowed = httpx.options(f"{guarded.url}/v1/embeddings", headers={"Origin": "https://app.example", **ask})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(f"{guarded.url}/v1/embeddings", headers={"Origin": "https://evil.example", **ask})
    assert "access-control-allow-origin" not in other.headers
    plain = httpx.post(f"{server.url}/v1/embeddings", json={"input": "x"}, headers={"Origin": "https://app.example"})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers  # off by default


def test_a_request_id_is_echoed_only_when_it_is_a_plain_token(server):
    echoed = httpx.get(f"{server.url}/v1/models", headers={"X-Request-Id": "abc-123"})
    assert echoed.headers["x-request-id"] == "abc-123"
    replaced = httpx.get(f"{server.url}/v1/models", headers={"X-Request-Id": "a b\u00e9".encode("latin-1") * 30})
    assert re.fullmatch(r"[0-9a-f]{16}", replaced.headers["x-request-id"])


def test_the_access_line_has_counts_and_never_the_text_or_key(guarded, caplog):
    with caplog.at_level(logging.INFO, logger="poolrunner.access"):
        answer = httpx.post(f"{guarded.url}/v1/embeddings", json={"input": [SECRET_TEXT, "two"]},
                            headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "access-ok"})
        refused = httpx.post(f"{guarded.url}/v1/embeddings", json={"input": SECRET_TEXT},
                             headers={"Authorization": "Bearer wrong-key", "X-Request-Id": "access-denied"})
        tokenized = httpx.post(f"{guarded.url}/tokenize", json={"prompt": SECRET_TEXT},
                               headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "access-tokenize"})
        tei = httpx.post(f"{guarded.url}/tokenize", json={"inputs": [SECRET_TEXT, "two"]},
                         headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "access-tei"})
    assert (answer.status_code, refused.status_code, tokenized.status_code, tei.status_code) == (200, 401, 200, 200)
    by_id = {r.request_id: r for r in caplog.records if r.name == "poolrunner.access"}
    ok, denied = by_id["access-ok"], by_id["access-denied"]
    assert (ok.status, ok.inputs, ok.tokens, ok.route) == (200, 2, answer.json()["usage"]["prompt_tokens"],
                                                           "/v1/embeddings")
    assert (denied.status, denied.inputs) == (401, 0)
    assert (by_id["access-tokenize"].inputs, by_id["access-tokenize"].tokens) == (1, tokenized.json()["count"])
    assert (by_id["access-tei"].inputs, by_id["access-tei"].tokens) == (2, sum(map(len, tei.json())))
    logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "bluebird" not in logged and KEY not in logged and "wrong-key" not in logged


@pytest.mark.parametrize("fixture", ["server", "guarded"])
def test_docs_pages_load_their_assets_from_the_server_without_the_key(request, fixture):
    running = request.getfixturevalue(fixture)  # guarded has an API key: a browser cannot send it
    for page in ("/docs", "/redoc"):
        html = httpx.get(f"{running.url}{page}").text
        assets = re.findall(r'(?:src|href)="([^"]+\.(?:js|css))"', html)
        assert assets and all(asset.startswith("/") for asset in assets), assets  # no CDN URL
        for asset in assets:
            assert httpx.get(f"{running.url}{asset}").status_code == 200
    assert httpx.get(f"{running.url}/openapi.json").json()["info"]["title"] == "poolrunner"
    assert httpx.post(f"{running.url}/v1/embeddings", json={"input": "x"}).status_code == (
        401 if fixture == "guarded" else 200)


def test_the_serve_command_freezes_the_loaded_models_before_it_listens(runtime, monkeypatch):
    seen = {}

    def run(server) -> None:  # instead of listening: is the loaded model out of the collector's reach?
        seen["collectable"] = any(obj is runtime for generation in range(3) for obj in gc.get_objects(generation))

    monkeypatch.setattr(serving.DrainingServer, "run", run)
    monkeypatch.setattr(serving, "log_config", lambda *args: None)  # pytest's logging stays as it is
    try:
        serving.serve(create_app(runtime), host="127.0.0.1", port=0, drain_timeout=1.0)
    finally:
        gc.unfreeze()
    assert seen == {"collectable": False}
