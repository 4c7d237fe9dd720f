"""infinity's API driven by its own client (``infinity_client``, left at its defaults: ``model``
``default/not-specified``, ``dimensions`` 0, ``modality`` text, ``raw_scores`` false) against a
real server of three models: the default embedder, a cross-encoder and a three-label classifier.

Every answer must equal the offline Python API's (``Runtime.embed`` / ``rerank`` / ``score`` /
``classify``, themselves tested against sentence-transformers and transformers); every rejected
request is followed by one that must still be served.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from infinity_client import Client
from infinity_client.api.default import classify, embeddings, models, rerank
from infinity_client.models import ClassifyInput, OpenAIEmbeddingInputText, RerankInput

from poolrunner.core.server.models import DEFAULT_MODEL_NAME, ServedModel
from poolrunner.core.testing.server import ServerThread

QUERY = "Fires threaten homes in Australia."
DOCUMENTS = ["Shares dropped at the start of the week.", "Bushfires are burning out of control near Sydney.",
             "Someone performs music in front of an audience.", "Firefighters battle blazes in New South Wales."]
TEXTS = ["A man is playing a guitar.", "The stock market fell sharply on Monday.", "It rained all day."]


@pytest.fixture(scope="module")
def served(runtime, minilm_classifier_folder, classifier_runtime):
    """``(client, url, runtimes by served name)`` for one server of the three models."""
    runtimes = {DEFAULT_MODEL_NAME: runtime, "reranker": classifier_runtime(minilm_classifier_folder(1)),
                "labels": classifier_runtime(minilm_classifier_folder(3))}
    with ServerThread([ServedModel(rt, name) for name, rt in runtimes.items()]) as running, \
            Client(base_url=running.url, raise_on_unexpected_status=True) as client:
        yield client, running.url, runtimes


def _parsed(response):
    assert response.status_code == 200, response.content
    return response.parsed


def test_embeddings_with_the_client_defaults(served):
    client, _, runtimes = served
    answer = _parsed(embeddings.sync_detailed(client=client, body=OpenAIEmbeddingInputText(input_=TEXTS)))
    assert answer.model == DEFAULT_MODEL_NAME  # default/not-specified: the model that embeds
    assert [item.index for item in answer.data] == [0, 1, 2]
    np.testing.assert_allclose([item.embedding for item in answer.data], runtimes[DEFAULT_MODEL_NAME].embed(TEXTS),
                               atol=2e-6)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > 0


def test_rerank_with_the_client_defaults_and_every_field(served):
    client, url, runtimes = served
    cross = runtimes["reranker"]
    plain = _parsed(rerank.sync_detailed(client=client, body=RerankInput(query=QUERY, documents=DOCUMENTS)))
    offline = cross.rerank(QUERY, DOCUMENTS)
    assert plain.model == "reranker" and plain.object_ == "rerank"
    assert [r.index for r in plain.results] == [r.index for r in offline]
    np.testing.assert_allclose([r.relevance_score for r in plain.results], [r.score for r in offline], atol=1e-6)
    assert all(r.document is None for r in plain.results)  # as infinity: no text unless asked
    body = {"query": QUERY, "documents": DOCUMENTS, "raw_scores": False}
    results = httpx.post(f"{url}/rerank", json=body).json()["results"]
    assert [r["document"] for r in results] == [None] * 4  # infinity's null

    body = RerankInput(query=QUERY, documents=DOCUMENTS, raw_scores=True, return_documents=True, top_n=2)
    raw = _parsed(rerank.sync_detailed(client=client, body=body))
    logits = cross.score(QUERY, DOCUMENTS, use_activation=False)
    best = np.argsort(-logits, kind="stable")[:2]
    assert [r.index for r in raw.results] == best.tolist()
    np.testing.assert_allclose([r.relevance_score for r in raw.results], logits[best], atol=1e-6)
    assert [r.document for r in raw.results] == [DOCUMENTS[k] for k in best]


@pytest.mark.parametrize("raw_scores", [False, True])
def test_classify_every_label_best_first(served, raw_scores):
    client, _, runtimes = served
    answer = _parsed(classify.sync_detailed(client=client, body=ClassifyInput(input_=TEXTS, raw_scores=raw_scores)))
    assert answer.model == "labels"  # default/not-specified: the classifier, not the cross-encoder
    offline = runtimes["labels"].classify(TEXTS, use_activation=not raw_scores)
    labels = ["alpha", "beta", "gamma"]
    for row, result in zip(answer.data, offline, strict=True):
        order = np.argsort(-result.probs, kind="stable")
        assert [item.label for item in row] == [labels[k] for k in order]
        np.testing.assert_allclose([item.score for item in row], result.probs[order], atol=1e-6)


def test_models_in_infinity_shape(served):
    client, _, _ = served
    answer = _parsed(models.sync_detailed(client=client))
    listed = {model.id: sorted(model.capabilities) for model in answer.data}
    assert listed == {DEFAULT_MODEL_NAME: ["embed"], "reranker": ["classify", "rerank"], "labels": ["classify"]}
    assert all(model.object_ == "model" and model.stats.additional_properties["queue_absolute"] == 0
               for model in answer.data)


@pytest.mark.parametrize(("path", "body", "message", "param"), [
    ("/rerank", {"query": QUERY, "documents": [{"text": DOCUMENTS[0]}], "raw_scores": True},
     "infinity's body (raw_scores) takes documents as texts, not objects", "documents"),
    ("/classify", {"input": TEXTS, "raw_scores": True, "use_activation": True},
     "raw_scores (infinity's) and use_activation (vLLM's) set the same thing: send one", "raw_scores"),
    ("/embeddings", {"input": TEXTS, "modality": "text", "dimensions": 3},
     "model all-MiniLM-L6-v2 does not support Matryoshka dimensions (got dimensions=3): it answers all 384 "
     "dimensions; its config declares neither is_matryoshka nor matryoshka_dimensions; load it with "
     "is_matryoshka=True (--is-matryoshka on the command line and the server) to allow 1..384", "dimensions"),
    # infinity's top_n is positive (vLLM's body reads 0 as all)
    ("/rerank", {"query": QUERY, "documents": DOCUMENTS, "raw_scores": False, "top_n": 0},
     "top_n must be a positive integer, got 0", "top_n"),
    # OpenAI's body keeps OpenAI's rule: 0 is no size (only infinity's body reads it as the full size)
    ("/embeddings", {"input": TEXTS, "dimensions": 0}, "dimensions must be a positive integer, got 0", "dimensions"),
])
def test_bad_infinity_bodies(served, path, body, message, param):
    client, url, runtimes = served
    answer = httpx.post(f"{url}{path}", json=body)
    assert answer.status_code == 400, answer.text
    assert (answer.json()["error"]["message"], answer.json()["error"]["param"]) == (message, param)
    still = _parsed(embeddings.sync_detailed(client=client, body=OpenAIEmbeddingInputText(input_=TEXTS[0])))
    np.testing.assert_allclose(still.data[0].embedding, runtimes[DEFAULT_MODEL_NAME].embed(TEXTS[:1])[0], atol=2e-6)

