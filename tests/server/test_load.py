"""Many clients at once: batching under load, a full queue (429) and clients that go away.

Every answer is compared with the offline ``Runtime`` API's answer for the same request.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import re
import socket
import time
from typing import Any

import httpx
import numpy as np
import pytest

from poolrunner import RerankResult
from poolrunner.core.server import ServerSettings
from poolrunner.core.similarity import similarity_pairwise
from poolrunner.core.testing.server import ServerThread

CLIENTS = int(os.environ.get("POOLRUNNER_LOAD_CLIENTS", "64"))
REQUESTS_PER_CLIENT = int(os.environ.get("POOLRUNNER_LOAD_REQUESTS", "10"))
ATOL = 1e-5  # batch composition changes float sums in the last bits


@pytest.fixture(scope="module")
def sentences(lee_docs) -> list[str]:
    """Short, distinct news sentences (5..40 words)."""
    found = {s.strip() for doc in lee_docs for s in doc.split(". ") if 5 <= len(s.split()) <= 40}
    return sorted(found)[:120]


def _specs(sentences: list[str], count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` mixed requests: embeddings (float, base64), score, rerank and pooling."""
    rng = random.Random(seed)
    specs = []
    for _ in range(count):
        kind = rng.choice(["embed_float", "embed_base64", "score", "rerank", "pooling"])
        texts = rng.sample(sentences, rng.randint(1, 4))
        specs.append({"kind": kind, "texts": texts, "query": rng.choice(sentences)})
    return specs


def _offline(runtime: Any, specs: list[dict[str, Any]]) -> list[np.ndarray]:
    """Each spec's answer from the offline API: ``Runtime.embed`` vectors (one call for all texts), and
    ``Runtime.score`` / ``Runtime.rerank`` for a sample, the rest from the same cosine over those vectors."""
    texts = sorted({text for spec in specs for text in [*spec["texts"], spec["query"]]})
    vectors = dict(zip(texts, runtime.embed(texts), strict=True))
    expected = []
    for number, spec in enumerate(specs):
        embedded = np.stack([vectors[text] for text in spec["texts"]])
        scores = similarity_pairwise(np.tile(vectors[spec["query"]], (len(embedded), 1)), embedded, "cosine")
        if number < 40 and spec["kind"] == "score":
            np.testing.assert_allclose(runtime.score(spec["query"], spec["texts"]), scores, atol=ATOL)
        if spec["kind"] == "rerank":
            ranked = runtime.rerank(spec["query"], spec["texts"], top_n=2) if number < 40 else [
                RerankResult(index=i, score=float(scores[i])) for i in np.argsort(-scores, kind="stable")[:2]]
            expected.append(np.array([[r.index, r.score] for r in ranked]))
        else:
            expected.append(scores if spec["kind"] == "score" else embedded)
    return expected


def _http(spec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    kind, texts = spec["kind"], spec["texts"]
    if kind.startswith("embed"):
        return "/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": texts, "encoding_format": kind[6:]}
    if kind == "score":
        return "/score", {"text_1": spec["query"], "text_2": texts}
    if kind == "rerank":
        return "/rerank", {"query": spec["query"], "documents": texts, "top_n": 2}
    return "/pooling", {"input": texts}


def _answer(spec: dict[str, Any], body: dict[str, Any]) -> np.ndarray:
    kind = spec["kind"]
    if kind == "embed_base64":
        return np.stack([np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in body["data"]])
    if kind == "embed_float":
        return np.array([item["embedding"] for item in body["data"]])
    if kind == "pooling":
        return np.array([item["data"] for item in body["data"]])
    if kind == "score":
        return np.array([item["score"] for item in body["data"]])
    return np.array([[item["index"], item["relevance_score"]] for item in body["results"]])


def _check(spec: dict[str, Any], body: dict[str, Any], expected: np.ndarray) -> None:
    got = _answer(spec, body)
    assert got.shape == expected.shape, (spec, got.shape, expected.shape)
    if spec["kind"] == "rerank":  # order must match; near-ties could swap only within ATOL
        np.testing.assert_allclose(got[:, 1], expected[:, 1], atol=ATOL)
        assert list(got[:, 0]) == list(expected[:, 0]) or np.ptp(expected[:, 1]) < ATOL
    else:
        np.testing.assert_allclose(got, expected, atol=ATOL)


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_64_clients_get_every_answer_once_and_share_steps(runtime, sentences, capsys, poolrunner_step_recorder):
    log = poolrunner_step_recorder(runtime)
    specs = _specs(sentences, CLIENTS * REQUESTS_PER_CLIENT, seed=1)
    expected = _offline(runtime, specs)
    answers: list[list[Any]] = [[] for _ in specs]
    latencies: list[float] = []

    async def client(http: httpx.AsyncClient, first: int) -> None:
        for number in range(first, len(specs), CLIENTS):  # each client runs its share in sequence
            path, payload = _http(specs[number])
            began = time.perf_counter()
            response = await http.post(path, json=payload)
            latencies.append(time.perf_counter() - began)
            answers[number].append(response)

    async def main(url: str) -> float:
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as http:
            began = time.perf_counter()
            await asyncio.gather(*(client(http, first) for first in range(CLIENTS)))
            return time.perf_counter() - began

    with ServerThread(runtime) as running:
        wall = asyncio.run(main(running.url))
        metrics = httpx.get(f"{running.url}/metrics").text
        assert running.serving.pending == 0 and not log.in_flight
    errors = [(number, r.status_code) for number, got in enumerate(answers) for r in got if r.status_code != 200]
    assert not errors
    assert all(len(got) == 1 for got in answers)  # exactly one answer per request
    for spec, got, want in zip(specs, answers, expected, strict=True):
        _check(spec, got[0].json(), want)
    steps = _metric(metrics, "poolrunner_batch_size_count")
    inputs = _metric(metrics, "poolrunner_batch_size_sum")
    multi_client_steps = steps - _metric(metrics, 'poolrunner_batch_size_bucket{le="4.0"}')
    # No request has more than 4 inputs: a step with more ran several clients' requests together.
    assert multi_client_steps > 0 and inputs / steps > 4
    p50, p99 = np.percentile(latencies, [50, 99])
    with capsys.disabled():
        print(f"\nload test: {len(specs)} requests, {CLIENTS} concurrent clients, {len(errors)} errors, "
              f"{wall:.1f} s, {len(specs) / wall:.0f} req/s, p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, "
              f"{int(steps)} steps, mean batch {inputs / steps:.1f} inputs, {int(multi_client_steps)} steps "
              "with more than 4 inputs")


def test_a_full_queue_answers_429_at_once_and_loses_nothing(runtime, sentences, poolrunner_step_recorder):
    log = poolrunner_step_recorder(runtime)
    specs = [{"kind": "embed_float", "texts": sentences[i : i + 4], "query": ""} for i in range(0, 96, 2)]
    expected = _offline(runtime, specs)
    settings = ServerSettings(max_waiting_requests=8, max_inputs_per_request=4)

    async def burst(url: str) -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=len(specs))
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as http:
            return await asyncio.gather(*(http.post(_http(spec)[0], json=_http(spec)[1]) for spec in specs))

    with ServerThread(runtime, settings) as running:
        responses = asyncio.run(burst(running.url))
        statuses = [r.status_code for r in responses]
        assert set(statuses) == {200, 429}, statuses
        for spec, response, want in zip(specs, responses, expected, strict=True):
            if response.status_code == 200:
                _check(spec, response.json(), want)
            else:
                assert re.fullmatch(r"the request queue is full: \d+ requests are waiting or running and 4 more "
                                    r"would pass the limit of 8 \(max_pending; the server's --max-waiting-requests\); "
                                    r"retry later", response.json()["error"]["message"])
                assert response.headers["retry-after"] == "1"
        assert running.serving.pending == 0 and not log.in_flight
        metrics = httpx.get(f"{running.url}/metrics").text
        rejected = statuses.count(429)
        assert f'poolrunner_requests_total{{endpoint="/v1/embeddings",status="429"}} {rejected}.0' in metrics
        # Queued work is never dropped: every input the server accepted was computed exactly once.
        assert _metric(metrics, "poolrunner_inference_time_seconds_count") == 4 * statuses.count(200)
        retry = [n for n, status in enumerate(statuses) if status == 429][:4]
        for number in retry:  # a rejected request succeeds once the queue has room
            response = httpx.post(f"{running.url}/v1/embeddings", json=_http(specs[number])[1])
            _check(specs[number], response.json(), expected[number])


def test_a_client_that_disconnects_leaves_no_state(runtime, lee_long_docs, sanity_reference,
                                                    poolrunner_step_recorder):
    log = poolrunner_step_recorder(runtime)
    texts = lee_long_docs * 40  # 400 inputs of 256 tokens: seconds of work on a CPU
    body = json.dumps({"input": texts, "truncate_prompt_tokens": -1}).encode()
    with ServerThread(runtime) as running:
        host, port = running.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as raw:
            raw.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            deadline = time.monotonic() + 30
            while not log.admitted:  # wait until its requests are in the engine's steps, not only queued
                assert time.monotonic() < deadline
                time.sleep(0.005)
        deadline = time.monotonic() + 10
        while running.serving.pending or log.in_flight:
            assert time.monotonic() < deadline, "the disconnected client's requests were not aborted"
            time.sleep(0.01)
        metrics = httpx.get(f"{running.url}/metrics").text
        assert 'poolrunner_requests_total{endpoint="/v1/embeddings",status="499"} 1.0' in metrics
        assert _metric(metrics, "poolrunner_inference_time_seconds_count") < len(texts)  # aborted, not finished
        assert log.admitted and not log.in_flight  # every request it sent entered the engine and left it
        vector = httpx.post(f"{running.url}/v1/embeddings", json={"input": "The quick brown fox jumps over the "
                            "lazy dog near the river bank."}).json()["data"][0]["embedding"]
        np.testing.assert_allclose(vector, sanity_reference, atol=1e-5)
