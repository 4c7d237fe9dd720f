"""``/v1/embeddings`` and ``/v1/models`` driven by the official ``openai`` client.

References: sentence-transformers on the same weights (independent), and the offline
``Runtime.embed`` (the server must answer what the Python API answers).
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

import poolrunner
from poolrunner.core.server import ServerSettings
from poolrunner.core.testing.server import ServerThread
from tests.conftest import SANITY_TEXT
from tests.helpers import MIN_COSINE, captured_logs, cosine_rows, normalized
from tests.server.conftest import API_KEY

TEXTS = ["A man is eating food.", "A cheetah chases its prey across a field.", "The new movie is awesome!"]
MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def client(keyed_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=API_KEY, max_retries=0)


def _decode(b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<f4")


def test_float_and_base64_are_the_same_vectors_as_the_offline_api(client, runtime, st_model, hf_tokenizer):
    as_float = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    as_base64 = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    default = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    floats = np.array([item.embedding for item in as_float.data], dtype=np.float32)
    decoded = np.stack([_decode(item.embedding) for item in as_base64.data])
    np.testing.assert_array_equal(floats, decoded)
    np.testing.assert_array_equal(floats, np.array([item.embedding for item in default.data], dtype=np.float32))
    assert [item.index for item in as_float.data] == [0, 1, 2]
    assert as_float.model == MODEL and as_float.object == "list"
    np.testing.assert_allclose(floats, runtime.embed(TEXTS), atol=2e-6)
    assert cosine_rows(floats, st_model.encode(TEXTS)).min() >= MIN_COSINE
    tokens = sum(len(hf_tokenizer(text)["input_ids"]) for text in TEXTS)
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == tokens


def test_token_id_inputs_embed_like_their_text(client, hf_tokenizer, st_model):
    ids = [hf_tokenizer(text)["input_ids"] for text in TEXTS]
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    many = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    single_text = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert len(one.data) == 1 and len(many.data) == 3
    reference = st_model.encode(TEXTS)
    assert cosine_rows(one.data[0].embedding, reference[0])[0] >= MIN_COSINE
    assert cosine_rows([item.embedding for item in many.data], reference).min() >= MIN_COSINE
    np.testing.assert_allclose(single_text.data[0].embedding, one.data[0].embedding, atol=2e-6)
    assert many.usage.prompt_tokens == sum(map(len, ids))


def test_dimensions_on_a_matryoshka_runtime(st_model):
    # MiniLM is not Matryoshka-trained: this checks the mechanics (slice, then normalize).
    runtime = poolrunner.Runtime(is_matryoshka=True, dtype="float32")
    with ServerThread(runtime) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        answer = client.embeddings.create(model=MODEL, input=TEXTS, dimensions=128, encoding_format="float")
        vectors = np.array([item.embedding for item in answer.data])
        assert vectors.shape == (3, 128)
        expected = normalized(st_model.encode(TEXTS)[:, :128])
        assert cosine_rows(vectors, expected).min() >= MIN_COSINE
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
        with pytest.raises(openai.BadRequestError, match=r"dimensions=385 is out of range for model .*: 1\.\.384"):
            client.embeddings.create(model=MODEL, input=TEXTS, dimensions=385)
        assert len(client.embeddings.create(model=MODEL, input="still serving").data) == 1


def test_dimensions_on_a_plain_model_is_a_bad_request(client, keyed_server, runtime, assert_serves,
                                                      poolrunner_step_recorder):
    steps = poolrunner_step_recorder(runtime)
    with pytest.raises(openai.BadRequestError, match="does not support Matryoshka dimensions") as caught:
        client.embeddings.create(model=MODEL, input=TEXTS, dimensions=64)
    assert caught.value.status_code == 400
    error = caught.value.body
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert keyed_server.serving.pending == 0 and not steps.in_flight
    assert len(client.embeddings.create(model=MODEL, input=SANITY_TEXT).data) == 1


@pytest.mark.parametrize(("payload", "message"), [
    ([], "input is empty: send at least one text or token-id list"),
    (["fine", ""], "input[1] is an empty string"),
    ("word " * 300, "input 0 has 302 tokens, more than the maximum of 256"),
    ([[101, 99999, 102]], "input 0: token id 99999 is outside the vocabulary [0, 30522)"),
])
def test_bad_input_raises_bad_request_and_the_server_still_serves(client, payload, message, sanity_reference):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL, input=payload)
    assert message in caught.value.body["message"]
    answer = client.embeddings.create(model=MODEL, input=SANITY_TEXT, encoding_format="float")
    assert cosine_rows(answer.data[0].embedding, sanity_reference)[0] >= MIN_COSINE


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError, match="'other-model' does not exist: this server serves"):
        client.embeddings.create(model="other-model", input="x")


def test_any_model_name_answers_clients_default_names(runtime, caplog):
    """``--any-model-name``: the OpenAI client left at LangChain's / OpenAI's default model name
    gets the one model's vectors; the first unknown name is logged once."""
    with ServerThread(runtime, ServerSettings(any_model_name=True)) as running, captured_logs(caplog):
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        for name in ("text-embedding-3-small", "text-embedding-ada-002"):
            answer = client.embeddings.create(model=name, input=[SANITY_TEXT], encoding_format="float")
            np.testing.assert_allclose(answer.data[0].embedding, runtime.embed(SANITY_TEXT), atol=2e-6)
            assert answer.model == "all-MiniLM-L6-v2"
    records = {id(record): record for record in caplog.records}.values()  # a record may reach caplog twice
    logged = [record.getMessage() for record in records if "--any-model-name" in record.getMessage()]
    assert logged == ["answering requests for model 'text-embedding-3-small' (and any other unknown name) with "
                      "'all-MiniLM-L6-v2' (--any-model-name)"]


def test_any_model_name_needs_a_single_model(runtime):
    from poolrunner.core.server import ServedModel, create_app

    with pytest.raises(ValueError, match=r"^any_model_name \(--any-model-name\) needs a single model"):
        create_app([ServedModel(runtime, ("a",)), ServedModel(runtime, ("b",))], ServerSettings(any_model_name=True))


def test_models_lists_the_served_model(client, runtime):
    models = client.models.list().data
    assert [model.id for model in models] == [MODEL]


def test_a_wrong_or_missing_key_is_an_authentication_error(keyed_server):
    wrong = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="invalid or missing API key"):
        wrong.embeddings.create(model=MODEL, input="x")
    with httpx.Client(base_url=keyed_server.url) as plain:
        assert plain.get("/health").status_code == 200  # open, as /metrics is without --protect-metrics
        assert plain.get("/metrics").status_code == 200
        for method, path in [("POST", "/v1/embeddings"), ("GET", "/v1/models"), ("POST", "/classify"),
                             ("POST", "/score"), ("POST", "/rerank"), ("POST", "/pooling"),
                             ("POST", "/tokenize"), ("GET", "/nope")]:
            answer = plain.request(method, path, json={"input": "x"})
            assert answer.status_code == 401, path
            assert answer.json()["error"]["type"] == "authentication_error"
            assert answer.headers["www-authenticate"] == "Bearer"
        assert plain.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_settings_reject_a_request_limit_above_the_queue_limit():
    with pytest.raises(ValueError, match=r"max_inputs_per_request \(16\) is larger than max_waiting_requests \(8\)"):
        ServerSettings(max_inputs_per_request=16, max_waiting_requests=8)
