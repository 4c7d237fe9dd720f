"""vLLM's per-request fields on ``/v1/embeddings``, ``/pooling`` and ``/classify`` against a real
server: ``normalize``, ``use_activation``, ``add_special_tokens``, ``truncate_prompt_tokens``,
``embed_dtype``, ``endianness``, ``encoding_format`` float / base64 / bytes / bytes_only,
``precision`` (poolrunner's), chat ``messages``, ``[text, text_pair]`` pairs, several
``--served-model-name`` aliases and ``--allow-extra-fields``.

Expected values come from independent references (transformers' model and tokenizer, the
tokenizer's own ``apply_chat_template``, sentence-transformers' ``quantize_embeddings``, torch's
dtype conversions) or from the offline Python API on the same inputs, never from the server.
Every rejected request is followed by one that must still be served.
"""

from __future__ import annotations

import base64
import copy
import json
import logging
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from sentence_transformers.util import quantize_embeddings
from transformers import AutoTokenizer

import poolrunner
from poolrunner.core.cli.main import build_parser
from poolrunner.core.server import ServerSettings
from poolrunner.core.testing.server import ServerThread
from tests.conftest import SANITY_TEXT
from tests.helpers import MIN_COSINE, cosine_rows, normalized

TEXTS = ["A man is eating food.", "A cheetah chases its prey across a field.", "The new movie is awesome!"]
PAIRS = [("Fires threaten homes in Australia.", "Bushfires are burning near Sydney."),
         ("A man is playing a guitar.", "The stock market fell sharply on Monday.")]
MESSAGES = [{"role": "system", "content": "You embed texts."},
            {"role": "user", "content": "A cheetah chases its prey across a field."}]
CHAT_TEMPLATE = (
    "{% if tools %}[tools:{% for tool in tools %} {{ tool['function']['name'] }}{% endfor %}]\n{% endif %}"
    "{% for message in messages %}<{{ message['role'] }}>{% if style is defined %}[{{ style }}] {% endif %}"
    "{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _ok(answer: httpx.Response) -> dict:
    assert answer.status_code == 200, answer.text
    return answer.json()


def _error(answer: httpx.Response, status: int = 400) -> str:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error["message"]


def _still_serves(url: str, runtime) -> None:
    body = _ok(httpx.post(f"{url}/v1/embeddings", json={"input": SANITY_TEXT}))
    np.testing.assert_allclose(body["data"][0]["embedding"], runtime.embed(SANITY_TEXT), atol=2e-6)


def _vectors(body: dict) -> np.ndarray:
    return np.array([item["embedding"] for item in body["data"]])


def _decode(payload: bytes, embed_dtype: str, endianness: str) -> np.ndarray:
    """float32 values of a payload, decoded with numpy alone (bfloat16: the high half of float32)."""
    order = {"native": "=", "little": "<", "big": ">"}[endianness]
    if embed_dtype == "bfloat16":
        bits = np.frombuffer(payload, dtype=f"{order}u2").astype(np.uint32) << 16
        return bits.view(np.float32)
    return np.frombuffer(payload, dtype=f"{order}f{2 if embed_dtype == 'float16' else 4}").astype(np.float32)


def _as(vectors: np.ndarray, embed_dtype: str) -> np.ndarray:
    """The float32 values ``vectors`` take at ``embed_dtype`` (torch's round to nearest even)."""
    return torch.from_numpy(np.asarray(vectors, dtype=np.float32)).to(TORCH_DTYPES[embed_dtype]).float().numpy()


def _with_chat_template(source: Path, target: Path) -> Path:
    """``source`` with a chat template in its tokenizer config (every other file linked)."""
    target.mkdir()
    for entry in source.iterdir():
        if entry.name != "tokenizer_config.json":
            (target / entry.name).symlink_to(entry.resolve())
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = CHAT_TEMPLATE
    (target / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return target


# --------------------------------------------------------------------------- embedding fields


def test_normalize_and_use_activation_false_give_the_raw_mean(server, runtime, hf_tokenizer, hf_mean):
    ids = [hf_tokenizer(text)["input_ids"] for text in TEXTS]
    raw = hf_mean(ids)  # transformers' masked mean, unnormalized
    for field in ("normalize", "use_activation"):
        for path in ("/v1/embeddings", "/embeddings"):
            vectors = _vectors(_ok(httpx.post(f"{server.url}{path}", json={"input": TEXTS, field: False})))
            assert cosine_rows(vectors, raw).min() >= MIN_COSINE
            np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), np.linalg.norm(raw, axis=1), rtol=1e-4)
            np.testing.assert_allclose(vectors, runtime.embed(TEXTS, normalize=False), atol=2e-6)
    pooled = _ok(httpx.post(f"{server.url}/pooling", json={"input": TEXTS, "normalize": False}))
    np.testing.assert_allclose([item["data"] for item in pooled["data"]], runtime.embed(TEXTS, normalize=False),
                               atol=2e-6)
    # normalize wins over use_activation (vLLM folds normalize into use_activation)
    both = _vectors(_ok(httpx.post(f"{server.url}/v1/embeddings",
                                   json={"input": TEXTS, "normalize": True, "use_activation": False})))
    np.testing.assert_allclose(both, runtime.embed(TEXTS), atol=2e-6)


def test_add_special_tokens_false_tokenizes_without_them(server, runtime, hf_tokenizer, hf_mean):
    ids = [hf_tokenizer(text, add_special_tokens=False)["input_ids"] for text in TEXTS]
    assert all(hf_tokenizer.cls_token_id not in row and hf_tokenizer.sep_token_id not in row for row in ids)
    for path in ("/v1/embeddings", "/pooling"):
        body = _ok(httpx.post(f"{server.url}{path}", json={"input": TEXTS, "add_special_tokens": False}))
        vectors = np.array([item["embedding" if path == "/v1/embeddings" else "data"] for item in body["data"]])
        assert cosine_rows(vectors, hf_mean(ids)).min() >= MIN_COSINE
        np.testing.assert_allclose(vectors, runtime.embed(ids), atol=2e-6)  # the same ids, offline
        assert body["usage"]["prompt_tokens"] == sum(map(len, ids))
    # no special tokens to keep, so truncation has no minimum: one token is a valid prompt
    body = _ok(httpx.post(f"{server.url}/v1/embeddings",
                          json={"input": TEXTS[1], "add_special_tokens": False, "truncate_prompt_tokens": 3}))
    np.testing.assert_allclose(_vectors(body)[0], runtime.embed(ids[1][:3]), atol=2e-6)
    assert body["usage"]["prompt_tokens"] == 3
    message = _error(httpx.post(f"{server.url}/v1/embeddings", json={"input": TEXTS[1], "truncate_prompt_tokens": 1}))
    assert message == ("truncate_prompt_tokens=1 is below the 2 special tokens model all-MiniLM-L6-v2 adds "
                       "to every input; use at least 2 (or -1 for the model maximum)")
    _still_serves(server.url, runtime)


def test_truncation_side_left_keeps_the_last_tokens_on_every_route(server, runtime, hf_tokenizer, hf_mean):
    """vLLM's ``truncation_side`` beside ``truncate_prompt_tokens``: ``left`` keeps each input's
    last tokens (and the special tokens), as the tokenizer's own left truncation does; the
    expected vectors are transformers' masked means of those ids."""
    keep = 6
    left = copy.deepcopy(hf_tokenizer)
    left.truncation_side = "left"
    ids = [left(text, truncation=True, max_length=keep)["input_ids"] for text in TEXTS]
    assert ids[1] != hf_tokenizer(TEXTS[1], truncation=True, max_length=keep)["input_ids"]
    expected = normalized(hf_mean(ids))
    fields = {"truncate_prompt_tokens": keep, "truncation_side": "left"}
    for path, key in (("/v1/embeddings", "embedding"), ("/pooling", "data")):
        body = _ok(httpx.post(f"{server.url}{path}", json={"input": TEXTS, **fields}))
        vectors = np.array([item[key] for item in body["data"]])
        assert cosine_rows(vectors, expected).min() >= MIN_COSINE, path
        assert body["usage"]["prompt_tokens"] == keep * len(TEXTS)
    score = _ok(httpx.post(f"{server.url}/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:], **fields}))
    np.testing.assert_allclose([item["score"] for item in score["data"]], expected[1:] @ expected[0], atol=1e-5)
    ranked = _ok(httpx.post(f"{server.url}/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:], **fields}))
    np.testing.assert_allclose(sorted(item["relevance_score"] for item in ranked["results"]),
                               sorted(expected[1:] @ expected[0]), atol=1e-5)
    right = _vectors(_ok(httpx.post(f"{server.url}/v1/embeddings",
                                    json={"input": TEXTS, "truncate_prompt_tokens": keep})))
    assert cosine_rows(right, expected).min() < 0.99  # the default side is right, and it matters here


@pytest.mark.parametrize("embed_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("endianness", ["native", "little", "big"])
def test_base64_payload_has_the_asked_dtype_and_byte_order(server, runtime, embed_dtype, endianness):
    floats = runtime.embed(TEXTS)
    body = _ok(httpx.post(f"{server.url}/v1/embeddings", json={
        "input": TEXTS, "encoding_format": "base64", "embed_dtype": embed_dtype, "endianness": endianness}))
    payloads = [base64.b64decode(item["embedding"]) for item in body["data"]]
    width = {"float32": 4, "float16": 2, "bfloat16": 2}[embed_dtype]
    assert [len(payload) for payload in payloads] == [384 * width] * 3
    decoded = np.stack([_decode(payload, embed_dtype, endianness) for payload in payloads])
    np.testing.assert_allclose(decoded, _as(floats, embed_dtype), rtol=0, atol=2e-6 if width == 4 else 4e-3)
    assert np.mean(decoded == _as(floats, embed_dtype)) >= 0.99  # the same rounding (ties aside)
    if (sys.byteorder if endianness == "native" else endianness) != sys.byteorder:  # swapped: native reading is wrong
        assert not np.allclose(_decode(payloads[0], embed_dtype, "native"), decoded[0], atol=1e-2)
    # JSON floats stay float32 values whatever embed_dtype says
    as_float = _ok(httpx.post(f"{server.url}/v1/embeddings", json={"input": TEXTS, "embed_dtype": embed_dtype,
                                                                 "endianness": endianness}))
    np.testing.assert_allclose(_vectors(as_float), floats, atol=2e-6)


@pytest.mark.parametrize(("embed_dtype", "fp8"), [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_payloads_are_one_byte_a_value_as_vllm_decodes_them(server, runtime, embed_dtype, fp8):
    """vLLM's client reads fp8 payloads as uint8 bytes viewed as torch's float8 type."""
    expected = torch.from_numpy(runtime.embed(TEXTS)).to(fp8).float().numpy()
    body = _ok(httpx.post(f"{server.url}/v1/embeddings", json={
        "input": TEXTS, "encoding_format": "base64", "embed_dtype": embed_dtype, "endianness": "big"}))
    payloads = [base64.b64decode(item["embedding"]) for item in body["data"]]
    assert [len(payload) for payload in payloads] == [384] * 3  # one byte a value: no byte order to swap
    decoded = [torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(fp8) for payload in payloads]
    np.testing.assert_array_equal(torch.stack(decoded).float().numpy(), expected)
    answer = httpx.post(f"{server.url}/pooling", json={"input": TEXTS, "encoding_format": "bytes",
                                                        "embed_dtype": embed_dtype})
    metadata = json.loads(answer.headers["metadata"])
    assert [item["embed_dtype"] for item in metadata["data"]] == [embed_dtype] * 3 and len(answer.content) == 3 * 384
    np.testing.assert_array_equal(torch.frombuffer(bytearray(answer.content), dtype=torch.uint8).view(fp8).float()
                                  .reshape(3, 384).numpy(), expected)


def test_openai_client_passes_vllm_fields_in_extra_body(server, runtime):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    answer = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS, user="someone",  # base64 by default
                                      extra_body={"normalize": False, "embed_dtype": "float32", "priority": 0,
                                                  "endianness": "little", "request_id": "abc-1"})
    np.testing.assert_allclose([item.embedding for item in answer.data], runtime.embed(TEXTS, normalize=False),
                               atol=2e-6)
    raw = _ok(httpx.post(f"{server.url}/v1/embeddings",
                         json={"input": TEXTS[0], "request_id": "abc-1", "priority": 0}))
    assert raw["id"] == "embd-abc-1" and isinstance(raw["created"], int) and raw["object"] == "list"


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
@pytest.mark.parametrize(("embed_dtype", "endianness"), [("float32", "native"), ("float16", "big"),
                                                         ("bfloat16", "little")])
def test_bytes_response_is_vllms(server, runtime, hf_tokenizer, path, embed_dtype, endianness):
    floats = runtime.embed(TEXTS)
    request = {"input": TEXTS, "encoding_format": "bytes", "embed_dtype": embed_dtype, "endianness": endianness,
               "request_id": "r1"}
    answer = httpx.post(f"{server.url}{path}", json=request)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/octet-stream"
    metadata = json.loads(answer.headers["metadata"])
    assert set(metadata) == {"id", "created", "model", "data", "usage"}
    assert metadata["id"] == ("embd-r1" if path == "/v1/embeddings" else "pool-r1")
    assert metadata["model"] == "all-MiniLM-L6-v2" and isinstance(metadata["created"], int)
    tokens = sum(len(hf_tokenizer(text)["input_ids"]) for text in TEXTS)
    assert metadata["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    width = 4 if embed_dtype == "float32" else 2
    assert metadata["data"] == [{"index": i, "embed_dtype": embed_dtype, "endianness": endianness,
                                 "start": i * 384 * width, "end": (i + 1) * 384 * width, "shape": [384]}
                                for i in range(3)]
    assert len(answer.content) == 3 * 384 * width
    decoded = np.stack([_decode(answer.content[item["start"]:item["end"]], embed_dtype, endianness)
                        for item in metadata["data"]])
    np.testing.assert_allclose(decoded, _as(floats, embed_dtype), rtol=0, atol=2e-6 if width == 4 else 4e-3)
    only = httpx.post(f"{server.url}{path}", json={**request, "encoding_format": "bytes_only"})
    assert only.status_code == 200 and "metadata" not in only.headers
    assert only.headers["content-type"] == "application/octet-stream"
    np.testing.assert_allclose(np.stack([_decode(only.content[i * 384 * width:(i + 1) * 384 * width], embed_dtype,
                                                 endianness) for i in range(3)]), decoded, atol=2e-6)


def test_bytes_response_of_per_token_outputs(server, runtime, hf_tokenizer):
    answer = httpx.post(f"{server.url}/pooling", json={"input": TEXTS[:2], "task": "token_embed",
                                                       "encoding_format": "bytes", "endianness": "big"})
    assert answer.status_code == 200, answer.text
    items = json.loads(answer.headers["metadata"])["data"]
    expected = runtime.encode(TEXTS[:2], task="token_embed")
    for item, reference, text in zip(items, expected, TEXTS[:2], strict=True):
        assert item["shape"] == [len(hf_tokenizer(text)["input_ids"]), 384]
        values = np.frombuffer(answer.content[item["start"]:item["end"]], dtype=">f4").reshape(item["shape"])
        np.testing.assert_allclose(values, reference, atol=2e-5)


# --------------------------------------------------------------------------- precision


@pytest.mark.parametrize("precision", ["int8", "uint8", "binary", "ubinary"])
def test_precision_equals_sentence_transformers_quantization(server, runtime, precision):
    floats = runtime.embed(TEXTS)
    expected = quantize_embeddings(floats, precision=precision)
    body = _ok(httpx.post(f"{server.url}/v1/embeddings", json={"input": TEXTS, "precision": precision}))
    codes = np.array([item["embedding"] for item in body["data"]])
    assert all(isinstance(code, int) for code in body["data"][0]["embedding"])
    np.testing.assert_array_equal(codes, expected)
    np.testing.assert_array_equal(codes, runtime.embed(TEXTS, precision=precision))  # the Python API's
    b64 = _ok(httpx.post(f"{server.url}/v1/embeddings",
                         json={"input": TEXTS, "precision": precision, "encoding_format": "base64"}))
    decoded = np.stack([np.frombuffer(base64.b64decode(item["embedding"]), dtype=expected.dtype)
                        for item in b64["data"]])
    np.testing.assert_array_equal(decoded, expected)
    raw = httpx.post(f"{server.url}/v1/embeddings", json={"input": TEXTS, "precision": precision,
                                                         "encoding_format": "bytes"})
    items = json.loads(raw.headers["metadata"])["data"]
    assert [(item["embed_dtype"], item["shape"]) for item in items] == [(precision, [expected.shape[1]])] * 3
    np.testing.assert_array_equal(np.frombuffer(raw.content, dtype=expected.dtype).reshape(expected.shape), expected)
    pooled = _ok(httpx.post(f"{server.url}/pooling", json={"input": TEXTS, "precision": precision}))
    np.testing.assert_array_equal([item["data"] for item in pooled["data"]], expected)


def test_int8_ranges_make_one_text_codable(server, runtime):
    floats = runtime.embed(TEXTS)
    ranges = np.vstack([floats.min(axis=0), floats.max(axis=0)])
    body = _ok(httpx.post(f"{server.url}/v1/embeddings",
                          json={"input": TEXTS[0], "precision": "int8", "ranges": ranges.tolist()}))
    expected = quantize_embeddings(floats[:1], precision="int8", ranges=ranges)
    np.testing.assert_array_equal(_vectors(body), expected)


@pytest.fixture(scope="module")
def matryoshka():
    runtime = poolrunner.Runtime(is_matryoshka=True, dtype="float32")
    with ServerThread(runtime) as running:
        yield running, runtime


def test_dimensions_apply_before_quantizing_and_are_checked_against_the_float_size(matryoshka):
    running, runtime = matryoshka
    floats = runtime.embed(TEXTS, dimensions=64)
    body = _ok(httpx.post(f"{running.url}/v1/embeddings", json={"input": TEXTS, "dimensions": 64,
                                                               "precision": "ubinary"}))
    assert _vectors(body).shape == (3, 8)
    np.testing.assert_array_equal(_vectors(body), quantize_embeddings(floats, precision="ubinary"))
    halves = _ok(httpx.post(f"{running.url}/v1/embeddings", json={
        "input": TEXTS, "dimensions": 128, "encoding_format": "base64", "embed_dtype": "float16"}))
    decoded = np.stack([_decode(base64.b64decode(item["embedding"]), "float16", "native") for item in halves["data"]])
    np.testing.assert_allclose(decoded, _as(normalized(runtime.embed(TEXTS, normalize=False)[:, :128]), "float16"),
                               atol=1e-3)
    message = _error(httpx.post(f"{running.url}/v1/embeddings", json={"input": TEXTS, "dimensions": 385,
                                                                     "precision": "binary"}))
    assert message == "dimensions=385 is out of range for model all-MiniLM-L6-v2: 1..384"
    _still_serves(running.url, runtime)


BAD_FIELDS = [
    ("embed_dtype", {"embed_dtype": "float64"},
     "embed_dtype: Input should be 'float32', 'float16', 'bfloat16', 'fp8_e4m3' or 'fp8_e5m2', got 'float64'"),
    ("endianness", {"endianness": "middle"}, "endianness: Input should be 'native', 'big' or 'little', got 'middle'"),
    ("dimensions NaN", {"dimensions": float("nan")}, "dimensions: Input should be a valid integer, got nan"),
    ("lone surrogate echoed escaped", {"encoding_format": "\ud800"},
     "encoding_format: Input should be a valid string, unable to parse raw data as a unicode string, "
     "got '\\ud800'"),
    ("long value cut", {"encoding_format": "b" * 100},
     "encoding_format: Input should be 'float', 'base64', 'bytes' or 'bytes_only', got '" + "b" * 17 + "..."
     + "b" * 18 + "'"),
    ("encoding_format", {"encoding_format": "npy"},
     "encoding_format: Input should be 'float', 'base64', 'bytes' or 'bytes_only', got 'npy'"),
    ("truncation_side", {"truncation_side": "middle"},
     "truncation_side: Input should be 'left' or 'right', got 'middle'"),
    ("precision", {"precision": "int4"},
     "precision: Input should be 'float32', 'int8', 'uint8', 'binary' or 'ubinary', got 'int4'"),
    ("one text to calibrate", {"input": "one text", "precision": "int8"},
     "int8 needs ranges, or at least two embeddings in the call to calibrate them on; got 1"),
    ("ranges shape", {"precision": "uint8", "ranges": [[0.0, 0.1], [0.2, 0.3]]},
     "ranges must have shape [2, 384] (minima, maxima per dimension), got [2, 2]"),
    ("ranges NaN", {"precision": "int8", "ranges": [[0.0] * 384, [float("nan")] * 384]},
     "ranges[1][0] is nan: ranges must be finite numbers within float32's range (magnitude at most 3.403e+38)"),
    ("ranges without int8", {"precision": "binary", "ranges": [[0.0], [1.0]]},
     "ranges applies to precision int8 or uint8, not binary"),
    ("embed_dtype of codes", {"precision": "int8", "embed_dtype": "float16"},
     "embed_dtype=float16 applies to float embeddings; precision=int8 sends its int8 codes"),
    ("input and messages", {"messages": MESSAGES}, "send input or messages, not both"),
    ("neither", {"input": None}, "send input (texts or token ids) or messages (a chat)"),
    ("chat field with input", {"add_generation_prompt": True},
     "add_generation_prompt applies to messages, not to input"),
    ("no chat template", {"input": None, "messages": MESSAGES},
     "the tokenizer of model {name} has no chat template, so messages cannot be rendered; send the text "
     "as input instead, or start the server with --chat-template"),
    ("unknown field", {"colour": "red"}, "colour: Extra inputs are not permitted (a field this server does not "
     "know is refused; --allow-extra-fields drops such fields instead)"),
    ("empty messages", {"input": None, "messages": []}, "messages is empty: send at least one message"),
    ("image part", {"input": None, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "input 0 is an image, but BertModel has no vision tower (images are served for CLIPModel, SiglipModel, "
     "Siglip2Model, ColPaliForRetrieval, ColQwen2ForRetrieval)"),
    ("malformed image part", {"input": None, "messages": [{"role": "user", "content": [
        {"type": "image_url", "text": "x"}]}]},
     "messages.0.content.str: Input should be a valid string; messages.0.content.list[tagged-union[ContentPart,"
     "ImagePart]].0.image_url.image_url: Field required; messages.0.content.list[tagged-union[ContentPart,"
     "ImagePart]].0.image_url.text: Extra inputs are not permitted"),
]


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
@pytest.mark.parametrize(("fields", "message"), [case[1:] for case in BAD_FIELDS], ids=[c[0] for c in BAD_FIELDS])
def test_bad_fields_are_400_and_the_server_still_serves(server, runtime, path, fields, message,
                                                       poolrunner_step_recorder):
    steps = poolrunner_step_recorder(runtime)
    body = {"input": TEXTS, **fields}
    answer = httpx.post(f"{server.url}{path}", json={name: value for name, value in body.items() if value is not None})
    assert _error(answer) == message.format(name="all-MiniLM-L6-v2")  # the served name, never a path
    assert server.serving.pending == 0 and not steps.in_flight
    _still_serves(server.url, runtime)


def test_precision_on_another_task_is_refused(server, runtime):
    message = _error(httpx.post(f"{server.url}/pooling", json={"input": TEXTS, "task": "token_embed",
                                                              "precision": "binary"}))
    assert message == "precision=binary applies to task 'embed', not 'token_embed'"
    _still_serves(server.url, runtime)


# --------------------------------------------------------------------------- chat messages


@pytest.fixture(scope="module", params=["folder", "setting"])
def chat_server(request, tmp_path_factory, model_path):
    """The template in the folder's tokenizer config, or given as the runtime's ``chat_template``
    (``--chat-template``) for the folder without one; the reference tokenizer is the folder's with it."""
    folder = _with_chat_template(model_path, tmp_path_factory.mktemp("chat") / "minilm-chat")
    runtime = (poolrunner.Runtime(str(folder), dtype="float32") if request.param == "folder"
               else poolrunner.Runtime(str(model_path), dtype="float32", chat_template=CHAT_TEMPLATE))
    with ServerThread(runtime) as running:
        yield running, runtime, AutoTokenizer.from_pretrained(folder, local_files_only=True)


def test_embedding_messages_are_rendered_with_the_chat_template(chat_server, hf_mean):
    running, runtime, tokenizer = chat_server
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert text == "<system>You embed texts.\n<user>A cheetah chases its prey across a field.\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # vLLM's chat default: the template's tokens only
    for path in ("/v1/embeddings", "/pooling"):
        body = _ok(httpx.post(f"{running.url}{path}", json={"messages": MESSAGES}))
        vector = np.array(body["data"][0]["embedding" if path == "/v1/embeddings" else "data"])
        assert len(body["data"]) == 1 and body["usage"]["prompt_tokens"] == len(ids)
        np.testing.assert_allclose(vector, runtime.embed(ids), atol=2e-6)
        assert cosine_rows(vector, normalized(hf_mean([ids])))[0] >= MIN_COSINE
    # content parts are joined with newlines; add_special_tokens, add_generation_prompt and the
    # template's own variables (chat_template_kwargs) reach the rendering
    parts = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
    body = _ok(httpx.post(f"{running.url}/v1/embeddings", json={
        "messages": parts, "add_special_tokens": True, "add_generation_prompt": True,
        "chat_template_kwargs": {"style": "terse"}}))
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "first\nsecond"}], tokenize=False,
                                             add_generation_prompt=True, style="terse")
    assert rendered == "<user>[terse] first\nsecond\n<assistant>"
    np.testing.assert_allclose(_vectors(body)[0], runtime.embed(tokenizer(rendered)["input_ids"]), atol=2e-6)
    for fields, message in [
        ({"chat_template": "{{ messages }}"},
         "chat_template is not accepted: messages are rendered with the model's chat template (the server's "
         "--chat-template, else the tokenizer's)"),
        ({"chat_template_kwargs": {"tokenize": True}},
         "chat_template_kwargs cannot set tokenize: it is an argument of the rendering, not a template variable"),
        ({"add_generation_prompt": True, "continue_final_message": True},
         "add_generation_prompt and continue_final_message cannot both be true"),
    ]:
        assert _error(httpx.post(f"{running.url}/v1/embeddings", json={"messages": MESSAGES, **fields})) == message
        _still_serves(running.url, runtime)


def test_tokenize_messages_as_vllm_does(chat_server):
    """vLLM's chat form of /tokenize: the generation prompt added and no special tokens by default."""
    running, runtime, tokenizer = chat_server
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    body = _ok(httpx.post(f"{running.url}/tokenize", json={"messages": MESSAGES, "return_token_strs": True}))
    assert body == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                    "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    plain = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    body = _ok(httpx.post(f"{running.url}/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False,
                                                           "add_special_tokens": True}))
    assert body["tokens"] == tokenizer(plain)["input_ids"]
    for fields, message in [
        ({"continue_final_message": True},  # vLLM refuses it too: its generation prompt is on by default
         "add_generation_prompt and continue_final_message cannot both be true"),
        ({"prompt": "a"}, "send prompt or messages (vLLM) or inputs (TEI), exactly one of them"),
        ({"messages": []}, "messages is empty: send at least one message"),
    ]:
        assert _error(httpx.post(f"{running.url}/tokenize", json={"messages": MESSAGES, **fields})) == message
        _still_serves(running.url, runtime)
    assert _error(httpx.post(f"{running.url}/tokenize", json={"prompt": "a", "add_generation_prompt": True})) == (
        "add_generation_prompt applies to messages, not to prompt")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    rendered = tokenizer.apply_chat_template(MESSAGES, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "[tools: get_weather]" in rendered
    body = _ok(httpx.post(f"{running.url}/tokenize", json={"messages": MESSAGES, "tools": tools}))
    assert body["tokens"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]  # vLLM's tokenize with tools
    assert _error(httpx.post(f"{running.url}/tokenize", json={"prompt": "a", "tools": tools})) == (
        "tools applies to messages, not to prompt")
    long = [{"role": "user", "content": "word " * 300}]  # past max_model_len 256: counted whole, as vLLM's
    rendered = tokenizer.apply_chat_template(long, tokenize=False, add_generation_prompt=True)
    body = _ok(httpx.post(f"{running.url}/tokenize", json={"messages": long}))
    assert body["tokens"] == tokenizer(rendered, add_special_tokens=False)["input_ids"] and body["count"] > 256
    huge = [{"role": "user", "content": "w" * 8193}]
    chars = len(tokenizer.apply_chat_template(huge, tokenize=False, add_generation_prompt=True))
    assert _error(httpx.post(f"{running.url}/tokenize", json={"messages": huge})) == (
        f"input 0 has {chars} characters, more than the limit of 8192 per input (max_input_chars, the "
        "--max-input-chars flag); shorten it")
    _still_serves(running.url, runtime)


def test_the_chat_template_setting_is_read_from_a_file_and_checked(tmp_path):
    """``--chat-template`` (and ``POOLRUNNER_CHAT_TEMPLATE``) takes a file or the Jinja text, as
    vLLM's; text that is not a template is refused when the settings are made, before loading."""
    from poolrunner.core.cli.common import runtime_options

    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE, encoding="utf-8")
    for value in (str(template), CHAT_TEMPLATE):
        args = build_parser().parse_args(["serve", "--model", "m", "--chat-template", value])
        assert runtime_options(args)["chat_template"] == CHAT_TEMPLATE
    for value, message in (("{{ messages }", "chat_template is not a valid Jinja template: unexpected '}' (line 1)"),
                           ("plain text", "chat_template must be Jinja text (a template that reads messages), got "
                                          "'plain text'")):
        with pytest.raises(poolrunner.InvalidRequestError) as caught:
            poolrunner.RuntimeConfig(chat_template=value)
        assert str(caught.value) == message


# --------------------------------------------------------------------------- classify: pairs, messages


@pytest.fixture(scope="module")
def chat_classifier(tmp_path_factory, minilm_classifier_folder, classifier_runtime):
    folder = _with_chat_template(minilm_classifier_folder(3), tmp_path_factory.mktemp("chat_cls") / "classifier")
    runtime = classifier_runtime(folder)
    with ServerThread(runtime) as running:
        yield running, runtime, folder


def test_classify_takes_text_pairs(chat_classifier, classifier_reference):
    running, runtime, folder = chat_classifier
    mixed = [list(PAIRS[0]), TEXTS[0], list(PAIRS[1])]
    body = _ok(httpx.post(f"{running.url}/classify", json={"input": mixed}))
    probs = np.array([item["probs"] for item in body["data"]])
    items = [PAIRS[0], TEXTS[0], PAIRS[1]]
    np.testing.assert_allclose(probs, classifier_reference(folder).mixed_scores(items), rtol=2e-3, atol=1e-6)
    offline = runtime.classify(items)
    np.testing.assert_allclose(probs, [result.probs for result in offline], atol=2e-6)
    assert [item["label"] for item in body["data"]] == [result.label for result in offline]
    for bad, message in [
        ({"input": [["only one"]]},
         "input 0: ['only one'] is a list of texts, not one input: send texts as one flat list"),
        ({"input": [["a", ""]]}, "input[0][1] is an empty string"),
    ]:
        assert _error(httpx.post(f"{running.url}/classify", json=bad)).startswith(message)
        np.testing.assert_allclose(_ok(httpx.post(f"{running.url}/classify", json={"input": TEXTS[0]}))["data"][0]
                                   ["probs"], offline[1].probs, atol=2e-6)


def test_classify_takes_messages(chat_classifier, classifier_reference, minilm_classifier_folder, classifier_runtime):
    running, runtime, folder = chat_classifier
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ids = tokenizer(tokenizer.apply_chat_template(MESSAGES, tokenize=False), add_special_tokens=False)["input_ids"]
    body = _ok(httpx.post(f"{running.url}/classify", json={"messages": MESSAGES, "use_activation": False}))
    assert len(body["data"]) == 1 and body["usage"]["prompt_tokens"] == len(ids)
    with torch.inference_mode():  # transformers' own forward of the rendered chat's ids
        logits = classifier_reference(folder).model(input_ids=torch.tensor([ids])).logits[0].double().numpy()
    np.testing.assert_allclose(body["data"][0]["probs"], logits, rtol=2e-3, atol=1e-5)
    np.testing.assert_allclose(body["data"][0]["probs"], runtime.classify([ids], use_activation=False)[0].probs,
                               atol=2e-6)
    # the same folder without a chat template: a clear 400, and the next request is served
    with ServerThread(classifier_runtime(minilm_classifier_folder(3))) as plain:
        message = _error(httpx.post(f"{plain.url}/classify", json={"messages": MESSAGES}))
        assert message.startswith("the tokenizer of model ") and message.endswith(
            " has no chat template, so messages cannot be rendered; send the text as input instead, or start the "
            "server with --chat-template")
        assert len(_ok(httpx.post(f"{plain.url}/classify", json={"input": TEXTS}))["data"]) == 3


# --------------------------------------------------------------------------- names and extra fields


def test_served_model_name_aliases(runtime):
    settings = ServerSettings(served_model_name=["minilm", "sentence-transformers/all-MiniLM-L6-v2"])
    with ServerThread(runtime, settings) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        for name in settings.served_model_name:
            answer = client.embeddings.create(model=name, input=TEXTS, encoding_format="float")
            assert answer.model == "minilm"  # the first name is the one reported
            np.testing.assert_allclose([item.embedding for item in answer.data], runtime.embed(TEXTS), atol=2e-6)
        assert [model.id for model in client.models.list().data] == list(settings.served_model_name)
        assert client.models.retrieve("sentence-transformers/all-MiniLM-L6-v2").id == \
            "sentence-transformers/all-MiniLM-L6-v2"
        with pytest.raises(openai.NotFoundError) as caught:
            client.embeddings.create(model="all-MiniLM-L6-v2", input="x")
        assert caught.value.body["message"] == ("the model 'all-MiniLM-L6-v2' does not exist: this server serves "
                                                "'minilm' (aliases: 'sentence-transformers/all-MiniLM-L6-v2'); a "
                                                "client's default name is served when the operator lists it in "
                                                "--served-model-name or, for a single model, turns on "
                                                "--any-model-name")
        assert len(client.embeddings.create(model="minilm", input=SANITY_TEXT).data) == 1
        classify = httpx.post(f"{running.url}/pooling", json={"model": "sentence-transformers/all-MiniLM-L6-v2",
                                                              "input": "x"})
        assert _ok(classify)["model"] == "minilm"


def test_served_model_name_and_allow_extra_fields_flags():
    args = build_parser().parse_args(["serve", "--served-model-name", "a", "b", "--allow-extra-fields"])
    assert args.served_model_name == ["a", "b"] and args.allow_extra_fields is True
    defaults = build_parser().parse_args(["serve"])
    assert defaults.served_model_name is None and defaults.allow_extra_fields is False
    assert ServerSettings(served_model_name="one").served_model_name == ("one",)
    with pytest.raises(ValueError, match=r"served_model_name must be one or more non-empty names, got \[''\]"):
        ServerSettings(served_model_name=[""])


def test_allow_extra_fields_accepts_and_logs_unknown_fields(runtime, server, caplog):
    body = {"input": TEXTS, "colour": "red", "mm_processor_kwargs": {"x": 1}}
    assert _error(httpx.post(f"{server.url}/v1/embeddings", json=body)) == (
        "colour: Extra inputs are not permitted; mm_processor_kwargs: Extra inputs are not permitted "
        "(a field this server does not know is refused; --allow-extra-fields drops such fields instead)")
    with ServerThread(runtime, ServerSettings(allow_extra_fields=True)) as running:
        caplog.set_level(logging.WARNING, logger="poolrunner.core.server")
        vectors = _vectors(_ok(httpx.post(f"{running.url}/v1/embeddings", json=body)))
        np.testing.assert_allclose(vectors, runtime.embed(TEXTS), atol=2e-6)
        logged = [record.getMessage() for record in caplog.records if record.name == "poolrunner.core.server"]
        assert logged == ["ignoring fields the request sent that EmbeddingRequest does not know: 'colour', "
                          "'mm_processor_kwargs'"]
        # A client's field names cannot forge a log line or flood the log: quoted, capped, counted.
        caplog.clear()
        forged = {"input": TEXTS, "a\nERROR forged line": 1, "x" * 100_000: 2, **{f"f{i}": i for i in range(12)}}
        np.testing.assert_allclose(_vectors(_ok(httpx.post(f"{running.url}/v1/embeddings", json=forged))),
                                   runtime.embed(TEXTS), atol=2e-6)
        [line] = [record.getMessage() for record in caplog.records if record.name == "poolrunner.core.server"]
        assert line == ("ignoring fields the request sent that EmbeddingRequest does not know: 'a\\nERROR forged "
                        f"line', '{'x' * 64}'..., 'f0', 'f1', 'f2', 'f3', 'f4', 'f5', 'f6', 'f7' and 4 more")
        scored = _ok(httpx.post(f"{running.url}/score", json={"queries": "a", "documents": ["b"], "extra": 1}))
        assert len(scored["data"]) == 1
        # known fields are still checked
        assert _error(httpx.post(f"{running.url}/v1/embeddings", json={"input": 5, "colour": "red"})).startswith(
            "input must be a text, a token-id list, a (text, text_pair) pair, an image, or a list of them; got 5 (int)")
        _still_serves(running.url, runtime)
