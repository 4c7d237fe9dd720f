"""Answers that must not break a connection: text that is not valid Unicode (a lone surrogate,
e.g. half an emoji cut by a JavaScript client) is a 400 naming the input and the character on
every route family, and the Python API refuses it the same way; so are the fields answers send
back (``request_id``, a rerank document's other fields), which an answer could not carry; a server
bug is a JSON 500 with an id. The keep-alive connection survives both."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from poolrunner import InvalidRequestError

BROKEN = "caf\u00e9 \ud83d"  # the first half of an emoji's UTF-16 pair, alone
MESSAGE = ("is not valid Unicode text: character 5 is U+D83D, a lone surrogate (half of a UTF-16 pair); "
           "send whole characters")


def test_the_python_api_refuses_it_and_still_serves(runtime):
    with pytest.raises(InvalidRequestError) as caught:
        runtime.embed(["fine", BROKEN])
    assert (str(caught.value), caught.value.param) == (f"input 1 {MESSAGE}", "input")
    with pytest.raises(InvalidRequestError) as caught:  # named as sent, though scoring pools texts sorted
        runtime.score(["fine", "also fine"], ["fine", BROKEN])
    assert (str(caught.value), caught.value.param) == (f"documents[1] {MESSAGE}", "documents")
    with pytest.raises(InvalidRequestError) as caught:
        runtime.rerank(BROKEN, ["fine"])
    assert (str(caught.value), caught.value.param) == (f"query {MESSAGE}", "query")
    assert runtime.embed("fine").shape == (384,)


@pytest.mark.parametrize(("path", "body", "answer"), [
    ("/v1/embeddings", {"input": ["fine", BROKEN]}, {"error": f"input 1 {MESSAGE}"}),
    ("/pooling", {"input": [BROKEN]}, {"error": f"input 0 {MESSAGE}"}),
    ("/tokenize", {"prompt": BROKEN}, {"error": f"input 0 {MESSAGE}"}),
    ("/tokenize", {"inputs": [BROKEN]}, {"tei": f"input 0 {MESSAGE}"}),
    ("/embed", {"inputs": BROKEN}, {"tei": f"input 0 {MESSAGE}"}),
    ("/rerank", {"query": "fine", "texts": ["zebra", BROKEN]}, {"tei": f"texts[1] {MESSAGE}"}),  # TEI's fields
    # answers carry these back: they were a 500 (UnicodeEncodeError writing the answer)
    ("/v1/embeddings", {"input": "fine", "request_id": BROKEN},
     {"error": "request_id: not valid Unicode text: character 5 is U+D83D, a lone surrogate (half of a UTF-16 "
               "pair); send whole characters"}),
    ("/rerank", {"query": "fine", "documents": [{"text": "fine", "title": BROKEN}], "return_documents": True},
     {"error": "documents[0].title is not valid Unicode text: it holds a lone surrogate (half of a UTF-16 pair); "
               "send whole characters"}),
])
def test_every_route_answers_400_and_the_connection_survives(server, runtime, path, body, answer):
    with httpx.Client(base_url=server.url) as client:  # one keep-alive connection for both requests
        # json.dumps escapes the surrogate as \\ud83d, as a JavaScript client sends it (httpx's own
        # encoder would refuse to write it).
        refused = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        if "tei" in answer:
            assert (refused.status_code, refused.json()) == (422, {"error": answer["tei"], "error_type": "Validation"})
        else:
            assert refused.status_code == 400 and refused.json()["error"]["message"] == answer["error"]
            if path in ("/v1/embeddings", "/pooling") and "request_id" not in body:
                assert refused.json()["error"]["param"] == "input"
        again = client.post("/v1/embeddings", json={"input": "fine", "encoding_format": "float"})
        np.testing.assert_allclose(again.json()["data"][0]["embedding"], runtime.embed("fine"), rtol=0, atol=1e-6)


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/rerank", {"query": BROKEN, "documents": ["fine", "good", "ok"]}, "query"),
    ("/v1/rerank", {"query": BROKEN, "documents": [{"text": "fine"}], "max_tokens_per_doc": 3}, "query"),
    ("/rerank", {"query": "fine", "documents": ["zebra", "fine", BROKEN]}, "documents[2]"),
    ("/score", {"text_1": BROKEN, "text_2": ["fine", "good"]}, "text_1"),
    ("/score", {"text_1": ["fine", BROKEN], "text_2": ["good", "ok"]}, "text_1[1]"),
    ("/score", {"text_1": "fine", "text_2": ["good", BROKEN]}, "text_2[1]"),
    ("/v1/score", {"queries": ["zebra", "fine"], "documents": [BROKEN, "ok"]}, "documents[0]"),
])
def test_scoring_names_the_field_and_position_sent(server, runtime, path, body, field):
    """Scoring pools each distinct text once, in sorted order; the error still names the text as
    the client sent it (it named the sorted position, "input 3", with no param)."""
    with httpx.Client(base_url=server.url) as client:
        refused = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        assert refused.status_code == 400
        assert refused.json() == {"error": {"message": f"{field} {MESSAGE}", "type": "invalid_request_error",
                                            "param": field.split("[")[0], "code": 400}}
        again = client.post("/rerank", json={"query": "fine", "documents": ["fine", "good"]})
        assert again.status_code == 200 and [r["index"] for r in again.json()["results"]] == [0, 1]


def test_a_bug_is_a_json_500_with_an_id_and_the_connection_survives(server, runtime, monkeypatch, caplog):
    """Not the client's doing (here a bug injected into the front end): OpenAI's error shape,
    the traceback logged under the id the answer quotes, and the next request served."""
    real = runtime.frontend.params

    def broken(*args, **kwargs):
        monkeypatch.setattr(runtime.frontend, "params", real)  # fails once
        raise RuntimeError("injected bug")

    monkeypatch.setattr(runtime.frontend, "params", broken)
    with httpx.Client(base_url=server.url) as client, caplog.at_level("ERROR", logger="poolrunner.core.server"):
        failed = client.post("/v1/embeddings", json={"input": "fine"})
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["message"].startswith("internal server error (id ") and error["code"] == 500
        error_id = error["message"].split("(id ")[1].split(")")[0]
        assert any(error_id in record.getMessage() and record.exc_info for record in caplog.records)
        again = client.post("/v1/embeddings", json={"input": "fine", "encoding_format": "float"})
        np.testing.assert_allclose(again.json()["data"][0]["embedding"], runtime.embed("fine"), rtol=0, atol=1e-6)


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/rerank", {"query": "fine", "documents": ["zebra", "fine", "LONG"]}, "documents[2]"),
    ("/rerank", {"query": "LONG", "documents": ["fine"]}, "query"),
    ("/score", {"text_1": ["fine", "good"], "text_2": ["LONG", "ok"]}, "text_2[0]"),
    ("/v1/score", {"queries": "LONG", "documents": ["fine", "good"]}, "queries"),
])
def test_a_too_long_text_is_named_as_sent(server, runtime, text_with_tokens, path, body, field):
    """A bi-encoder pools each distinct text once, sorted: the error still names the text as the
    client sent it (it said "input 2" of the sorted texts, with no param)."""
    long_text = text_with_tokens(300, 5)
    body = {key: ([long_text if v == "LONG" else v for v in value] if isinstance(value, list)
                  else long_text if value == "LONG" else value) for key, value in body.items()}
    refused = httpx.post(f"{server.url}{path}", json=body)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["message"].startswith(f"{field} has 300 tokens, more than the maximum of 256"), error
    assert error["param"] == field.split("[")[0]
    again = httpx.post(f"{server.url}/rerank", json={"query": "fine", "documents": ["fine", "good"]})
    assert again.status_code == 200
