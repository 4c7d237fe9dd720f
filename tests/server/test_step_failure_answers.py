"""A failed engine step answers the client a 500 (TEI's routes: a 424) that names only the request
id; the cause, which may hold paths or another client's data, goes to the log under that id. An
output holding NaN or infinities is refused (422; TEI: 424), never written as JSON ``null`` or as
quantized codes. The server answers the next request (sentence-transformers' vector)."""

from __future__ import annotations

import re

import httpx
import numpy as np
import pytest

from poolrunner.core.errors import NonFiniteOutputError
from tests.helpers import MIN_COSINE, captured_logs, cosine_rows

POISON = "this text carries the poison token"
GOOD = "A cat sat on the mat."
SECRET = "/secret/path/of/the/server"


@pytest.fixture
def poisoned(runtime, monkeypatch):
    """The shared runtime's forward raises, with a secret in its message, on any batch holding
    the token of "poison"."""
    token = runtime.inputs.tokenizer.convert_tokens_to_ids("poison")
    execute = runtime._engine.runner.execute

    def guarded(batch):
        if (batch.input_ids == token).any():
            raise RuntimeError(f"cannot read {SECRET}")
        return execute(batch)

    monkeypatch.setattr(runtime._engine.runner, "execute", guarded)


@pytest.mark.parametrize(("route", "body", "status"), [
    ("/v1/embeddings", {"input": [POISON]}, 500),
    ("/embed", {"inputs": [POISON]}, 424),
])
def test_a_failed_step_answers_the_request_id_and_logs_the_cause(server, poisoned, caplog, st_model, route, body,
                                                                 status):
    with httpx.Client(base_url=server.url, timeout=60) as client, captured_logs(caplog):
        answer = client.post(route, json=body)
        assert answer.status_code == status, answer.text
        request_id = answer.headers["x-request-id"]
        error = answer.json()["error"]
        message = error["message"] if isinstance(error, dict) else error
        assert message == (f"the engine step running this request failed (request id {request_id}); the server "
                           "logged the cause")
        logged = [record for record in caplog.records if request_id in record.getMessage() and record.exc_info]
        assert logged and SECRET in str(logged[0].exc_info[1])
        good = client.post("/v1/embeddings", json={"input": [GOOD]})
    assert good.status_code == 200, good.text
    vector = np.array([good.json()["data"][0]["embedding"]])
    assert cosine_rows(vector, st_model.encode([GOOD])).min() >= MIN_COSINE


@pytest.fixture
def nan_token(runtime):
    """The shared runtime's embedding row of "poison" is NaN (as a broken checkpoint's or an
    overflow's would be) for one test."""
    weight = runtime._engine.runner.model.get_input_embeddings().weight
    token = runtime.inputs.tokenizer.convert_tokens_to_ids("poison")
    kept = weight.data[token].clone()
    weight.data[token] = float("nan")
    yield
    weight.data[token] = kept


NON_FINITE = ("the model's output holds NaN or infinite values (384 of 384): the model overflowed on an input at its "
              "dtype, or its weights (or a LoRA adapter's) hold such values; the request is refused rather than "
              "answered with values that are not numbers")


@pytest.mark.parametrize(("route", "body", "status"), [
    ("/v1/embeddings", {"input": [GOOD, POISON]}, 422),
    ("/v1/embeddings", {"input": [POISON], "encoding_format": "base64"}, 422),
    ("/v2/embed", {"texts": [POISON], "input_type": "search_document", "embedding_types": ["int8"]}, 422),
    ("/embed", {"inputs": [POISON]}, 424),
])
def test_an_output_that_is_not_a_number_is_refused(server, runtime, nan_token, st_model, route, body, status):
    with pytest.raises(NonFiniteOutputError, match=re.escape(NON_FINITE)):
        runtime.embed([POISON])
    with httpx.Client(base_url=server.url, timeout=60) as client:
        answer = client.post(route, json=body)
        assert answer.status_code == status, answer.text
        error = answer.json()["error"]
        assert (error["message"] if isinstance(error, dict) else error) == NON_FINITE
        good = client.post("/v1/embeddings", json={"input": [GOOD]})
    assert good.status_code == 200, good.text
    vector = np.array([good.json()["data"][0]["embedding"]])
    assert cosine_rows(vector, st_model.encode([GOOD])).min() >= MIN_COSINE
