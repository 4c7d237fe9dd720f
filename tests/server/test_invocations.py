"""SageMaker's ``POST /invocations``: vLLM's bodies go to the route whose body they are (as vLLM
dispatches them), TEI's (``inputs``) to TEI's model route; each answer equals that route's."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

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
