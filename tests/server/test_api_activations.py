"""Whose activation turns a classifier's logits into scores, per API, against a real server.

vLLM's, Cohere's and Jina's bodies (and the Python API) score pairs as sentence-transformers'
``CrossEncoder.predict``: with the activation the folder names (``Identity`` for the ms-marco
cross-encoders: raw logits); vLLM's ``/classify`` gives the head's probabilities whatever the
folder names (vLLM's ``classify`` activation, transformers' text-classification pipeline).
TEI's ``/rerank`` and ``/predict`` and infinity's rerank body score as those servers do,
whatever the folder names: a sigmoid of one logit, a softmax over several (TEI's
``Infer::predict``, infinity's ``BatchHandler.rerank``). Expected values are transformers'
logits with the activation written here in numpy.
"""

from __future__ import annotations

import json
import shutil

import httpx
import numpy as np
import pytest

from poolrunner.core.server.models import ServedModel
from poolrunner.core.testing.server import ServerThread

QUERY = "Fires threaten homes in Australia."
DOCUMENTS = ["Shares dropped at the start of the week.", "Bushfires are burning out of control near Sydney.",
             "Firefighters battle blazes in New South Wales."]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(x / 2))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def identity_folder(minilm_classifier_folder, tmp_path_factory):
    """A one-label cross-encoder whose config names ``Identity``, as cross-encoder/ms-marco-* do."""
    folder = tmp_path_factory.mktemp("identity_ce") / "model"
    shutil.copytree(minilm_classifier_folder(1), folder)
    config = json.loads((folder / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def served(identity_folder, make_classifier_folder, classifier_runtime):
    multilabel = make_classifier_folder("bert", "multilabel")
    models = [ServedModel(classifier_runtime(identity_folder), "ms-marco"),
              ServedModel(classifier_runtime(multilabel), "tags")]
    with ServerThread(models) as running:
        yield running.url, multilabel


def _post(url: str, body: dict) -> object:
    answer = httpx.post(url, json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_identity_cross_encoder_per_api(served, identity_folder, classifier_reference):
    url, _ = served
    logits = classifier_reference(identity_folder).logits([(QUERY, d) for d in DOCUMENTS])[:, 0]
    order = list(np.argsort(-logits, kind="stable"))
    vllm = _post(f"{url}/rerank", {"model": "ms-marco", "query": QUERY, "documents": DOCUMENTS})
    assert [r["index"] for r in vllm["results"]] == order
    np.testing.assert_allclose([r["relevance_score"] for r in vllm["results"]], logits[order], atol=1e-5)

    classified = _post(f"{url}/classify", {"model": "ms-marco", "input": [[QUERY, d] for d in DOCUMENTS]})
    np.testing.assert_allclose([item["probs"][0] for item in classified["data"]], _sigmoid(logits), atol=1e-6)
    raw = _post(f"{url}/classify", {"model": "ms-marco", "input": [[QUERY, d] for d in DOCUMENTS],
                                    "use_activation": False})
    np.testing.assert_allclose([item["probs"][0] for item in raw["data"]], logits, atol=1e-5)

    tei = _post(f"{url}/rerank", {"model": "ms-marco", "query": QUERY, "texts": DOCUMENTS})
    assert [r["index"] for r in tei] == order
    np.testing.assert_allclose([r["score"] for r in tei], _sigmoid(logits[order]), atol=1e-6)
    tei_raw = _post(f"{url}/rerank", {"model": "ms-marco", "query": QUERY, "texts": DOCUMENTS, "raw_scores": True})
    np.testing.assert_allclose([r["score"] for r in tei_raw], logits[order], atol=1e-5)

    for raw, expected in ((False, _sigmoid(logits[order])), (True, logits[order])):
        infinity = _post(f"{url}/rerank", {"model": "ms-marco", "query": QUERY, "documents": DOCUMENTS,
                                           "raw_scores": raw})
        assert [r["index"] for r in infinity["results"]] == order
        np.testing.assert_allclose([r["relevance_score"] for r in infinity["results"]], expected, atol=1e-5)


def test_tei_predict_softmaxes_a_multi_label_head_as_tei(served, classifier_reference):
    url, multilabel = served
    logits = classifier_reference(multilabel).logits(["great film!"])[0]
    tei = _post(f"{url}/predict", {"model": "tags", "inputs": "great film!"})
    labels = ["sports", "politics", "tech"]
    assert [p["label"] for p in tei] == [labels[i] for i in np.argsort(-logits, kind="stable")]
    np.testing.assert_allclose([p["score"] for p in tei], np.sort(_softmax(logits))[::-1], atol=1e-6)
    # vLLM's body keeps the folder's rule: independent sigmoids for multi_label_classification
    vllm = _post(f"{url}/classify", {"model": "tags", "input": ["great film!"]})
    np.testing.assert_allclose(vllm["data"][0]["probs"], _sigmoid(logits), atol=1e-6)
