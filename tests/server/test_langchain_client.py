"""LangChain's ``OpenAIEmbeddings`` (langchain-openai) against a real server.

With ``check_embedding_ctx_length=False`` LangChain sends the texts and gets the Python API's
vectors. Its default instead tokenizes with OpenAI's tiktoken and sends those ids: the server
reads them with ``--token-id-inputs`` (:mod:`.test_tiktoken_inputs`); without it ids beyond the
model's vocabulary are refused with a 400 naming the setting, while ids that happen to fall
inside it cannot be told from the model's own ids (README, "Clients").
"""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import openai
import pytest
from langchain_openai import OpenAIEmbeddings

from tests.helpers import MIN_COSINE, cosine_rows
from tests.server.conftest import API_KEY

TEXTS = ["A man is eating food.", "A cheetah chases its prey across a field.", "The new movie is awesome!"]
MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def embeddings(keyed_server) -> OpenAIEmbeddings:
    return OpenAIEmbeddings(model=MODEL, base_url=f"{keyed_server.url}/v1", api_key=API_KEY,
                            check_embedding_ctx_length=False, max_retries=0)


def test_embed_documents_and_query_equal_the_python_api(embeddings, runtime, st_model):
    documents = np.array(embeddings.embed_documents(TEXTS), dtype=np.float32)
    np.testing.assert_allclose(documents, runtime.embed(TEXTS), rtol=0, atol=1e-6)
    assert cosine_rows(documents, st_model.encode(TEXTS)).min() >= MIN_COSINE
    query = np.array(embeddings.embed_query(TEXTS[1]), dtype=np.float32)
    np.testing.assert_allclose(query, runtime.embed(TEXTS[1]), rtol=0, atol=1e-6)


def test_async_embedding_equals_the_python_api(keyed_server, runtime):
    async def embed() -> list[list[float]]:
        async with httpx.AsyncClient() as http:  # closed here, inside the event loop that used it
            client = OpenAIEmbeddings(model=MODEL, base_url=f"{keyed_server.url}/v1", api_key=API_KEY,
                                      check_embedding_ctx_length=False, max_retries=0, http_async_client=http)
            return await client.aembed_documents(TEXTS)

    documents = asyncio.run(embed())
    np.testing.assert_allclose(np.array(documents, dtype=np.float32), runtime.embed(TEXTS), rtol=0, atol=1e-6)


def test_foreign_token_ids_beyond_the_vocabulary_are_a_400(keyed_server, runtime):
    """What LangChain's default sends: tiktoken ids (cl100k_base runs to 100,255). Those past a
    BERT vocabulary of 30,522 are refused; common words have low ids in both vocabularies, so a
    text of only those would pass (why README asks for check_embedding_ctx_length=False)."""
    client = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL, input=[[791, 45892, 99081, 13]])
    assert "30522" in caught.value.message and "45892" in caught.value.message
    assert "--token-id-inputs tiktoken:cl100k_base" in caught.value.message
    vectors = client.embeddings.create(model=MODEL, input=TEXTS[:1], encoding_format="float")  # still serves
    np.testing.assert_allclose(vectors.data[0].embedding, runtime.embed(TEXTS[0]), rtol=0, atol=1e-6)
