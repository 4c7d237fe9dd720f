"""SageMaker's ``POST /invocations``: vLLM's bodies go to the route whose body they are (as vLLM
dispatches them), TEI's (``inputs``) to TEI's model route; each answer equals that route's."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from poolrunner.core.testing.server import ServerThread

TEXTS = ["A man is eating food.", "A cheetah chases its prey across a field."]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


@pytest.mark.parametrize(("body", "route"), [
    ({"input": TEXTS}, "/v1/embeddings"),
    ({"queries": TEXTS[0], "documents": TEXTS}, "/score"),
    ({"text_1": TEXTS[0], "text_2": TEXTS}, "/score"),
    ({"query": TEXTS[0], "documents": TEXTS, "return_documents": True}, "/rerank"),
    ({"input": TEXTS, "task": "token_embed"}, "/pooling"),
])
def test_vllm_bodies_get_their_route_answer(server, runtime, body, route):
    answer = _post(server, "/invocations", body)
    assert answer.status_code == 200, answer.text
    expected = _post(server, route, body).json()
    for key in ("data", "results", "usage"):
        if key in expected:
            assert answer.json()[key] == expected[key]
    if route == "/v1/embeddings":  # and that route is the Python API's
        vectors = np.array([item["embedding"] for item in answer.json()["data"]], dtype=np.float32)
        np.testing.assert_allclose(vectors, runtime.embed(TEXTS), rtol=0, atol=1e-6)


def test_a_tei_body_gets_tei_answer(server):
    answer = _post(server, "/invocations", {"inputs": TEXTS})
    assert answer.status_code == 200
    assert answer.json() == _post(server, "/embed", {"inputs": TEXTS}).json()
    empty = _post(server, "/invocations", {"inputs": []})
    assert (empty.status_code, empty.json()) == (400, {"error": "inputs is empty: send at least one input",
                                                       "error_type": "Empty"})


def test_a_body_of_no_route_is_a_400_and_the_server_still_serves(server, runtime):
    answer = _post(server, "/invocations", {"prompt": "hello", "max_tokens": 5})
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == (
        "/invocations takes the body of one of EmbeddingRequest, ScoreRequest, RerankRequest, PoolingHttpRequest, "
        "or TEI's (inputs); this body is none of them")
    again = _post(server, "/invocations", {"input": TEXTS[0], "encoding_format": "float"}).json()
    np.testing.assert_allclose(again["data"][0]["embedding"], runtime.embed(TEXTS[0]), rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- the whole answer, every body kind

QUERY = "Fires threaten homes in Australia."
DOCUMENTS = ["Bushfires are burning out of control near Sydney.", "Shares dropped at the start of the week."]
EMBED_BODIES = [  # (body, the route it is answered as): every kind /invocations takes from an embedding model
    ({"input": TEXTS, "request_id": "a"}, "/v1/embeddings"),
    ({"input": TEXTS[0], "encoding_format": "base64", "request_id": "a"}, "/v1/embeddings"),
    ({"input": TEXTS, "encoding_format": "bytes", "request_id": "a"}, "/v1/embeddings"),
    *(({first: QUERY, second: DOCUMENTS, "request_id": "a"}, "/score")
      for first, second in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
                            ("text_1", "text_2"))),
    ({"queries": DOCUMENTS, "documents": TEXTS, "request_id": "a"}, "/score"),
    ({"query": QUERY, "documents": DOCUMENTS, "request_id": "a"}, "/rerank"),
    ({"query": QUERY, "documents": [{"text": DOCUMENTS[0], "title": "t"}, DOCUMENTS[1]], "return_documents": True,
      "top_n": 1, "request_id": "a"}, "/rerank"),
    ({"query": QUERY, "texts": DOCUMENTS}, "/rerank"),
    ({"query": QUERY, "texts": DOCUMENTS, "return_text": True}, "/rerank"),
    ({"input": TEXTS, "task": "token_embed", "request_id": "a"}, "/pooling"),
    ({"input": TEXTS, "task": "embed", "dimensions": 8, "request_id": "a"}, "/pooling"),
    ({"inputs": TEXTS}, "/"),
    ({"inputs": TEXTS, "normalize": False}, "/embed"),
    ({"inputs": {"source_sentence": QUERY, "sentences": DOCUMENTS}}, "/similarity"),
    # errors too: each in its route's shape
    ({"query": QUERY, "documents": DOCUMENTS, "top_n": -1}, "/rerank"),
    ({"query": QUERY, "texts": []}, "/rerank"),
    ({"queries": QUERY, "documents": []}, "/score"),
    ({"input": [""]}, "/v1/embeddings"),
    ({"inputs": [""]}, "/embed"),
]
CROSS_ENCODER_BODIES = [  # and from a cross-encoder (a one-label classifier), which also takes classify bodies
    ({"input": TEXTS, "request_id": "a"}, "/classify"),
    ({"input": [[QUERY, DOCUMENTS[0]]], "request_id": "a"}, "/classify"),
    ({"queries": QUERY, "documents": DOCUMENTS, "request_id": "a"}, "/score"),
    ({"query": QUERY, "documents": DOCUMENTS, "return_documents": True, "request_id": "a"}, "/rerank"),
    ({"query": QUERY, "texts": DOCUMENTS, "raw_scores": True}, "/rerank"),
    ({"input": TEXTS, "task": "classify", "request_id": "a"}, "/pooling"),
    ({"inputs": [[QUERY, DOCUMENTS[0]]]}, "/"),
    ({"inputs": TEXTS[0]}, "/predict"),
]


@pytest.fixture(scope="module")
def cross_encoder(minilm_classifier_folder, classifier_runtime):
    with ServerThread(classifier_runtime(minilm_classifier_folder(1))) as running:
        yield running


def _same_answer(url: str, body: dict, route: str) -> None:
    """``body`` on ``/invocations`` answers exactly as on ``route``: status, content type, headers
    of the payload, and the whole body (the second-resolution ``created`` aside)."""
    with httpx.Client(base_url=url, timeout=60) as client:
        answer, expected = client.post("/invocations", json=body), client.post(route, json=body)
    assert (answer.status_code, answer.headers["content-type"]) == (expected.status_code,
                                                                       expected.headers["content-type"])
    if not expected.headers["content-type"].startswith("application/json"):
        assert answer.content == expected.content
        assert _without_created(answer.headers.get("metadata")) == _without_created(expected.headers.get("metadata"))
    else:
        assert _without_created(answer.text) == _without_created(expected.text)


def _without_created(text: str | None) -> object:
    value = None if text is None else json.loads(text)
    if isinstance(value, dict):
        value.pop("created", None)
    return value


@pytest.mark.parametrize(("body", "route"), EMBED_BODIES)
def test_every_body_is_answered_exactly_as_its_route(server, body, route):
    _same_answer(server.url, body, route)


@pytest.mark.parametrize(("body", "route"), CROSS_ENCODER_BODIES)
def test_a_cross_encoders_bodies_are_answered_exactly_as_their_routes(cross_encoder, body, route):
    _same_answer(cross_encoder.url, body, route)
