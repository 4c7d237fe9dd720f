"""A failed engine step answers the client a 500 (TEI's routes: a 424) that names only the request
id; the cause, which may hold paths or another client's data, goes to the log under that id. The
server answers the next request (sentence-transformers' vector)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

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
