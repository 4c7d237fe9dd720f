"""Cohere's v2 embed of texts (``POST /v2/embed``) driven by Cohere's own client, against
sentence-transformers on the same weights; its errors name Cohere's fields, not the core's."""

from __future__ import annotations

import cohere
import httpx
import numpy as np
import pytest
from sentence_transformers.util.quantization import quantize_embeddings

from tests.conftest import SANITY_TEXT
from tests.helpers import MIN_COSINE, cosine_rows

TEXTS = ["A man is eating food.", "A cheetah chases its prey across a field.", "The new movie is awesome!"]


def test_cohere_client_embeds_texts_as_sentence_transformers(server, st_model, hf_tokenizer):
    with httpx.Client(timeout=60) as transport:
        sdk = cohere.ClientV2(api_key="unused", base_url=server.url, httpx_client=transport)
        answer = sdk.embed(model="all-MiniLM-L6-v2", input_type="search_document", texts=TEXTS,
                           embedding_types=["float", "int8", "ubinary"])
    floats = np.array(answer.embeddings.float_, dtype=np.float32)
    assert cosine_rows(floats, st_model.encode(TEXTS)).min() >= MIN_COSINE
    np.testing.assert_array_equal(answer.embeddings.int8, quantize_embeddings(floats, precision="int8"))
    np.testing.assert_array_equal(answer.embeddings.ubinary, quantize_embeddings(floats, precision="ubinary"))
    tokens = sum(len(hf_tokenizer(text)["input_ids"]) for text in TEXTS)
    assert answer.meta.billed_units.input_tokens == answer.meta.tokens.input_tokens == tokens


def test_input_type_may_be_left_out_as_vllm_allows(server, st_model):
    """vLLM's /v2/embed takes a body without input_type (Cohere requires it; it applies no prompt
    here either way): the same vectors."""
    answer = httpx.post(f"{server.url}/v2/embed", json={"texts": TEXTS, "embedding_types": ["float"]})
    assert answer.status_code == 200, answer.text
    assert cosine_rows(np.array(answer.json()["embeddings"]["float"]), st_model.encode(TEXTS)).min() >= MIN_COSINE


@pytest.mark.parametrize(("fields", "message", "param"), [
    ({"output_dimension": -1}, "output_dimension must be a positive integer, got -1", "output_dimension"),
    ({"output_dimension": 64}, "does not support Matryoshka dimensions (got output_dimension=64)", "output_dimension"),
    ({"max_tokens": 0}, "max_tokens=0 is out of range: use -1 (the model maximum) or 2..256", "max_tokens"),
    ({"texts": ["a b"] * 2049}, "texts has 2049 items, more than the limit of 2048 per request", "texts"),
    ({"texts": ["a b", "word " * 2000], "truncate": "NONE"},
     'texts[1] has 10000 characters, more than the limit of 8192 per input (max_input_chars, the --max-input-chars '
     'flag); shorten it or send "truncate": "END" (or "START")', "texts"),
    ({"texts": ["a b", "word " * 300], "truncate": "NONE"},
     'texts[1] has 302 tokens, more than the maximum of 256 (max_model_len of all-MiniLM-L6-v2); shorten it or send '
     '"truncate": "END" (or "START")', "texts"),
    ({"embedding_types": ["float", "int8"]}, "embedding_types int8 needs two inputs or more: its codes are "
     "calibrated on the request's own vectors (sentence-transformers' quantize_embeddings), and one vector has no "
     "range", "embedding_types"),
], ids=["dimension", "not-matryoshka", "max-tokens", "count", "chars", "tokens", "one-int8"])
def test_errors_name_the_cohere_fields_and_the_server_serves_on(server, sanity_reference, fields, message, param):
    body = {"input_type": "search_query", "texts": ["a b"], **fields}
    refused = httpx.post(f"{server.url}/v2/embed", json=body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert message in error["message"] and error["param"] == param, error
    assert "--truncate-prompt-tokens" not in error["message"] and "ranges" not in error["message"]
    assert "dimensions=" not in error["message"] and "truncate_prompt_tokens" not in error["message"]
    good = httpx.post(f"{server.url}/v2/embed", json={"input_type": "search_query", "texts": [SANITY_TEXT]})
    assert cosine_rows(good.json()["embeddings"]["float"], sanity_reference)[0] >= MIN_COSINE
