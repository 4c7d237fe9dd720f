"""``embed`` on every surface, same inputs, same answers: ``Runtime.embed``, ``poolrunner embed``,
OpenAI's ``/v1/embeddings``, vLLM's ``/pooling`` (``task: embed``) and TEI's ``/embed``, for
the defaults, ``normalize`` off, truncation and the quantized precisions (sentence-transformers'
``int8``, ``binary``, ``ubinary``; TEI has none); the default answer is also transformers' own."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from poolrunner.core.testing.server import ServerThread
from tests.operations.surfaces import assert_close, cli, post

TEXTS = ["w1 w22 w333", "w10 w20 w30 w40 w50 w60", "w7", "w994 w5 w77 w123 w456"]


@pytest.fixture(scope="module")
def runtime(task_runtime, embed_folder):
    return task_runtime(embed_folder)


@pytest.fixture(scope="module")
def server(runtime):
    with ServerThread(runtime) as running:
        yield running


# (id, Runtime.embed keywords, `poolrunner embed` arguments, HTTP body fields, TEI body fields or None)
CASES = [
    ("default", {}, [], {}, {}),
    ("no-normalize", {"normalize": False}, ["--no-normalize"], {"normalize": False}, {"normalize": False}),
    ("truncate", {"truncate_prompt_tokens": 3}, ["--truncate", "3"], {"truncate_prompt_tokens": 3}, None),
    ("truncate-left", {"truncate_prompt_tokens": 3, "truncation_side": "left"},
     ["--truncate", "3", "--truncation-side", "left"], None, None),
    ("int8", {"precision": "int8"}, ["--precision", "int8"], {"precision": "int8"}, None),
    ("binary", {"precision": "binary"}, ["--precision", "binary"], {"precision": "binary"}, None),
    ("ubinary", {"precision": "ubinary"}, ["--precision", "ubinary"], {"precision": "ubinary"}, None),
]


@pytest.mark.parametrize(("api", "argv", "body", "tei"), [pytest.param(*case[1:], id=case[0]) for case in CASES])
def test_every_surface_gives_the_api_vectors(runtime, server, embed_folder, tmp_path, api, argv, body, tei):
    expected = runtime.embed(TEXTS, **api)
    quantized = expected.dtype != np.float32

    def check(actual):
        actual = np.asarray(actual)
        if quantized:  # integer codes: the same codes
            np.testing.assert_array_equal(actual.astype(expected.dtype), expected)
        else:
            assert_close(actual, expected)

    check(np.load(cli(["embed", "--model", str(embed_folder), *argv, *TEXTS], tmp_path / "out.npy")))
    if body is not None:
        embeddings = post(server.url, "/v1/embeddings", {"input": TEXTS, **body})
        check([item["embedding"] for item in embeddings["data"]])
        pooling = post(server.url, "/pooling", {"input": TEXTS, "task": "embed", **body})
        check([item["data"] for item in pooling["data"]])
    if tei is not None:
        check(post(server.url, "/embed", {"inputs": TEXTS, **tei}))


def test_base64_answers_the_same_float32_bytes(runtime, server):
    answer = post(server.url, "/v1/embeddings", {"input": TEXTS, "encoding_format": "base64"})
    vectors = [np.frombuffer(base64.b64decode(item["embedding"]), dtype=np.float32) for item in answer["data"]]
    assert_close(vectors, runtime.embed(TEXTS))


def test_one_text_is_one_vector_everywhere(runtime, server, embed_folder, tmp_path):
    expected = runtime.embed(TEXTS[0])
    assert expected.shape == (64,)
    assert_close(np.load(cli(["embed", "--model", str(embed_folder), TEXTS[0]], tmp_path / "one.npy"))[0], expected)
    assert_close(post(server.url, "/v1/embeddings", {"input": TEXTS[0]})["data"][0]["embedding"], expected)
    assert_close(post(server.url, "/embed", {"inputs": TEXTS[0]})[0], expected)


def test_the_api_answer_is_transformers_cls_row_normalized(runtime, token_reference, embed_folder):
    reference = token_reference(embed_folder)
    cls_rows = np.stack([rows[0] for rows in reference.rows(reference.token_ids(TEXTS))])
    assert_close(runtime.embed(TEXTS), cls_rows / np.linalg.norm(cls_rows, axis=1, keepdims=True))
