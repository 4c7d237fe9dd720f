"""The score and rerank calls of vLLM, Jina, Cohere (its real SDK, v1 and v2) and TEI, and the
tokenize / detokenize / model routes those clients use, against a real server.

Expected values come from the offline Python API (``Runtime.score`` / ``rerank``, themselves
tested against sentence-transformers and transformers) or from the tokenizer itself, never from
the server. Every rejected request is followed by one that must still be served.
"""

from __future__ import annotations

import re
from pathlib import Path

import cohere
import httpx
import numpy as np
import pytest
from cohere.types import RerankResponse as CohereV1Response
from cohere.v2.types import V2RerankResponse

import poolrunner
from poolrunner.core.testing.server import ServerThread
from tests.conftest import SANITY_TEXT

QUERY = "Fires threaten homes in Australia."
DOCUMENTS = ["Shares dropped at the start of the week.", "Bushfires are burning out of control near Sydney.",
             "Someone performs music in front of an audience.", "Firefighters battle blazes in New South Wales."]
QUERIES = ["A man is playing a guitar.", "The stock market fell sharply on Monday."]


@pytest.fixture(scope="module")
def cross_encoder(minilm_classifier_folder, classifier_runtime):
    """A served one-label classifier (real MiniLM weights, seeded head) and its offline runtime."""
    runtime = classifier_runtime(minilm_classifier_folder(1))
    with ServerThread(runtime) as running:
        yield running, runtime


@pytest.fixture
def cohere_clients(cross_encoder):
    """Cohere's v2 and v1 clients on the cross-encoder's server, their connections closed after."""
    running, _ = cross_encoder
    with httpx.Client() as connection:
        yield (cohere.ClientV2(base_url=running.url, api_key="x", httpx_client=connection),
               cohere.Client(base_url=running.url, api_key="x", httpx_client=connection))


def _ok(answer: httpx.Response) -> object:
    assert answer.status_code == 200, answer.text
    return answer.json()


def _error(answer: httpx.Response, status: int = 400) -> tuple[str, str | None]:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error["message"], error["param"]


def _still_serves(url: str, runtime) -> None:
    body = _ok(httpx.post(f"{url}/score", json={"queries": SANITY_TEXT, "documents": DOCUMENTS[:2]}))
    scores = [item["score"] for item in body["data"]]
    np.testing.assert_allclose(scores, runtime.score(SANITY_TEXT, DOCUMENTS[:2]), atol=1e-6)


def _first_tokens(tokenizer, text: str, k: int) -> str:
    """``text`` cut to its first ``k`` tokens (special tokens not counted), decoded; checked to
    read back as exactly those tokens."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= k:
        return text
    cut = tokenizer.decode(ids[:k])
    assert tokenizer(cut, add_special_tokens=False)["input_ids"] == ids[:k]
    return cut


# --------------------------------------------------------------------------- /score, /v1/score


SCORE_FORMS = [("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2")]


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
@pytest.mark.parametrize(("first", "second"), SCORE_FORMS)
def test_every_vllm_score_form_equals_the_python_api(server, runtime, path, first, second):
    one_to_many = _ok(httpx.post(f"{server.url}{path}", json={first: QUERY, second: DOCUMENTS}))
    assert [item["index"] for item in one_to_many["data"]] == [0, 1, 2, 3]
    assert {item["object"] for item in one_to_many["data"]} == {"score"}
    np.testing.assert_allclose([item["score"] for item in one_to_many["data"]], runtime.score(QUERY, DOCUMENTS),
                               atol=1e-6)
    pairs = _ok(httpx.post(f"{server.url}{path}", json={first: QUERIES, second: DOCUMENTS[:2]}))
    np.testing.assert_allclose([item["score"] for item in pairs["data"]], runtime.score(QUERIES, DOCUMENTS[:2]),
                               atol=1e-6)
    one = _ok(httpx.post(f"{server.url}{path}", json={first: QUERY, second: DOCUMENTS[1]}))
    np.testing.assert_allclose(one["data"][0]["score"], runtime.score(QUERY, DOCUMENTS[1]), atol=1e-6)
    assert one["usage"]["prompt_tokens"] == one["usage"]["total_tokens"] > 0


def test_score_forms_on_a_cross_encoder(cross_encoder):
    running, runtime = cross_encoder
    expected = runtime.score(QUERY, DOCUMENTS)
    for first, second in SCORE_FORMS:
        body = _ok(httpx.post(f"{running.url}/v1/score", json={first: QUERY, second: DOCUMENTS}))
        np.testing.assert_allclose([item["score"] for item in body["data"]], expected, atol=1e-6)


FORMS_MESSAGE = ("send exactly one pair of fields (queries + documents, queries + items, data_1 + data_2, "
                 "text_1 + text_2)")


@pytest.mark.parametrize(("body", "got", "param"), [
    ({}, "none of them", None),
    ({"queries": "a"}, "queries", "queries"),
    ({"text_1": "a", "documents": ["b"]}, "documents, text_1", "documents"),
    ({"queries": "a", "documents": "b", "items": "c"}, "queries, documents, items", "queries"),
    ({"data_1": "a", "text_2": "b"}, "data_1, text_2", "data_1"),
])
def test_score_needs_exactly_one_form(server, runtime, body, got, param):
    message, field = _error(httpx.post(f"{server.url}/score", json=body))
    assert message == f"{FORMS_MESSAGE}; got {got}"
    assert field == param
    _still_serves(server.url, runtime)


@pytest.mark.parametrize(("body", "message", "param"), [
    ({"queries": "a", "documents": [{"content": [{"type": "text", "text": "b"}]}]},  # vLLM's multimodal item
     "documents[0] must be a string, got {'content': [{'text': 'b', 'type': 'text'}]}", "documents"),
    ({"queries": "a", "documents": ["b", None]}, "documents[1] must be a string, got None", "documents"),
    ({"text_1": 5, "text_2": ["b"]}, "text_1 must be a string or a list of strings, got 5", "text_1"),
])
def test_a_score_side_of_another_kind_is_named(server, runtime, body, message, param):
    """As ``Runtime.score`` names it: the core checks the sides for every surface."""
    assert _error(httpx.post(f"{server.url}/score", json=body)) == (message, param)
    _still_serves(server.url, runtime)


# --------------------------------------------------------------------------- /rerank: vLLM and Jina


def test_existing_rerank_body_answers_as_before(server, runtime):
    """vLLM's answer: every result carries its document (vLLM's ``RerankResult.document`` is
    required) unless ``return_documents`` is false; ``top_n`` 0 is vLLM's default: all."""
    body = _ok(httpx.post(f"{server.url}/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 3}))
    assert set(body) == {"id", "model", "usage", "results"} and body["id"].startswith("rerank-")
    offline = runtime.rerank(QUERY, DOCUMENTS, top_n=3)
    assert [item["index"] for item in body["results"]] == [result.index for result in offline]
    np.testing.assert_allclose([item["relevance_score"] for item in body["results"]],
                               [result.score for result in offline], atol=1e-6)
    assert [item["document"] for item in body["results"]] == [{"text": DOCUMENTS[r.index]} for r in offline]
    bare = _ok(httpx.post(f"{server.url}/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 0,
                                                         "return_documents": False}))
    assert [set(item) for item in bare["results"]] == [{"index", "relevance_score"}] * len(DOCUMENTS)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_vllm_and_jina_bodies_with_text_objects(server, runtime, path):
    documents = [DOCUMENTS[0], {"text": DOCUMENTS[1]}, {"text": DOCUMENTS[2]}, DOCUMENTS[3]]
    jina = {"model": "all-MiniLM-L6-v2", "query": QUERY, "documents": documents, "top_n": 2, "return_documents": True}
    body = _ok(httpx.post(f"{server.url}{path}", json=jina))
    offline = runtime.rerank(QUERY, DOCUMENTS, top_n=2, return_documents=True)
    assert [item["index"] for item in body["results"]] == [result.index for result in offline]
    assert [item["document"] for item in body["results"]] == [{"text": result.document} for result in offline]
    np.testing.assert_allclose([item["relevance_score"] for item in body["results"]],
                               [result.score for result in offline], atol=1e-6)
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] > 0  # Jina reads total_tokens
    assert body["model"] == "all-MiniLM-L6-v2"
    if path == "/rerank":
        assert "meta" not in body
    else:
        assert body["meta"] == {"api_version": {"version": path[2]}, "billed_units": {"search_units": 1}}


def test_one_string_is_one_document_as_in_vllm(server, runtime):
    body = _ok(httpx.post(f"{server.url}/rerank", json={"query": QUERY, "documents": DOCUMENTS[1],
                                                        "return_documents": True}))
    assert [item["index"] for item in body["results"]] == [0]
    assert body["results"][0]["document"] == {"text": DOCUMENTS[1]}
    np.testing.assert_allclose(body["results"][0]["relevance_score"], runtime.score(QUERY, DOCUMENTS[1]), atol=1e-6)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_max_tokens_per_doc_cuts_only_the_documents(server, runtime, hf_tokenizer, k):
    long_query = QUERY + " " + QUERY  # longer than k: it must stay whole
    cut = [_first_tokens(hf_tokenizer, document, k) for document in DOCUMENTS]
    assert cut != DOCUMENTS
    body = _ok(httpx.post(f"{server.url}/v1/rerank", json={"query": long_query, "documents": DOCUMENTS,
                                                           "max_tokens_per_doc": k, "return_documents": True}))
    offline = runtime.rerank(long_query, cut)
    assert [item["index"] for item in body["results"]] == [result.index for result in offline]
    np.testing.assert_allclose([item["relevance_score"] for item in body["results"]],
                               [result.score for result in offline], atol=1e-6)
    assert [item["document"]["text"] for item in body["results"]] == [DOCUMENTS[r.index] for r in offline]


def test_vllm_scoring_fields_on_a_cross_encoder(cross_encoder, classifier_reference, minilm_classifier_folder,
                                                hf_tokenizer):
    """vLLM's ``use_activation`` on /rerank (false: the head's raw logits) and ``max_tokens_per_doc``
    on /score (0: whole documents, vLLM's default), against transformers."""
    running, runtime = cross_encoder
    reference = classifier_reference(minilm_classifier_folder(1))
    logits = reference.logits([(QUERY, document) for document in DOCUMENTS])[:, 0]
    body = _ok(httpx.post(f"{running.url}/rerank", json={"query": QUERY, "documents": DOCUMENTS,
                                                         "use_activation": False}))
    assert [item["index"] for item in body["results"]] == list(np.argsort(-logits, kind="stable"))
    np.testing.assert_allclose([item["relevance_score"] for item in body["results"]], np.sort(logits)[::-1],
                               atol=1e-5)
    cut = [_first_tokens(hf_tokenizer, document, 4) for document in DOCUMENTS]
    for k, documents in ((4, cut), (0, DOCUMENTS)):
        scored = _ok(httpx.post(f"{running.url}/score", json={"queries": QUERY, "documents": DOCUMENTS,
                                                              "max_tokens_per_doc": k}))
        np.testing.assert_allclose([item["score"] for item in scored["data"]],
                                   reference.scores([(QUERY, document) for document in documents])[:, 0], atol=1e-5)
    message = _error(httpx.post(f"{running.url}/rerank", json={"query": QUERY, "documents": DOCUMENTS,
                                                               "raw_scores": True, "use_activation": False}))
    assert message == ("raw_scores (infinity's) and use_activation (vLLM's) set the same thing: send one", "raw_scores")
    _still_serves(running.url, runtime)


def test_pooling_takes_pairs_as_classify_does(cross_encoder, classifier_reference, minilm_classifier_folder):
    """JSON has no tuples: ``[text, text_pair]`` items are pairs on ``/pooling`` too."""
    running, runtime = cross_encoder
    pairs = [[QUERY, document] for document in DOCUMENTS]
    pooled = _ok(httpx.post(f"{running.url}/pooling", json={"input": pairs, "task": "classify"}))
    classified = _ok(httpx.post(f"{running.url}/classify", json={"input": pairs}))
    reference = classifier_reference(minilm_classifier_folder(1)).scores([tuple(pair) for pair in pairs])
    np.testing.assert_allclose([item["data"] for item in pooled["data"]], reference, atol=1e-5)
    assert [item["data"] for item in pooled["data"]] == [item["probs"] for item in classified["data"]]
    message, param = _error(httpx.post(f"{running.url}/pooling", json={"input": [[QUERY, 5]], "task": "classify"}))
    assert (message, param) == ("input 0: expected a text, a list of token ids or a (text, text_pair) pair, got "
                                f"[{QUERY!r}, 5]", "input")
    _still_serves(running.url, runtime)


def test_max_tokens_per_doc_on_a_cross_encoder(cross_encoder, hf_tokenizer):
    running, runtime = cross_encoder
    cut = [_first_tokens(hf_tokenizer, document, 4) for document in DOCUMENTS]
    body = _ok(httpx.post(f"{running.url}/rerank", json={"query": QUERY, "documents": DOCUMENTS,
                                                         "max_tokens_per_doc": 4}))
    expected = runtime.score(QUERY, cut)
    assert [item["index"] for item in body["results"]] == list(np.argsort(-expected, kind="stable"))
    np.testing.assert_allclose([item["relevance_score"] for item in body["results"]], np.sort(expected)[::-1],
                               atol=1e-6)
    assert body["usage"]["prompt_tokens"] == sum(len(hf_tokenizer(QUERY, c)["input_ids"]) for c in cut)


def test_max_tokens_per_doc_keeps_a_long_document_within_the_model(server, runtime, text_with_tokens, hf_tokenizer):
    long_document = text_with_tokens(300, 1)  # over MiniLM's 256: an error unless it is cut
    body = _ok(httpx.post(f"{server.url}/rerank", json={"query": QUERY, "documents": [long_document, DOCUMENTS[1]],
                                                        "max_tokens_per_doc": 100}))
    expected = runtime.score(QUERY, [_first_tokens(hf_tokenizer, long_document, 100), DOCUMENTS[1]])
    by_index = {item["index"]: item["relevance_score"] for item in body["results"]}
    np.testing.assert_allclose([by_index[0], by_index[1]], expected, atol=1e-6)


@pytest.mark.parametrize(("body", "message", "param"), [
    ({"query": "q", "documents": ["d"], "max_tokens_per_doc": -1}, "max_tokens_per_doc must be a positive integer, "
                                                                   "got -1", "max_tokens_per_doc"),
    ({"query": "q", "documents": ["d"], "max_tokens_per_doc": 1.5},
     "max_tokens_per_doc: Input should be a valid integer, got 1.5", "max_tokens_per_doc"),
    ({"query": "q"}, "send documents (vLLM, Jina, Cohere, infinity) or texts (TEI)", "documents"),
    ({"query": "q", "documents": ["d", {"title": "no text"}]},
     'documents: item 1 is an object without a "text" string; send a text or {"text": ...}', "documents"),
    ({"query": "q", "documents": ["d", None]}, "documents[1] must be a string, got None", "documents"),
    ({"query": "q", "documents": 5}, "documents must be a list of strings, got 5", "documents"),
    ({"query": "q", "documents": ["d"], "rank_fields": ["text"]},
     "rank_fields: Extra inputs are not permitted (a field this server does not know is refused; "
     "--allow-extra-fields drops such fields instead)",
     "rank_fields"),
    ({"query": "q", "documents": ["d"], "texts": ["d"]}, "documents cannot be combined with TEI's fields (texts): "
                                                         "send documents (vLLM, Jina, Cohere, infinity) or texts (TEI)",
     "documents"),
    ({"query": "q", "documents": ["d"], "return_text": True}, "documents cannot be combined with TEI's fields "
                                                              "(return_text): send documents (vLLM, Jina, Cohere, "
                                                              "infinity) or texts (TEI)", "documents"),
    ({"query": "q", "documents": []}, "documents is empty: scoring needs at least one of each", "documents"),
    ({"query": None, "documents": ["d"]}, "query must be a string, got None", "query"),
    ({"query": ["q"], "documents": ["d"]}, "query must be a string, got ['q']", "query"),
    ({"documents": ["d"]}, "query: Field required", "query"),
])
def test_bad_rerank_bodies(server, runtime, body, message, param):
    for path in ("/rerank", "/v2/rerank"):
        assert _error(httpx.post(f"{server.url}{path}", json=body)) == (message, param)
        _still_serves(server.url, runtime)


# --------------------------------------------------------------------------- Cohere's SDK


def test_cohere_v2_client(cross_encoder, cohere_clients):
    running, runtime = cross_encoder
    client = cohere_clients[0]
    answer = client.rerank(model=_served(running), query=QUERY, documents=DOCUMENTS, top_n=3)
    offline = runtime.rerank(QUERY, DOCUMENTS, top_n=3)
    assert [result.index for result in answer.results] == [result.index for result in offline]
    np.testing.assert_allclose([result.relevance_score for result in answer.results],
                               [result.score for result in offline], atol=1e-6)
    assert answer.id.startswith("rerank-")
    assert answer.meta.api_version.version == "2" and answer.meta.billed_units.search_units == 1
    raw = _ok(httpx.post(f"{running.url}/v2/rerank", json={"model": _served(running), "query": QUERY,
                                                          "documents": DOCUMENTS, "top_n": 3}))
    V2RerankResponse.model_validate(raw)  # the SDK's own model, validated (the client does not check)


def test_cohere_v2_client_max_tokens_per_doc(cross_encoder, cohere_clients, hf_tokenizer):
    running, runtime = cross_encoder
    client = cohere_clients[0]
    answer = client.rerank(model=_served(running), query=QUERY, documents=DOCUMENTS, max_tokens_per_doc=3)
    offline = runtime.rerank(QUERY, [_first_tokens(hf_tokenizer, document, 3) for document in DOCUMENTS])
    assert [result.index for result in answer.results] == [result.index for result in offline]
    np.testing.assert_allclose([result.relevance_score for result in answer.results],
                               [result.score for result in offline], atol=1e-6)


def test_cohere_v1_client(cross_encoder, cohere_clients):
    running, runtime = cross_encoder
    client = cohere_clients[1]
    documents = [DOCUMENTS[0], {"text": DOCUMENTS[1], "title": "fires"}, DOCUMENTS[2], {"text": DOCUMENTS[3]}]
    answer = client.rerank(query=QUERY, documents=documents, top_n=2, return_documents=True)
    offline = runtime.rerank(QUERY, DOCUMENTS, top_n=2, return_documents=True)
    assert [result.index for result in answer.results] == [result.index for result in offline]
    assert [result.document.text for result in answer.results] == [result.document for result in offline]
    np.testing.assert_allclose([result.relevance_score for result in answer.results],
                               [result.score for result in offline], atol=1e-6)
    assert answer.meta.api_version.version == "1" and answer.meta.billed_units.search_units == 1
    raw = _ok(httpx.post(f"{running.url}/v1/rerank", json={"query": QUERY, "documents": documents,
                                                          "return_documents": True}))
    CohereV1Response.model_validate(raw)
    assert {"text": DOCUMENTS[1], "title": "fires"} in [item["document"] for item in raw["results"]]  # kept, as Cohere
    plain = client.rerank(query=QUERY, documents=DOCUMENTS, return_documents=False)
    assert all(result.document is None for result in plain.results)
    # Cohere's default leaves documents out, vLLM's always sends them on the same paths: they come
    unasked = client.rerank(query=QUERY, documents=DOCUMENTS)  # unless asked not to
    assert [result.document.text for result in unasked.results] == [DOCUMENTS[r.index] for r in unasked.results]


def test_cohere_client_sees_a_bad_request(cross_encoder, cohere_clients):
    running, runtime = cross_encoder
    client = cohere_clients[0]
    with pytest.raises(cohere.BadRequestError) as caught:
        client.rerank(model=_served(running), query=QUERY, documents=DOCUMENTS, max_tokens_per_doc=-1)
    assert caught.value.body["error"]["message"] == "max_tokens_per_doc must be a positive integer, got -1"
    assert len(client.rerank(model=_served(running), query=QUERY, documents=DOCUMENTS).results) == 4


def _served(running) -> str:
    return httpx.get(f"{running.url}/v1/models").json()["data"][0]["id"]


# --------------------------------------------------------------------------- TEI's /rerank and /tokenize


def test_tei_rerank_body(cross_encoder):
    running, runtime = cross_encoder
    body = _ok(httpx.post(f"{running.url}/rerank", json={"query": QUERY, "texts": DOCUMENTS, "return_text": True}))
    offline = runtime.rerank(QUERY, DOCUMENTS, return_documents=True)
    assert [item["index"] for item in body] == [result.index for result in offline]
    assert [item["text"] for item in body] == [result.document for result in offline]
    np.testing.assert_allclose([item["score"] for item in body], [result.score for result in offline], atol=1e-6)
    plain = _ok(httpx.post(f"{running.url}/rerank", json={"query": QUERY, "texts": DOCUMENTS}))
    assert all(set(item) == {"index", "score"} for item in plain)


def test_tei_root_of_a_reranker_is_its_rerank(cross_encoder):
    """TEI's POST / answers as /rerank for a one-label model (and /invocations as TEI's root)."""
    running, runtime = cross_encoder
    body = {"query": QUERY, "texts": DOCUMENTS, "return_text": True}
    expected = _ok(httpx.post(f"{running.url}/rerank", json=body))
    assert _ok(httpx.post(f"{running.url}/", json=body)) == expected
    assert _ok(httpx.post(f"{running.url}/invocations", json=body)) == expected
    vllm_body = httpx.post(f"{running.url}/", json={"query": QUERY, "documents": DOCUMENTS})
    assert (vllm_body.status_code, vllm_body.json()) == (422, {
        "error": "POST / of a reranker takes TEI's rerank body: query and texts", "error_type": "Validation"})
    empty = httpx.post(f"{running.url}/rerank", json={"query": QUERY, "texts": []})
    assert (empty.status_code, empty.json()) == (400, {"error": "texts is empty: send at least one text",
                                                       "error_type": "Empty"})
    for path in ("/rerank", "/v1/rerank", "/v2/rerank", "/invocations", "/"):
        for texts, wrong in ((5, "got 5"), (True, "got True"), ({"a": 1}, "got {'a': 1}"),
                             ("a text", "not one string")):
            answer = httpx.post(f"{running.url}{path}", json={"query": QUERY, "texts": texts})
            assert (answer.status_code, answer.json()) == (422, {
                "error": f"texts must be a list of strings, {wrong}", "error_type": "Validation"}), path
    _still_serves(running.url, runtime)


def test_tei_rerank_puts_the_later_of_equal_scores_first_and_refuses_a_pair_of_empty_texts(
        cross_encoder, classifier_reference, minilm_classifier_folder):
    """TEI sorts ascending and then reverses: a text sent twice scores the same, and its later copy
    comes first (TEI's own ``test_rerank``); TEI refuses a pair only when both its texts are empty."""
    running, runtime = cross_encoder
    texts = [DOCUMENTS[0], DOCUMENTS[1], DOCUMENTS[0]]
    body = _ok(httpx.post(f"{running.url}/rerank", json={"query": QUERY, "texts": texts}))
    logits = classifier_reference(minilm_classifier_folder(1)).logits([(QUERY, text) for text in texts])[:, 0]
    assert logits[0] == logits[2] != logits[1]
    assert [item["index"] for item in body] == sorted(range(3), key=lambda i: float(logits[i]))[::-1]
    scores = {item["index"]: item["score"] for item in body}
    assert scores[0] == scores[2]
    one_empty = _ok(httpx.post(f"{running.url}/rerank", json={"query": "", "texts": ["a"]}))
    np.testing.assert_allclose(one_empty[0]["score"], runtime.score("", "a"), atol=1e-6)
    both = httpx.post(f"{running.url}/rerank", json={"query": "", "texts": ["a", ""]})
    assert (both.status_code, both.json()) == (400, {"error": "query and texts[1] are both empty",
                                                     "error_type": "Empty"})
    _still_serves(running.url, runtime)


def test_tei_rerank_raw_scores_are_the_logits(cross_encoder, classifier_reference, minilm_classifier_folder):
    running, runtime = cross_encoder
    body = _ok(httpx.post(f"{running.url}/rerank", json={"query": QUERY, "texts": DOCUMENTS, "raw_scores": True}))
    logits = classifier_reference(minilm_classifier_folder(1)).logits([(QUERY, d) for d in DOCUMENTS])[:, 0]
    assert [item["index"] for item in body] == list(np.argsort(-logits, kind="stable"))
    np.testing.assert_allclose([item["score"] for item in body], np.sort(logits)[::-1], atol=1e-5)
    assert not np.allclose(logits, runtime.score(QUERY, DOCUMENTS), atol=1e-3)  # not the sigmoid


@pytest.mark.parametrize("direction", ["Right", "Left"])
def test_tei_rerank_truncate(cross_encoder, text_with_tokens, direction):
    running, runtime = cross_encoder
    texts = [text_with_tokens(600, 2), DOCUMENTS[1]]  # over the folder's 512
    body = _ok(httpx.post(f"{running.url}/rerank", json={"query": QUERY, "texts": texts, "truncate": True,
                                                         "truncation_direction": direction}))
    expected = runtime.score(QUERY, texts, truncate_prompt_tokens=-1, truncation_side=direction.lower())
    by_index = {item["index"]: item["score"] for item in body}
    np.testing.assert_allclose([by_index[0], by_index[1]], expected, atol=1e-6)


@pytest.mark.parametrize(("body", "message"), [
    ({"query": None, "texts": ["d"]}, "query must be a string, got None"),
    ({"query": "q", "texts": ["d", 7]}, "texts[1] must be a string, got 7"),
    ({"query": "q", "texts": "d"}, "texts must be a list of strings, not one string"),
])
def test_tei_rerank_bad_sides_are_named_as_the_api_names_them(cross_encoder, body, message):
    running, runtime = cross_encoder
    with pytest.raises(poolrunner.InvalidRequestError, match=re.escape(message.replace("texts", "documents"))):
        runtime.rerank(body["query"], body["texts"])  # the Python API's name for TEI's texts
    answer = httpx.post(f"{running.url}/rerank", json=body)
    assert (answer.status_code, answer.json()) == (422, {"error": message, "error_type": "Validation"})
    _still_serves(running.url, runtime)


def test_tei_rerank_errors_are_tei_shaped(cross_encoder, text_with_tokens):
    running, runtime = cross_encoder
    long_text = text_with_tokens(600, 3)
    with pytest.raises(poolrunner.InvalidRequestError) as offline:
        runtime.score(QUERY, [long_text])
    answer = httpx.post(f"{running.url}/rerank", json={"query": QUERY, "texts": [long_text], "truncate": False})
    assert answer.status_code == 422, answer.text
    served = str(offline.value).replace(runtime.model_config.name, Path(runtime.model_config.name).name)
    reason = served.partition(";")[0]  # the advice names TEI's field (the API's is refused beside TEI's)
    assert answer.json() == {"error": f'{reason}; shorten it or send "truncate": true', "error_type": "Validation"}
    _still_serves(running.url, runtime)


def test_tei_tokenize(server, hf_tokenizer):
    texts = ["Héllo wörld, it's café time!", "Bushfires near Sydney ☃"]
    for add_special_tokens in (True, False):
        body = _ok(httpx.post(f"{server.url}/tokenize", json={"inputs": texts,
                                                              "add_special_tokens": add_special_tokens}))
        assert len(body) == 2
        for text, tokens in zip(texts, body, strict=True):
            encoded = hf_tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
            assert [token["id"] for token in tokens] == encoded["input_ids"]
            raw = text.encode()
            for token, name in zip(tokens, encoded.tokens(), strict=True):
                if token["special"]:
                    assert token == {"id": token["id"], "text": name, "special": True, "start": None, "stop": None}
                else:  # TEI's spans are UTF-8 byte offsets, and the text is the input's own
                    assert raw[token["start"]:token["stop"]].decode() == token["text"]
            chars = [text[a:b] for a, b in encoded["offset_mapping"] if b > a]
            assert [token["text"] for token in tokens if not token["special"]] == chars
    single = _ok(httpx.post(f"{server.url}/tokenize", json={"inputs": texts[0]}))
    assert len(single) == 1 and [t["id"] for t in single[0]] == hf_tokenizer(texts[0])["input_ids"]


def test_tei_tokenize_with_a_prompt_name(make_minilm_folder, hf_tokenizer):
    """TEI tokenizes the prompt with the text; spans count from the prompt's start."""
    folder = make_minilm_folder("prompted", modules=[("Transformer", ""), ("Pooling", "1_Pooling")],
                                pooling={"pooling_mode_mean_tokens": True}, st_config={"prompts": {"query": "query: "}})
    runtime = poolrunner.Runtime(folder, dtype="float32")
    with ServerThread(runtime) as running:
        tokens = _ok(httpx.post(f"{running.url}/tokenize", json={"inputs": "Hello", "prompt_name": "query"}))[0]
        unknown = httpx.post(f"{running.url}/tokenize", json={"inputs": "Hello", "prompt_name": "passage"})
        assert unknown.status_code == 422 and "prompt_name 'passage' is not defined" in unknown.json()["error"]
        vllm = httpx.post(f"{running.url}/tokenize", json={"prompt": "Hello", "prompt_name": "query"})
        assert _error(vllm) == ("prompt_name belongs to TEI's body, which sends inputs", "prompt_name")
    assert [token["id"] for token in tokens] == hf_tokenizer("query: Hello")["input_ids"]
    assert [(t["text"], t["start"], t["stop"]) for t in tokens if not t["special"]][-1] == ("Hello", 7, 12)


def test_tei_tokenize_of_no_text_is_tei_empty_error(server, hf_tokenizer):
    with httpx.Client(base_url=server.url) as client:  # one keep-alive connection: it must survive
        empty = client.post("/tokenize", json={"inputs": []})
        assert (empty.status_code, empty.json()) == (400, {"error": "inputs is empty: send at least one input",
                                                           "error_type": "Empty"})
        again = client.post("/tokenize", json={"inputs": ["ok"]})
        assert [t["id"] for t in again.json()[0]] == hf_tokenizer("ok")["input_ids"]


def test_vllm_tokenize_and_detokenize(server, hf_tokenizer):
    old = _ok(httpx.post(f"{server.url}/tokenize", json={"prompt": SANITY_TEXT}))
    assert old == {"count": len(old["tokens"]), "max_model_len": 256, "tokens": hf_tokenizer(SANITY_TEXT)["input_ids"],
                   "token_strs": None}  # vLLM answers null unless asked
    bare = _ok(httpx.post(f"{server.url}/tokenize", json={"prompt": SANITY_TEXT, "add_special_tokens": False,
                                                          "return_token_strs": True}))
    ids = hf_tokenizer(SANITY_TEXT, add_special_tokens=False)["input_ids"]
    assert bare == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                    "token_strs": hf_tokenizer.convert_ids_to_tokens(ids)}
    for tokens in (old["tokens"], ids):
        assert _ok(httpx.post(f"{server.url}/detokenize", json={"tokens": tokens})) == {
            "prompt": hf_tokenizer.decode(tokens)}
    long = _ok(httpx.post(f"{server.url}/tokenize", json={"prompt": "word " * 300}))  # counted whole, as vLLM's
    assert long == {"count": 302, "max_model_len": 256, "tokens": hf_tokenizer("word " * 300)["input_ids"],
                    "token_strs": None}
    message, param = _error(httpx.post(f"{server.url}/tokenize", json={"prompt": "w" * 8193}))
    assert (message, param) == ("input 0 has 8193 characters, more than the limit of 8192 per input "
                                "(max_input_chars, the --max-input-chars flag); shorten it", "prompt")
    tei = httpx.post(f"{server.url}/tokenize", json={"inputs": "w" * 8193})
    assert (tei.status_code, tei.json()) == (422, {"error": "input 0 has 8193 characters, more than the limit of "
                                                   "8192 per input (max_input_chars, the --max-input-chars flag); "
                                                   "shorten it", "error_type": "Validation"})
    assert _ok(httpx.post(f"{server.url}/tokenize", json={"prompt": SANITY_TEXT})) == old  # serving on


@pytest.mark.parametrize(("path", "body", "message", "param"), [
    ("/detokenize", {"tokens": [101, 30522]}, "tokens[1] = 30522 is outside the vocabulary [0, 30522)", "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens.0: Input should be a valid integer, got 'a'", "tokens"),
    ("/tokenize", {"prompt": "a", "inputs": "b"}, "send prompt or messages (vLLM) or inputs (TEI), exactly one of "
     "them", "inputs"),
    ("/tokenize", {}, "send prompt or messages (vLLM) or inputs (TEI), exactly one of them", "prompt"),
    ("/tokenize", {"inputs": "a", "return_token_strs": True},
     "return_token_strs belongs to vLLM's body, which sends prompt or messages", "return_token_strs"),
    ("/tokenize", {"inputs": "a", "messages": [{"role": "user", "content": "b"}]},
     "send prompt or messages (vLLM) or inputs (TEI), exactly one of them", "inputs"),
    ("/tokenize", {"inputs": "a", "add_generation_prompt": False}, "add_generation_prompt applies to messages, not "
     "to inputs", "add_generation_prompt"),
])
def test_bad_tokenize_bodies(server, runtime, path, body, message, param):
    assert _error(httpx.post(f"{server.url}{path}", json=body)) == (message, param)
    _still_serves(server.url, runtime)


# --------------------------------------------------------------------------- /v1/models/{id}, /embeddings


def test_model_retrieve_and_embeddings_alias(server, runtime):
    listed = _ok(httpx.get(f"{server.url}/v1/models"))["data"][0]
    assert _ok(httpx.get(f"{server.url}/v1/models/{listed['id']}")) == listed
    message, param = _error(httpx.get(f"{server.url}/v1/models/org/other"), 404)
    assert (message, param) == (f"the model 'org/other' does not exist: this server serves {listed['id']!r}; a "
                                "client's default name is served when the operator lists it in --served-model-name "
                                "or, for a single model, turns on --any-model-name", "model")
    body = _ok(httpx.post(f"{server.url}/embeddings", json={"input": DOCUMENTS}))
    np.testing.assert_allclose([item["embedding"] for item in body["data"]], runtime.embed(DOCUMENTS), atol=2e-6)
    _still_serves(server.url, runtime)
