"""Hostile, huge and unlucky input on every POST route: a hypothesis fuzz sees no 5xx, every
refusal in the route's error shape, and the same keep-alive connection serving the next request.

The routes are read from the app (TEI's included), so a new route is fuzzed without a change here.
Bodies are (a) structured: built from each route's OpenAPI request schema, or valid bodies
(:data:`SEEDS`) with a field or two changed, any value possibly hostile (wrong types, nulls, huge,
negative, NaN and infinite numbers, empty and over-the-limit lists, deep nesting, lone surrogates,
control characters, long text, unknown fields); (b) garbage: random bytes, cut JSON, JSON that
Python's parser refuses, wrong content types and bodies over the size limit. After each, a
known-good ``/v1/embeddings`` request on the same connection must embed as the runtime does.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poolrunner.core.server.errors import ERROR_TYPES, TEI_STATUS, ErrorAnswer, TeiErrorAnswer, TeiRoute
from poolrunner.core.server.models import DEFAULT_MODEL_NAME
from poolrunner.core.server.routes import every_route
from tests.helpers import MIN_COSINE, cosine_rows

STRUCTURED_EXAMPLES = 80
"""Structured bodies per route (19 routes today: about 1,500 requests, and as many follow-ups)."""
GARBAGE_EXAMPLES = 20
"""Garbage bodies per route."""
FUZZ_SETTINGS = settings(
    derandomize=True, database=None, deadline=None, print_blob=False,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.large_base_example],
)
GOOD_TEXT = "ok"
TEI_KEYS = frozenset({"inputs", "texts"})
"""Top-level keys of TEI's bodies on the routes TEI shares with vLLM (``/rerank``, ``/tokenize``,
``/invocations``): there an error may come in TEI's shape."""
LIMIT = 2_000_000
"""The default ``max_request_bytes``."""

# ------------------------------------------------------------------------------------------ values

NASTY_CHARACTERS = st.sampled_from([
    "\ud800", "\udfff", "\ud83d", "\udc00",  # lone surrogates: JSON's \\uXXXX escapes reach the server
    "\x00", "\x1b", "\x7f", "\u0085", "\u2028", "\u202e", "\ufeff", "\ufffe", "\uffff", "\U0010ffff",
    "\U0001f600", "\u0301", "[CLS]", "[SEP]", "[PAD]", "<s>", "\\", '"', "{{", "{%", "%s", "\r\n",
])
TEXT = st.lists(st.integers(0, 0x10FFFF).map(chr) | NASTY_CHARACTERS, max_size=24).map("".join)
BROKEN_TEXT = st.builds(lambda head, half, tail: head + half + tail, TEXT, st.sampled_from(["\ud800", "\udfff"]), TEXT)
"""Text with a lone surrogate in it: nothing can write it as UTF-8, an answer that echoes it included."""
LONG_TEXT = st.builds(lambda unit, count: unit * count,
                      st.sampled_from(["a", "word ", "\u00e9", "\U0001f600", "\ud800", "\x00", "[CLS] ", "\n"]),
                      st.sampled_from([300, 1000, 8192, 8193, 40_000]))
NUMBER = st.one_of(
    st.integers(),
    st.sampled_from([0, -1, 1, 2**31, -(2**31) - 1, 2**63, -(2**63) - 1, 2**64, 10**100, -(10**300)]),
    st.floats(),  # NaN, infinities, -0.0, subnormals
)
SHORT = st.one_of(st.none(), st.booleans(), NUMBER, TEXT)
SCALAR = SHORT | LONG_TEXT
OVER_THE_LIMIT = st.builds(lambda item, count: [item] * count, SHORT | st.just([1, 2]), st.sampled_from([2049, 10_000]))
"""More items than ``max_inputs_per_request`` (2048)."""
HOSTILE = st.recursive(
    SCALAR | OVER_THE_LIMIT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=8,
)
DEEP = st.builds(lambda value, depth: _nested(value, depth), SCALAR, st.sampled_from([64, 300, 900]))
"""Nesting just below what ``json.dumps`` itself can write (its recursion limit)."""


def _nested(value: Any, depth: int) -> Any:
    for _ in range(depth):
        value = [value]
    return value


def _like(value: Any) -> st.SearchStrategy[Any]:
    """Hostile values in place of ``value``, most of them of its own JSON type."""
    if isinstance(value, str):
        return st.one_of(BROKEN_TEXT, TEXT, LONG_TEXT, HOSTILE)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return st.one_of(NUMBER, HOSTILE)
    if isinstance(value, list):
        return st.one_of(st.just([]), OVER_THE_LIMIT, HOSTILE, DEEP)
    return st.one_of(HOSTILE, DEEP)


# ------------------------------------------------------------------------------------------ bodies

TEXTS = [GOOD_TEXT, "The quick brown fox."]
IDS = [101, 7929, 102]
SEEDS: dict[str, list[dict[str, Any]]] = {
    "EmbeddingRequest": [
        {"input": GOOD_TEXT, "request_id": "r1"},
        {"input": TEXTS, "model": DEFAULT_MODEL_NAME, "user": "u1", "priority": 0},
        {"input": [IDS], "encoding_format": "base64", "embed_dtype": "float16", "endianness": "big"},
        {"input": GOOD_TEXT, "precision": "int8", "normalize": False, "truncate_prompt_tokens": 8},
        {"input": TEXTS, "encoding_format": "bytes", "dimensions": 384},
        {"input": TEXTS, "model": "default/not-specified", "dimensions": 0, "modality": "text"},  # infinity's
        {"messages": [{"role": "user", "content": [{"type": "text", "text": GOOD_TEXT}]}],
         "add_generation_prompt": True, "chat_template_kwargs": {"x": 1}},
    ],
    "PoolingHttpRequest": [
        {"input": GOOD_TEXT, "task": "token_embed", "request_id": "r2"},
        {"input": TEXTS, "task": "embed", "encoding_format": "bytes_only"},
    ],
    "ClassificationRequest": [{"input": [TEXTS, GOOD_TEXT], "use_activation": False, "request_id": "r3"},
                              {"input": TEXTS, "raw_scores": True, "model": "default/not-specified"}],  # infinity's
    "ScoreRequest": [
        {"queries": GOOD_TEXT, "documents": TEXTS, "request_id": "r4"},
        {"text_1": TEXTS, "text_2": TEXTS[::-1], "truncate_prompt_tokens": 10, "use_activation": True},
    ],
    "RerankRequest": [
        {"query": GOOD_TEXT, "documents": TEXTS, "top_n": 1, "request_id": "r5"},
        {"query": GOOD_TEXT, "documents": [{"text": GOOD_TEXT, "id": 7}], "return_documents": True,
         "max_tokens_per_doc": 4},
        {"query": GOOD_TEXT, "texts": TEXTS, "return_text": True, "truncate": True, "truncation_direction": "left",
         "raw_scores": True},
        {"query": GOOD_TEXT, "documents": TEXTS, "raw_scores": False, "return_documents": True, "top_n": 1,
         "model": "default/not-specified"},  # infinity's
    ],
    "TokenizeRequest": [
        {"prompt": GOOD_TEXT, "return_token_strs": True, "add_special_tokens": False},
        {"inputs": TEXTS},
    ],
    "DetokenizeRequest": [{"tokens": IDS, "model": DEFAULT_MODEL_NAME}],
    "EmbedRequest": [{"inputs": [GOOD_TEXT, IDS], "normalize": False, "truncate": True,
                      "truncation_direction": "Left"}],
    "TokenRequest": [{"inputs": GOOD_TEXT, "truncate": False}],
    "PredictRequest": [{"inputs": [TEXTS], "raw_scores": True}],
    "SimilarityRequest": [{"inputs": {"source_sentence": GOOD_TEXT, "sentences": TEXTS},
                           "parameters": {"truncate": True, "truncation_direction": "Right"}}],
    "DecodeRequest": [{"ids": [IDS, IDS[:2]], "skip_special_tokens": False}],
}
"""Valid bodies of each request schema (by its OpenAPI name), which the fuzz sends with a field or two
changed; a schema without seeds is fuzzed from the schema alone."""
NEW = object()
"""A slot of :func:`mutated` that adds a key to an object."""


@st.composite
def mutated(draw: st.DrawFn, seed: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """``seed`` with one or two values (at any depth) hostile, or keys added (``names``: every
    request schema's field names, or random ones) with hostile values."""
    body = copy.deepcopy(seed)
    slots: list[tuple[Any, Any]] = []

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            keys = [*node, NEW]
        elif isinstance(node, list):
            keys = list(range(len(node)))
        else:
            return
        for key in keys:
            slots.append((node, key))
            if key is not NEW:
                collect(node[key])

    collect(body)
    for node, key in draw(st.lists(st.sampled_from(slots), min_size=1, max_size=2)):
        if key is NEW:
            node[draw(st.sampled_from(names) | TEXT)] = draw(BROKEN_TEXT | HOSTILE)
        else:
            node[key] = draw(_like(node[key]))
    return body


@st.composite
def _object(draw: st.DrawFn, required: dict[str, st.SearchStrategy[Any]], optional: dict[str, st.SearchStrategy[Any]],
            extra: st.SearchStrategy[dict[Any, Any]]) -> dict[Any, Any]:
    """The ``extra`` keys, the required fields and up to three optional ones."""
    chosen = draw(st.lists(st.sampled_from(sorted(optional)), max_size=3, unique=True)) if optional else []
    return {**draw(extra), **{name: draw(required[name]) for name in required},
            **{name: draw(optional[name]) for name in chosen}}


class Bodies:
    """Request bodies from the app's OpenAPI schemas (``components``); ``words``: plausible strings."""

    def __init__(self, components: dict[str, Any], words: list[str]) -> None:
        self.components = components
        self.words = st.sampled_from(words)
        self.names = sorted({name for schema in components.values() for name in schema.get("properties", ())})

    def route(self, schema: dict[str, Any]) -> st.SearchStrategy[Any]:
        """A route's bodies: its seeds changed (half of them), from its schema (plausible or
        hostile), or anything at all."""
        seeds = SEEDS.get(schema.get("$ref", "").rsplit("/", 1)[-1], [])
        changed = [st.sampled_from(seeds).flatmap(lambda seed: mutated(seed, self.names))] * 3 if seeds else []
        return st.one_of(*changed, self.value(schema, hostile=False), self.value(schema, hostile=True), HOSTILE)

    def value(self, schema: dict[str, Any], *, hostile: bool) -> st.SearchStrategy[Any]:
        """Values of a JSON schema (OpenAPI 3.1 as FastAPI writes it). ``hostile``: any node may be a
        hostile value instead, and objects may carry extra keys (other bodies' field names, random ones)."""
        def inner(sub: dict[str, Any]) -> st.SearchStrategy[Any]:
            return self.value(sub, hostile=hostile)

        def wrap(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
            return st.one_of(plausible, plausible, HOSTILE, DEEP) if hostile else plausible

        while "$ref" in schema:
            schema = self.components[schema["$ref"].rsplit("/", 1)[1]]
        if "anyOf" in schema or "oneOf" in schema:
            return st.one_of([inner(sub) for sub in schema.get("anyOf", schema.get("oneOf"))])
        if "const" in schema:
            return wrap(st.just(schema["const"]))
        if "enum" in schema:
            return wrap(st.sampled_from(schema["enum"]))
        kind = schema.get("type")
        if kind == "array" and "prefixItems" in schema:
            return wrap(st.tuples(*map(inner, schema["prefixItems"])).map(list))
        if kind == "array":
            return wrap(st.lists(inner(schema.get("items", {})), min_size=0 if hostile else 1, max_size=4))
        if kind == "object" and "properties" in schema:
            fields = {name: inner(sub) for name, sub in schema["properties"].items()}
            required = {name: fields.pop(name) for name in schema.get("required", [])}
            extra = st.dictionaries(st.sampled_from(self.names) | TEXT, HOSTILE, max_size=2) if hostile else st.just({})
            return wrap(_object(required, fields, extra))
        plain = {"string": self.words, "integer": st.integers(-3, 300), "number": st.floats(-2, 2),
                 "boolean": st.booleans(), "null": st.none()}
        return wrap(plain.get(kind, HOSTILE))


# ------------------------------------------------------------------------------------------ garbage

JSON_CONTENT_TYPES = ["application/json", "application/json; charset=utf-8", "application/vnd.api+json"]
CONTENT_TYPES = st.sampled_from([
    *JSON_CONTENT_TYPES, None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
    "multipart/form-data; boundary=x", "application/octet-stream", "application/json; charset=latin-1", "*/*", "\x7f",
])
CURSED_JSON = st.sampled_from([
    b"", b"null", b"[]", b"1", b'"input"', b"{", b"}", b'{"input": ', b"NaN", b"-Infinity", b"\xef\xbb\xbf{}",
    b'{"input": "ok", "input": 1}', b'{"input": "\\ud800"}', b'{"\\ud800": 1}', b'{"input": "\xff\xfe"}',
    b'{"input": [' + b"9" * 5000 + b"]}",  # over Python's 4300-digit int conversion limit
    b"[" * 100_000, b'{"a":' * 100_000, "{}".encode("utf-16"), b'{"input": "ok"}\x00', b'{"input": 1e999}',
])


@st.composite
def garbage(draw: st.DrawFn, plausible: st.SearchStrategy[Any]) -> tuple[bytes, str | None]:
    """``(body, content type)``: random or cursed bytes, a ``plausible`` body as JSON cut short or
    under another content type, or over the size limit."""
    kind = draw(st.sampled_from(["bytes", "cursed", "cut", "mistyped", "oversized"]))
    content_type = draw(CONTENT_TYPES)
    if kind == "bytes":
        return draw(st.binary(max_size=256)), content_type
    if kind == "cursed":
        return draw(CURSED_JSON), content_type
    body = json.dumps(draw(plausible)).encode()
    if kind == "cut":
        return body[: draw(st.integers(0, max(0, len(body) - 1)))], draw(st.sampled_from(JSON_CONTENT_TYPES))
    if kind == "mistyped":
        return body, content_type
    return body + b" " * (LIMIT + 1 - len(body)) + draw(st.binary(max_size=8)), content_type


# ------------------------------------------------------------------------------------------ checks


@pytest.fixture(scope="module")
def client(server):
    """One keep-alive connection to the default server for the whole module."""
    with httpx.Client(base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=1)) as connection:
        yield connection


@pytest.fixture(scope="module")
def routes(server, client) -> list[dict[str, Any]]:
    """Every POST route of the app: ``path``, ``tei`` (a TEI route), ``schema`` (its request body's
    OpenAPI schema) and ``keys`` (its body's top-level fields; empty for a free-form object)."""
    spec = client.get("/openapi.json").json()
    found = []
    for route in every_route(server.app.routes):
        if isinstance(route, APIRoute) and "POST" in route.methods:
            schema = spec["paths"][route.path]["post"]["requestBody"]["content"]["application/json"]["schema"]
            resolved = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]] if "$ref" in schema else schema
            found.append({"path": route.path, "tei": isinstance(route, TeiRoute), "schema": schema,
                          "keys": frozenset(resolved.get("properties", ()))})
    assert len(found) >= 19 and {"/v1/embeddings", "/embed", "/invocations", "/"} <= {r["path"] for r in found}
    return found


@pytest.fixture(scope="module")
def bodies(client, routes) -> dict[str, st.SearchStrategy[Any]]:
    """Per route, its bodies (:meth:`Bodies.route`); a route taking any object (``/``,
    ``/invocations``) gets every other route's bodies."""
    components = client.get("/openapi.json").json()["components"]["schemas"]
    assert SEEDS.keys() <= components.keys(), "a seeded request schema was renamed: rename its seeds"
    maker = Bodies(components, [*TEXTS, DEFAULT_MODEL_NAME, "embed", "user", "Left", "w1 w2"])
    own = {r["path"]: maker.route(r["schema"]) for r in routes if r["keys"]}
    anything = st.one_of(list(own.values()))
    return {r["path"]: own.get(r["path"], anything) for r in routes}


@pytest.fixture(scope="module")
def expected(runtime):
    """The runtime's own embedding of the follow-up request's text."""
    return runtime.embed(GOOD_TEXT)


def _check_error(answer: httpx.Response, route: dict[str, Any], body: Any) -> None:
    """A 4xx is JSON in the route's shape: TEI's ``{"error", "error_type"}`` on TEI's routes (the
    size limit's 413 too), and on shared routes for a body with TEI's keys; else OpenAI's."""
    payload = answer.json()
    status = answer.status_code
    tei_allowed = route["tei"] or (isinstance(body, dict) and bool(TEI_KEYS & set(body))
                                   and (not route["keys"] or bool(TEI_KEYS & route["keys"])))
    if tei_allowed and set(payload) == {"error", "error_type"}:
        tei = TeiErrorAnswer.model_validate(payload, strict=True)  # the body /openapi.json documents
        assert tei.error and (status == 413 or TEI_STATUS[tei.error_type] == status), payload
        return
    assert not route["tei"], f"a TEI route answered OpenAI's shape: {payload}"
    assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}, payload
    error = ErrorAnswer.model_validate(payload, strict=True).error  # the body /openapi.json documents
    assert error.message and error.code == status and error.type == ERROR_TYPES[status], payload


def _parsed(content: bytes) -> Any:
    """The body as JSON, ``None`` when it is not JSON."""
    try:
        return json.loads(content)
    except (ValueError, RecursionError):
        return None


def _send(client: httpx.Client, route: dict[str, Any], content: bytes, content_type: str | None, expected: Any,
          connection: tuple[str, int]) -> int:
    """POST ``content`` to the route, check the answer, then a known-good request on the same
    connection; returns the fuzzed answer's status."""
    headers = {} if content_type is None else {"content-type": content_type}
    answer = client.post(route["path"], content=content, headers=headers)
    where = f"POST {route['path']} {content[:300]!r}"
    assert answer.status_code < 500, f"{where} -> {answer.status_code} {answer.text[:500]}"
    if answer.status_code >= 400:
        assert answer.headers["content-type"] == "application/json", where
        _check_error(answer, route, _parsed(content))
    follow = client.post("/v1/embeddings", json={"input": GOOD_TEXT})
    assert follow.status_code == 200, f"after {where}: {follow.status_code} {follow.text[:500]}"
    assert cosine_rows(follow.json()["data"][0]["embedding"], expected)[0] >= MIN_COSINE, where
    assert follow.extensions["network_stream"].get_extra_info("client_addr") == connection, f"reconnected after {where}"
    return answer.status_code


def _connection(client: httpx.Client) -> tuple[str, int]:
    """The client's side of its one connection."""
    answer = client.post("/v1/embeddings", json={"input": GOOD_TEXT})
    assert answer.status_code == 200
    return answer.extensions["network_stream"].get_extra_info("client_addr")


def test_structured_bodies_on_every_post_route(client, routes, bodies, expected):
    """Schema-built and changed valid bodies: never a 5xx, refusals in the route's shape, and the
    connection serves on."""
    connection = _connection(client)
    statuses: dict[str, Counter[int]] = {}
    for route in routes:
        seen = statuses[route["path"]] = Counter()

        @settings(FUZZ_SETTINGS, max_examples=STRUCTURED_EXAMPLES)
        @given(body=bodies[route["path"]])
        def fuzz(body: Any) -> None:
            content = json.dumps(body, ensure_ascii=True).encode()
            seen[_send(client, route, content, "application/json", expected, connection)] += 1  # noqa: B023

        fuzz()
    assert all(seen.total() == STRUCTURED_EXAMPLES for seen in statuses.values()), statuses
    # and valid bodies still reach the model, on vLLM's, OpenAI's and TEI's routes: each one's first
    # seed as it is (how many of the changed ones stayed valid is the draw's luck)
    for route in routes:
        if route["path"] in ("/v1/embeddings", "/score", "/rerank", "/tokenize", "/embed"):
            seed = SEEDS[route["schema"]["$ref"].rsplit("/", 1)[1]][0]
            answer = client.post(route["path"], json=seed)
            assert answer.status_code == 200, (route["path"], seed, answer.text)


def test_garbage_bodies_on_every_post_route(client, routes, bodies, expected):
    """Random bytes, cut or refused JSON, wrong content types, bodies over the limit: never a 5xx,
    and the connection serves on."""
    connection = _connection(client)
    for route in routes:

        @settings(FUZZ_SETTINGS, max_examples=GARBAGE_EXAMPLES)
        @given(sent=garbage(bodies[route["path"]]))
        def fuzz(sent: tuple[bytes, str | None]) -> None:
            content, content_type = sent
            _send(client, route, content, content_type, expected, connection)  # noqa: B023

        fuzz()
