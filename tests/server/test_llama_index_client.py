"""LlamaIndex's OpenAI embeddings (``llama-index-embeddings-openai-like``, and
``llama-index-embeddings-openai`` with its defaults) against a real server: the Python API's vectors."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from llama_index.embeddings.openai_like import OpenAILikeEmbedding

from poolrunner.core.server import ServerSettings
from poolrunner.core.testing.server import ServerThread
from tests.helpers import MIN_COSINE, cosine_rows
from tests.server.conftest import API_KEY

TEXTS = ["A man is eating food.", "A cheetah chases its prey across a field.", "The new movie is awesome!"]
MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def embedding(keyed_server) -> OpenAILikeEmbedding:
    return OpenAILikeEmbedding(model_name=MODEL, api_base=f"{keyed_server.url}/v1", api_key=API_KEY, max_retries=0,
                               embed_batch_size=2)  # two requests for three texts


def test_text_and_query_embeddings_equal_the_python_api(embedding, runtime, st_model):
    texts = np.array(embedding.get_text_embedding_batch(TEXTS), dtype=np.float32)
    np.testing.assert_allclose(texts, runtime.embed(TEXTS), rtol=0, atol=1e-6)
    assert cosine_rows(texts, st_model.encode(TEXTS)).min() >= MIN_COSINE
    query = np.array(embedding.get_query_embedding(TEXTS[0]), dtype=np.float32)
    np.testing.assert_allclose(query, runtime.embed(TEXTS[0]), rtol=0, atol=1e-6)


def test_async_embeddings_equal_the_python_api(keyed_server, runtime):
    async def embed() -> list[list[float]]:
        async with httpx.AsyncClient() as http:  # closed inside the event loop that used it
            client = OpenAILikeEmbedding(model_name=MODEL, api_base=f"{keyed_server.url}/v1", api_key=API_KEY,
                                         max_retries=0, async_http_client=http)
            return await client.aget_text_embedding_batch(TEXTS)

    vectors = np.array(asyncio.run(embed()), dtype=np.float32)
    np.testing.assert_allclose(vectors, runtime.embed(TEXTS), rtol=0, atol=1e-6)


def test_openai_embedding_defaults_work_through_a_served_name_alias(runtime):
    """``llama-index-embeddings-openai`` with its defaults asks for text-embedding-ada-002: serving
    that name as an alias (``--served-model-name all-MiniLM-L6-v2 text-embedding-ada-002``) is
    the one setting it needs."""
    from llama_index.embeddings.openai import OpenAIEmbedding

    settings = ServerSettings(served_model_name=[MODEL, "text-embedding-ada-002"])
    with ServerThread(runtime, settings) as server:
        embedding = OpenAIEmbedding(api_base=f"{server.url}/v1", api_key="unused", max_retries=0)
        vectors = np.array(embedding.get_text_embedding_batch(TEXTS), dtype=np.float32)
    np.testing.assert_allclose(vectors, runtime.embed(TEXTS), rtol=0, atol=1e-6)
