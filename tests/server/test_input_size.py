"""Big inputs over HTTP: the character limit's 400, and a 15 MB text (truncated) that does not slow
other clients down."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest

from poolrunner.core.frontend.requests import EncodeRequest, TokenizeRequest
from poolrunner.core.server import ServerSettings
from poolrunner.core.testing.server import ServerThread
from tests.conftest import SANITY_TEXT


@pytest.fixture(scope="module")
def big_server(runtime):
    """The default model; bodies up to 20 MB."""
    with ServerThread(runtime, ServerSettings(max_request_bytes=20_000_000)) as running:
        yield running


def test_an_input_over_the_character_limit_is_a_400_then_the_server_serves(big_server):
    with httpx.Client(base_url=big_server.url) as client:
        answer = client.post("/v1/embeddings", json={"input": ["fine", "word " * 1700]})
        assert answer.status_code == 400
        assert answer.json()["error"]["message"] == (
            "input 1 has 8500 characters, more than the limit of 8192 per input (max_input_chars, the "
            "--max-input-chars flag); shorten it, or pass truncate_prompt_tokens to read only the part kept")
        answer = client.post("/tokenize", json={"inputs": "word " * 1700})
        assert answer.status_code in (400, 413, 422) and "more than the limit of 8192 per input" in answer.text
        assert client.post("/v1/embeddings", json={"input": SANITY_TEXT}).status_code == 200


LIMIT_MESSAGE = "{where} has 9000 characters, more than the limit of 8192 per input (max_input_chars, the " \
                "--max-input-chars flag); "
NO_CUT = ("shorten it or raise the limit: truncating reads only its first 8192 characters, and they have no space "
          "between words at which 256 tokens can be cut exactly")


@pytest.mark.parametrize(("text", "cohere", "tei"), [
    ("word " * 1800, 'shorten it or send "truncate": "END" (or "START")', 'shorten it or send "truncate": true'),
    ("x" * 9000, NO_CUT, NO_CUT),  # truncating could not read it: the surfaces' own truncation is not advised
])
def test_surfaces_advise_their_truncation_only_where_it_would_read_the_text(big_server, text, cohere, tei):
    with httpx.Client(base_url=big_server.url) as client:
        answer = client.post("/v2/embed", json={"texts": [text[:9000]], "input_type": "search_document",
                                                "embedding_types": ["float"], "truncate": "NONE"})
        assert answer.status_code == 400
        assert answer.json()["error"]["message"] == LIMIT_MESSAGE.format(where="texts[0]") + cohere
        answer = client.post("/embed", json={"inputs": [text[:9000]], "truncate": False})
        assert answer.status_code == 422
        assert answer.json() == {"error": LIMIT_MESSAGE.format(where="input 0") + tei, "error_type": "Validation"}
        assert client.post("/v1/embeddings", json={"input": SANITY_TEXT}).status_code == 200


def test_a_15_mb_truncated_text_does_not_slow_other_requests(runtime, big_server, lee_docs):
    """Before, one such text held the tokenizer for 10-12 s (every other request waited) and took
    3.5 GB; now its window is read and small requests meanwhile answer as fast as alone."""
    big = (" ".join(lee_docs) + " ") * 620  # about 15 MB
    with httpx.Client(base_url=big_server.url, timeout=120) as client:
        alone = []
        for _ in range(5):
            began = time.perf_counter()
            assert client.post("/v1/embeddings", json={"input": "a small request"}).status_code == 200
            alone.append(time.perf_counter() - began)
        answers: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{big_server.url}/v1/embeddings", json={"input": big, "truncate_prompt_tokens": -1}, timeout=120)))
        sender.start()
        during = []
        while sender.is_alive() or len(during) < 5:
            began = time.perf_counter()
            assert client.post("/v1/embeddings", json={"input": "a small request"}).status_code == 200
            during.append(time.perf_counter() - began)
        sender.join()
        assert answers[0].status_code == 200, answers[0].text
        vector = np.array(answers[0].json()["data"][0]["embedding"])
        expected = runtime.embed(big[:20000], truncate_prompt_tokens=-1)
        np.testing.assert_allclose(vector, expected, atol=1e-6)
    assert len(big) > 15_000_000
    assert max(during) < max(1.0, 10 * max(alone)), (alone, during)


def test_per_token_outputs_over_the_limit_are_a_413_before_any_work(runtime):
    """Per-token outputs grow with tokens x hidden size: a request whose outputs would pass
    ``max_output_values`` is refused whole (413, naming the limit), in OpenAI's and TEI's shapes,
    and the server answers the next request."""
    texts = ["word " * 40, "word " * 40]
    tokens = sum(len(ids) for ids in runtime.tokenize(texts))
    settings = ServerSettings(max_output_values=tokens * 384 - 1)
    message = (f"this request's per-token outputs would hold {tokens * 384} values ({tokens} tokens x 384), more than "
               f"the limit of {tokens * 384 - 1} per request (max_output_values, the --max-output-values flag); "
               "send fewer or shorter inputs per request")
    with ServerThread(runtime, settings) as running, httpx.Client(base_url=running.url, timeout=60) as client:
        pooled = client.post("/pooling", json={"input": texts, "task": "token_embed"})
        assert (pooled.status_code, pooled.json()["error"]["message"]) == (413, message)
        tei = client.post("/embed_all", json={"inputs": texts})
        assert (tei.status_code, tei.json()) == (413, {"error": message, "error_type": "Validation"})
        one = client.post("/pooling", json={"input": texts[:1], "task": "token_embed"})
        assert one.status_code == 200
        np.testing.assert_allclose(one.json()["data"][0]["data"], runtime.encode(texts[:1], task="token_embed")[0],
                                   atol=2e-6)
        assert client.post("/v1/embeddings", json={"input": texts * 100}).status_code == 200  # one row per input


def test_short_texts_are_planned_on_the_event_loop_and_answer_as_sentence_transformers(big_server, st_model):
    """Embed and classify requests of texts up to INLINE_PLAN_CHARS in all are planned on the event
    loop, others in a worker thread; both answer sentence-transformers' vectors, and a bad short
    input is the same 400 as ever, after which the server serves."""
    service = big_server.app.state.router.default
    short, long = ["a short text", "another one"], ["word " * 250, "word " * 200]
    assert service.plans_inline(EncodeRequest(inputs=short, task="embed"))
    assert service.plans_inline(EncodeRequest(inputs=[("a question", "an answer")], task="embed"))
    assert not service.plans_inline(EncodeRequest(inputs=long, task="embed"))  # 2,250 characters
    assert not service.plans_inline(EncodeRequest(inputs=[[101, 2023, 102]], task="embed"))
    assert not service.plans_inline(TokenizeRequest(texts=short))
    with httpx.Client(base_url=big_server.url) as client:
        for texts in (short, long):
            answer = client.post("/v1/embeddings", json={"input": texts})
            assert answer.status_code == 200, answer.text
            vectors = np.array([item["embedding"] for item in answer.json()["data"]])
            np.testing.assert_allclose(vectors, st_model.encode(texts), atol=1e-5)
        answer = client.post("/v1/embeddings", json={"input": ["fine", ""]})
        assert answer.status_code == 400
        assert answer.json()["error"]["message"] == "input[1] is an empty string"
        assert client.post("/v1/embeddings", json={"input": SANITY_TEXT}).status_code == 200
