"""``/classify``, ``/score``, ``/rerank``, ``/pooling``, ``/tokenize``, ``/health``, ``/metrics``,
the request limits and validation, driven with httpx.

References: transformers (``ClassifierReference``, hidden states, tokenizer) and
sentence-transformers on the same weights; the offline ``Runtime`` for equality of answers.
"""

from __future__ import annotations

import base64
import json
import re
import time

import httpx
import numpy as np
import pytest

import poolrunner
from poolrunner.core.server import ServerSettings
from poolrunner.core.testing.server import ServerThread
from tests.conftest import SANITY_TEXT
from tests.helpers import MIN_COSINE, cosine_rows

TEXTS = ["A man is playing a guitar on the stage.", "The stock market fell sharply on Monday.",
         "Firefighters battle blazes in New South Wales."]
QUERY = "Fires threaten homes in Australia."
DOCUMENTS = ["Shares dropped at the start of the week.", "Bushfires are burning out of control near Sydney.",
             "Someone performs music in front of an audience.", "Firefighters battle blazes in New South Wales."]


def _error(answer: httpx.Response, status: int) -> str:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error["message"]


# --------------------------------------------------------------------------- classify, score, rerank


@pytest.fixture(scope="module")
def classifier(minilm_classifier_folder, classifier_runtime):
    folder = minilm_classifier_folder(3)
    with ServerThread(classifier_runtime(folder)) as running:
        yield running, folder


@pytest.fixture(scope="module")
def cross_encoder(minilm_classifier_folder, classifier_runtime):
    folder = minilm_classifier_folder(1)
    with ServerThread(classifier_runtime(folder)) as running:
        yield running, folder


def test_classify_matches_transformers(classifier, classifier_reference):
    running, folder = classifier
    answer = httpx.post(f"{running.url}/classify", json={"input": TEXTS})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    expected = classifier_reference(folder).scores(TEXTS)
    probs = np.array([item["probs"] for item in body["data"]])
    np.testing.assert_allclose(probs, expected, atol=1e-5)
    labels = ["alpha", "beta", "gamma"]
    assert [item["label"] for item in body["data"]] == [labels[i] for i in expected.argmax(1)]
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    assert {item["num_classes"] for item in body["data"]} == {3}
    raw = httpx.post(f"{running.url}/classify", json={"input": TEXTS[0], "use_activation": False}).json()
    np.testing.assert_allclose(raw["data"][0]["probs"], classifier_reference(folder).logits(TEXTS[:1])[0], atol=1e-5)


def test_cross_encoder_score_and_rerank_match_transformers(cross_encoder, classifier_reference, classifier_runtime):
    running, folder = cross_encoder
    pairs = [(QUERY, document) for document in DOCUMENTS]
    expected = classifier_reference(folder).scores(pairs)[:, 0]
    score = httpx.post(f"{running.url}/score", json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [item["index"] for item in score["data"]] == [0, 1, 2, 3]
    np.testing.assert_allclose([item["score"] for item in score["data"]], expected, atol=1e-5)
    rerank = httpx.post(f"{running.url}/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                                       "return_documents": True}).json()
    best = list(np.argsort(-expected, kind="stable")[:2])
    assert [item["index"] for item in rerank["results"]] == best
    assert [item["document"]["text"] for item in rerank["results"]] == [DOCUMENTS[i] for i in best]
    np.testing.assert_allclose([item["relevance_score"] for item in rerank["results"]], expected[best], atol=1e-5)
    offline = classifier_runtime(folder).rerank(QUERY, DOCUMENTS, top_n=2)
    assert [result.index for result in offline] == best
    assert "document" not in httpx.post(f"{running.url}/rerank", json={"query": QUERY, "documents": DOCUMENTS,
                                                                       "return_documents": False}).json()["results"][0]


def test_score_on_a_three_label_classifier_is_a_bad_request(classifier):
    running, _ = classifier
    message = _error(httpx.post(f"{running.url}/score", json={"text_1": "a", "text_2": "b"}), 400)
    assert message == ("score needs an embed model (bi-encoder) or a classify model with one label "
                       "(cross-encoder); this runtime serves 'classify' with 3 labels, and no plugin scores "
                       "'classify' outputs (see `poolrunner plugins --hook score_outputs`).")  # Runtime.score's own
    assert len(httpx.post(f"{running.url}/classify", json={"input": "a"}).json()["data"][0]["probs"]) == 3


def test_bi_encoder_score_and_rerank_are_sentence_transformers_cosine(server, st_model, runtime):
    query = st_model.encode(QUERY)
    documents = st_model.encode(DOCUMENTS)
    expected = cosine_rows(np.tile(query, (len(DOCUMENTS), 1)), documents)
    score = httpx.post(f"{server.url}/score", json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
    np.testing.assert_allclose([item["score"] for item in score["data"]], expected, atol=1e-5)
    np.testing.assert_allclose([item["score"] for item in score["data"]], runtime.score(QUERY, DOCUMENTS), atol=1e-6)
    rerank = httpx.post(f"{server.url}/rerank", json={"query": QUERY, "documents": DOCUMENTS}).json()
    assert [item["index"] for item in rerank["results"]] == list(np.argsort(-expected, kind="stable"))
    nn = httpx.post(f"{server.url}/score", json={"text_1": TEXTS[:2], "text_2": DOCUMENTS[:2]}).json()
    np.testing.assert_allclose([item["score"] for item in nn["data"]],
                               cosine_rows(st_model.encode(TEXTS[:2]), documents[:2]), atol=1e-5)


# --------------------------------------------------------------------------- pooling, tokenize, models


def test_pooling_embed_equals_the_offline_api(server, runtime):
    body = httpx.post(f"{server.url}/pooling", json={"input": TEXTS}).json()
    assert [item["object"] for item in body["data"]] == ["pooling"] * 3
    np.testing.assert_allclose([item["data"] for item in body["data"]], runtime.embed(TEXTS), atol=2e-6)


def test_pooling_per_token_outputs_match_transformers(hf_hidden, hf_tokenizer):
    runtime = poolrunner.Runtime(task="token_embed", dtype="float32")
    with ServerThread(runtime) as running:
        floats = httpx.post(f"{running.url}/pooling", json={"input": TEXTS}).json()["data"]
        packed = httpx.post(f"{running.url}/pooling", json={"input": TEXTS, "encoding_format": "base64"}).json()
        ids = [hf_tokenizer(text)["input_ids"] for text in TEXTS]
        states, _ = hf_hidden(ids)
        for row, (item, token_ids) in enumerate(zip(floats, ids, strict=True)):
            got = np.array(item["data"])
            assert got.shape == (len(token_ids), 384)
            assert cosine_rows(got, states[row, : len(token_ids)].numpy()).min() >= MIN_COSINE
            decoded = np.frombuffer(base64.b64decode(packed["data"][row]["data"]), dtype="<f4").reshape(got.shape)
            np.testing.assert_array_equal(decoded, got.astype(np.float32))


def test_tokenize_and_models(server, hf_tokenizer):
    body = httpx.post(f"{server.url}/tokenize", json={"prompt": SANITY_TEXT}).json()
    assert body["tokens"] == hf_tokenizer(SANITY_TEXT)["input_ids"]
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["data"][0]["id"] == "all-MiniLM-L6-v2" and models["data"][0]["task"] == "embed"
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and set(health) == {"status", "unix"}
    assert httpx.head(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/openapi.json").json()["paths"].keys() >= {"/v1/embeddings", "/rerank"}


def test_openapi_lists_every_route(server):
    assert httpx.get(f"{server.url}/openapi.json").json()["paths"].keys() == {
        "/v1/embeddings", "/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
        "/v2/rerank", "/v2/embed", "/v1/models", "/v1/models/{model_id}", "/models", "/tokenize", "/detokenize",
        "/health",
        "/metrics",
        "/embed", "/embed_all", "/embed_sparse", "/predict", "/similarity", "/decode", "/info", "/", "/invocations",
    }


def test_openapi_documents_the_error_bodies_the_server_answers(server):
    """Every operation's 4xx / 5xx is OpenAI's error body (TEI's on TEI's routes), as the server
    answers them; FastAPI's own 422 HTTPValidationError, which it never answers, is not listed."""
    spec = httpx.get(f"{server.url}/openapi.json").json()
    tei_paths = {"/embed", "/embed_all", "/embed_sparse", "/predict", "/similarity", "/decode", "/info", "/"}
    shared = {"/rerank", "/v1/rerank", "/v2/rerank", "/tokenize", "/invocations"}  # TEI's bodies too

    def named(schema: dict) -> set[str]:
        return {ref["$ref"].rsplit("/", 1)[1] for ref in schema.get("anyOf", [schema])}

    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            errors = {status: named(answer["content"]["application/json"]["schema"])
                      for status, answer in operation["responses"].items() if status[0] in "45"}
            expected = ({"TeiErrorAnswer"} if path in tei_paths else {"ErrorAnswer", "TeiErrorAnswer"}
                        if path in shared else {"ErrorAnswer"})
            assert errors == {"4XX": expected, "5XX": expected}, (method, path, errors)
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    refused = httpx.post(f"{server.url}/v1/embeddings", json={"input": 5})
    assert refused.status_code == 400 and set(refused.json()["error"]) == set(
        spec["components"]["schemas"]["ErrorDetail"]["properties"])
    refused = httpx.post(f"{server.url}/embed", json={"inputs": 5})
    assert refused.status_code == 422 and set(refused.json()) == set(
        spec["components"]["schemas"]["TeiErrorAnswer"]["properties"])


# --------------------------------------------------------------------------- validation and limits


BAD_REQUESTS = [
    ("malformed JSON", "/v1/embeddings", b'{"input": ["a",',
     "the request body is not valid JSON: Expecting value (at character 15)"),
    ("empty lone string", "/v1/embeddings", {"input": ""}, "input is an empty string"),
    ("no body", "/v1/embeddings", b"", "body: Field required (the request has no body: send a JSON object)"),
    ("not UTF-8", "/v1/embeddings", b'{"input": "\xff"}',
     "the request body is not valid JSON: 'utf-8' codec can't decode byte 0xff in position 11: invalid start byte"),
    ("nested too deeply", "/v1/embeddings", b"[" * 100_000,
     "the request body is not valid JSON: maximum recursion depth exceeded while decoding a JSON array"),
    ("integer of too many digits", "/v1/embeddings", b'{"input": [' + b"9" * 5000 + b"]}",
     "the request body holds an integer of more than 4,300 digits, more than its JSON can be read with"),
    ("wrong type", "/v1/embeddings", {"input": 5},
     "input must be a text, a token-id list, a (text, text_pair) pair, an image, or a list of them; got 5 (int)"),
    ("NaN (Python's JSON reads it)", "/v1/embeddings", b'{"input": NaN}',
     "input must be a text, a token-id list, a (text, text_pair) pair, an image, or a list of them; got nan (float)"),
    ("float token id", "/v1/embeddings", {"input": [101, 1.5, 102]},
     "input 0: the token id at position 1 is 1.5, not an integer"),
    ("null item", "/pooling", {"input": ["a", None]},
     "input 1: expected a text, a list of token ids or a (text, text_pair) pair, got None"),
    ("pair to embeddings", "/v1/embeddings", {"input": ["a", ["b", "c", "d"]]},
     "input 1: ['b', 'c', 'd'] is a list of texts, not one input: send texts as one flat list (a (text, text_pair) "
     "pair is a tuple in Python, a two-text list where the route reads pairs: /classify, /pooling)"),
    ("unknown field", "/v1/embeddings", {"input": "a", "colour": "red"},
     "colour: Extra inputs are not permitted (a field this server does not know is refused; "
     "--allow-extra-fields drops such fields instead)"),
    ("empty input", "/classify", {"input": []}, "input is empty"),
    ("unknown task", "/pooling", {"input": "a", "task": "Not a task!"}, "task must be one of"),
    ("plugin task not served", "/pooling", {"input": "a", "task": "nope"},
     "this model serves tasks ['embed', 'token_embed'], not 'nope'"),
    ("task not served", "/pooling", {"input": "a", "task": "classify"},
     "this model serves tasks ['embed', 'token_embed'], not 'classify': no installed plugin serves 'classify' "
     "for BertModel with this folder's files (it needs a classification head: a *ForSequenceClassification "
     "folder); `poolrunner plugins --all` lists what each plugin serves"),
    ("token task not served", "/pooling", {"input": "a", "task": "token_classify"},
     "this model serves tasks ['embed', 'token_embed'], not 'token_classify': no installed plugin serves "
     "'token_classify' for BertModel with this folder's files (it needs a token classification head: a "
     "*ForTokenClassification folder, or BGE-M3's sparse_linear.pt beside a backbone); `poolrunner plugins --all` "
     "lists what each plugin serves"),
    ("unsupported dimensions", "/v1/embeddings", {"input": "a", "dimensions": 8},
     "does not support Matryoshka dimensions"),
    ("zero dimensions", "/v1/embeddings", {"input": "a", "dimensions": 0}, "dimensions must be a positive integer"),
    ("too long, no truncation", "/v1/embeddings", {"input": ["a", "word " * 400]},
     "input 1 has 402 tokens, more than the maximum of 256"),
    ("bad truncation", "/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 0},
     "truncate_prompt_tokens=0 is out of range"),
    ("empty score side", "/score", {"text_1": "a", "text_2": []},
     "text_2 is empty: scoring needs at least one of each"),
    ("N:M score", "/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "cannot score 2 queries against 3"),
    ("bad top_n", "/rerank", {"query": "q", "documents": ["d"], "top_n": -2}, "top_n must be a positive integer"),
]


@pytest.mark.parametrize(("path", "payload", "message"), [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_requests_are_400_and_the_server_still_serves(server, runtime, sanity_reference, path, payload, message,
                                                         poolrunner_step_recorder):
    steps = poolrunner_step_recorder(runtime)
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    answer = httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json"})
    assert message in _error(answer, 400)
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert server.serving.pending == 0 and not steps.in_flight
    vector = httpx.post(f"{server.url}/v1/embeddings", json={"input": SANITY_TEXT}).json()["data"][0]["embedding"]
    assert cosine_rows(vector, sanity_reference)[0] >= MIN_COSINE


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_json_body_under_another_content_type_is_refused_naming_it(server, sanity_reference, content_type):
    """``curl -d`` sends form encoding, ``requests.post(data=...)`` no type: FastAPI then does
    not read JSON, and the answer says why, in OpenAI's shape and in TEI's."""
    headers = {} if content_type is None else {"content-type": content_type}
    sent = f"it came with Content-Type: {content_type}" if content_type else "it came without a Content-Type header"
    expected = f"the request body is read as JSON only when sent with Content-Type: application/json; {sent}"
    answer = httpx.post(f"{server.url}/v1/embeddings", content=json.dumps({"input": SANITY_TEXT}), headers=headers)
    assert _error(answer, 400) == expected
    answer = httpx.post(f"{server.url}/embed", content=json.dumps({"inputs": SANITY_TEXT}), headers=headers)
    assert answer.status_code == 422 and answer.json() == {"error": expected, "error_type": "Validation"}
    vector = httpx.post(f"{server.url}/v1/embeddings", json={"input": SANITY_TEXT}).json()["data"][0]["embedding"]
    assert cosine_rows(vector, sanity_reference)[0] >= MIN_COSINE


def test_an_unknown_route_or_method_is_named(server, sanity_reference):
    """Starlette's bare "Not Found" / "Method Not Allowed" say which method and path, and a 405
    carries the Allow header (RFC 9110)."""
    assert _error(httpx.post(f"{server.url}/v1/embedding", json={}), 404) == (
        "no route POST '/v1/embedding': the routes are listed at /docs")
    wrong = httpx.get(f"{server.url}/v1/embeddings")
    assert _error(wrong, 405) == "'/v1/embeddings' takes POST, not GET" and wrong.headers["allow"] == "POST"
    vector = httpx.post(f"{server.url}/v1/embeddings", json={"input": SANITY_TEXT}).json()["data"][0]["embedding"]
    assert cosine_rows(vector, sanity_reference)[0] >= MIN_COSINE


@pytest.mark.parametrize(("payload", "param"), [
    ({"input": "a", "dimensions": 8}, "dimensions"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "a", "truncate_prompt_tokens": 1000}, "truncate_prompt_tokens"),
    ({"input": ""}, "input"),
    ({"input": ["a", ""]}, "input"),
    ({"input": ["a", None]}, "input"),
    ({"input": [[101, 40000]]}, "input"),
])
def test_an_error_in_a_field_names_it_in_param(server, payload, param):
    answer = httpx.post(f"{server.url}/v1/embeddings", json=payload)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param


def test_truncation_keeps_the_model_maximum(server, runtime, lee_long_docs):
    body = httpx.post(f"{server.url}/v1/embeddings", json={"input": lee_long_docs[:2], "truncate_prompt_tokens": -1})
    assert body.status_code == 200 and body.json()["usage"]["prompt_tokens"] == 512
    np.testing.assert_allclose([item["embedding"] for item in body.json()["data"]],
                               runtime.embed(lee_long_docs[:2], truncate_prompt_tokens=-1), atol=2e-6)


def test_limits_name_the_limit(runtime, poolrunner_step_recorder):
    steps = poolrunner_step_recorder(runtime)
    settings = ServerSettings(max_inputs_per_request=4, max_request_bytes=2000, max_waiting_requests=64)
    with ServerThread(runtime, settings) as running, httpx.Client(base_url=running.url) as client:
        message = _error(client.post("/v1/embeddings", json={"input": ["a"] * 5}), 400)
        assert message == ("input has 5 items, more than the limit of 4 per request "
                           "(max_inputs_per_request, the --max-inputs-per-request flag)")
        assert "the limit of 4" in _error(client.post("/rerank", json={"query": "q", "documents": ["d"] * 5}), 400)
        big = {"input": ["x" * 3000]}
        announced = client.post("/v1/embeddings", json=big)
        size = len(announced.request.content)
        assert _error(announced, 413) == (f"the request body has {size} bytes, more than the limit of 2000 bytes "
                                          "(max_request_bytes, the --max-request-bytes flag)")
        assert announced.content.startswith(b'{"error":{')  # serialized as every other error
        tei = client.post("/embed", json={"inputs": ["x" * 3000]})  # TEI's route: TEI's shape, as its other errors
        assert (tei.status_code, tei.json()) == (413, {"error": (
            f"the request body has {len(tei.request.content)} bytes, more than the limit of 2000 bytes "
            "(max_request_bytes, the --max-request-bytes flag)"), "error_type": "Validation"})

        def chunks():  # no Content-Length: the limit is enforced while reading
            yield b'{"input": ["'
            for _ in range(10):
                yield b"y" * 500
            yield b'"]}'

        chunked = client.post("/v1/embeddings", content=chunks(), headers={"content-type": "application/json"})
        # what had arrived when the limit was passed: as many chunks as the connection had delivered
        arrived = re.fullmatch(r"the request body has at least (\d+) bytes, more than the limit of 2000 bytes "
                               r"\(max_request_bytes, the --max-request-bytes flag\)", _error(chunked, 413))
        assert arrived is not None and 2000 < int(arrived[1]) <= 5015
        assert client.post("/v1/embeddings", json={"input": ["a"] * 4}).status_code == 200
        assert not steps.in_flight


def test_kept_alive_connections_answer_without_delay(server):
    """The test kit's server answers a kept-alive connection at once: its connections had no
    TCP_NODELAY, so each answer's body waited for the client's delayed ACK (about 40 ms)."""
    with httpx.Client(base_url=server.url) as client:
        assert client.get("/health").status_code == 200
        seconds = []
        for _ in range(10):
            began = time.perf_counter()
            assert client.get("/health").status_code == 200
            seconds.append(time.perf_counter() - began)
    assert min(seconds) < 0.02, seconds


def test_metrics_count_requests_by_endpoint_and_status(runtime):
    with ServerThread(runtime) as running, httpx.Client(base_url=running.url) as client:
        for _ in range(3):
            client.post("/v1/embeddings", json={"input": ["one", "two"]})
        client.post("/v1/embeddings", json={"input": []})
        client.get("/not-a-route")
        text = client.get("/metrics").text
    assert 'poolrunner_requests_total{endpoint="/v1/embeddings",status="200"} 3.0' in text
    assert 'poolrunner_requests_total{endpoint="/v1/embeddings",status="400"} 1.0' in text
    assert 'poolrunner_requests_total{endpoint="other",status="404"} 1.0' in text
    assert "poolrunner_queue_time_seconds_count 6.0" in text
    assert "poolrunner_inference_time_seconds_count 6.0" in text
    assert "poolrunner_request_prompt_tokens_count 3.0" in text  # the rejected request never tokenized
    assert "poolrunner_batch_size_sum 6.0" in text
    assert "poolrunner_pending_requests 0.0" in text


def test_messages_name_the_served_model_never_a_local_path(server, runtime):
    path = runtime.model_config.path
    for route, body in [("/v1/embeddings", {"input": "a", "dimensions": 8}),
                        ("/v1/embeddings", {"input": "a " * 300}),
                        ("/embed", {"inputs": "a", "prompt_name": "query"})]:
        answer = httpx.post(f"{server.url}{route}", json=body)
        text = answer.text
        assert answer.status_code in (400, 422) and path not in text and "all-MiniLM-L6-v2" in text, text
