"""Several models in one server: an embedder, a cross-encoder and a classifier, each in its own
runtime, routed by the request's ``model`` (or by the route, without one).

Expected values come from sentence-transformers (embeddings) and transformers (label scores and
cross-encoder scores), never from the server; every answer is checked under concurrent mixed
load, so a request answered by the wrong model, or batched with another model's, shows.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

import poolrunner
from poolrunner.core.cli.common import CliError
from poolrunner.core.cli.main import build_parser
from poolrunner.core.cli.model_specs import ModelSpec, parse_model_spec
from poolrunner.core.server.models import ServedModel, served_models
from poolrunner.core.testing.server import ServerThread
from tests.helpers import MIN_COSINE, cosine_rows
from tests.server.process import free_port, wait_healthy

QUERY = "Fires threaten homes in Australia."
DOCUMENTS = ["Shares dropped at the start of the week.", "Bushfires are burning out of control near Sydney.",
             "Firefighters battle blazes in New South Wales."]
TEXTS = ["A man is playing a guitar.", "The stock market fell sharply on Monday.", "It rained all day.",
         "Cats sleep most of the day.", "The train was late again."]


@pytest.fixture(scope="module")
def three(runtime, minilm_classifier_folder, classifier_runtime):
    """One server with the default embedder as ``embed``, a cross-encoder as ``rerank`` and a
    three-label classifier as ``labels`` (and alias ``cls``)."""
    models = [ServedModel(runtime, "embed"),
              ServedModel(classifier_runtime(minilm_classifier_folder(1)), "rerank"),
              ServedModel(classifier_runtime(minilm_classifier_folder(3)), ["labels", "cls"])]
    with ServerThread(models) as running:
        yield running


@pytest.fixture(scope="module")
def references(st_model, classifier_reference, minilm_classifier_folder):
    """What each model must answer, computed by sentence-transformers and transformers."""
    cross, labels = classifier_reference(minilm_classifier_folder(1)), classifier_reference(minilm_classifier_folder(3))
    return {
        "embed": st_model.encode(TEXTS, normalize_embeddings=True),
        "rerank": cross.scores([(QUERY, d) for d in DOCUMENTS])[:, 0],
        "labels": labels.scores(TEXTS),
    }


def _ok(answer: httpx.Response) -> dict:
    assert answer.status_code == 200, answer.text
    return answer.json()


def _embed(url: str, model: str | None) -> None:
    body = _ok(httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS, **({"model": model} if model else {})}))
    assert body["model"] == "embed"
    return np.array([item["embedding"] for item in body["data"]], dtype=np.float32)


def _rerank(url: str, model: str | None) -> np.ndarray:
    body = _ok(httpx.post(f"{url}/rerank", json={"query": QUERY, "documents": DOCUMENTS,
                                                  **({"model": model} if model else {})}))
    assert body["model"] == "rerank"
    return np.array([item["relevance_score"] for item in sorted(body["results"], key=lambda r: r["index"])])


def _classify(url: str, model: str | None) -> np.ndarray:
    body = _ok(httpx.post(f"{url}/classify", json={"input": TEXTS, **({"model": model} if model else {})}))
    assert body["model"] == "labels"
    return np.array([item["probs"] for item in body["data"]])


CALLS = {"embed": _embed, "rerank": _rerank, "labels": _classify}
KEYS = build_parser().parse_args(["serve"]).model_keys


def _check(name: str, answer: np.ndarray, references: dict) -> None:
    if name == "embed":  # the default runtime's precision: README's bar for other dtypes than float32
        assert cosine_rows(answer, references["embed"]).min() >= MIN_COSINE
    else:
        np.testing.assert_allclose(answer, references[name], atol=1e-5)


def test_models_lists_every_served_name(three):
    body = _ok(httpx.get(f"{three.url}/v1/models"))
    assert [card["id"] for card in body["data"]] == ["embed", "rerank", "labels", "cls"]
    assert [card["task"] for card in body["data"]] == ["embed", "classify", "classify", "classify"]
    assert _ok(httpx.get(f"{three.url}/v1/models/cls"))["id"] == "cls"


def test_each_model_answers_its_own_requests_under_mixed_concurrent_load(three, references):
    calls = [(name, model) for _ in range(6) for name in CALLS for model in (name, None)]
    calls.append(("labels", "cls"))
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda call: CALLS[call[0]](three.url, call[1]), calls))
    for (name, _model), answer in zip(calls, answers, strict=True):
        _check(name, answer, references)


def test_tei_routes_go_to_the_model_of_their_task(three, references):
    vectors = np.array(_ok(httpx.post(f"{three.url}/embed", json={"inputs": TEXTS})))
    assert cosine_rows(vectors, references["embed"]).min() >= MIN_COSINE
    ranks = _ok(httpx.post(f"{three.url}/rerank", json={"query": QUERY, "texts": DOCUMENTS}))
    np.testing.assert_allclose([r["score"] for r in sorted(ranks, key=lambda r: r["index"])], references["rerank"],
                               atol=1e-5)
    predictions = _ok(httpx.post(f"{three.url}/predict", json={"inputs": TEXTS[0]}))
    by_label = {p["label"]: p["score"] for p in predictions}
    np.testing.assert_allclose([by_label[label] for label in ("alpha", "beta", "gamma")], references["labels"][0],
                               atol=1e-5)
    assert _ok(httpx.get(f"{three.url}/info"))["served_model_name"] == "embed"  # TEI's /info: the first model


def test_an_unknown_model_is_a_404_naming_the_served_ones_and_the_server_still_serves(three, references):
    answer = httpx.post(f"{three.url}/v1/embeddings", json={"input": "x", "model": "nope"})
    assert answer.status_code == 404
    assert answer.json()["error"] == {
        "message": "the model 'nope' does not exist: this server serves 'embed'; 'rerank'; 'labels' (aliases: 'cls'); "
                   "a client's default name is served when the operator lists it in --served-model-name or, for a "
                   "single model, turns on --any-model-name",
        "type": "not_found_error", "param": "model", "code": 404}
    _check("embed", _embed(three.url, "embed"), references)


def test_the_model_argument_as_given_names_its_model_as_vllm_s_default_id(three, references,
                                                                          minilm_classifier_folder):
    """vLLM serves a model under its ``--model`` argument (a path, a hub id) unless named: a client
    configured with it reaches the model here too, though /v1/models lists the served names."""
    folder = str(minilm_classifier_folder(3))
    body = _ok(httpx.post(f"{three.url}/classify", json={"input": TEXTS, "model": folder}))
    assert body["model"] == "labels"
    np.testing.assert_allclose([item["probs"] for item in body["data"]], references["labels"], atol=1e-5)
    assert folder not in [card["id"] for card in _ok(httpx.get(f"{three.url}/v1/models"))["data"]]


def test_a_task_the_named_model_does_not_serve_is_its_own_error(three, references):
    answer = httpx.post(f"{three.url}/classify", json={"input": "x", "model": "embed"})
    assert answer.status_code == 400
    assert "classify" in answer.json()["error"]["message"]
    _check("labels", _classify(three.url, None), references)


def test_served_models_refuses_a_shared_name(runtime):
    with pytest.raises(ValueError, match="model 0 and model 1 are both named 'a'"):
        served_models([ServedModel(runtime, "a"), ServedModel(runtime, ["b", "a"])], None)
    with pytest.raises(ValueError, match="served_model_name applies to a single runtime"):
        served_models([ServedModel(runtime, "a")], ["x"])


@pytest.mark.parametrize(("text", "expected"), [
    ("./reranker", ModelSpec("./reranker", (), {})),
    ("./reranker:name=rerank", ModelSpec("./reranker", ("rerank",), {})),
    ("org/model:name=a:name=b:task=classify:max-model-len=128:is-matryoshka=true:dtype=float32",
     ModelSpec("org/model", ("a", "b"), {"task": "classify", "max_model_len": 128, "is_matryoshka": True,
                                          "dtype": "float32"})),
    ("C:/models/x:name=x", ModelSpec("C:/models/x", ("x",), {})),
    # every flag of the model group is a key, read as the flag reads it; JSON values keep their colons
    ('./llm:name=rr:hf-overrides={"architectures": ["Qwen3ForSequenceClassification"], "x": {"a": 1}}:task=classify',
     ModelSpec("./llm", ("rr",), {"hf_overrides": {"architectures": ["Qwen3ForSequenceClassification"],
                                                    "x": {"a": 1}}, "task": "classify"})),
    ("./m:async-scheduling=false:max-num-seqs=8:score-template=qwen3_reranker:device=cpu",
     ModelSpec("./m", (), {"async_scheduling": False, "max_num_seqs": 8, "score_template": "qwen3_reranker",
                           "device": "cpu"})),
    # a flag of several values: one a key, the key repeated (both of --lora-modules' forms)
    ('./m:lora-modules=legal=/a/legal:lora-modules={"name": "med", "path": "/b/med"}:max-loras=2',
     ModelSpec("./m", (), {"lora_modules": [("legal", "/a/legal"), ("med", "/b/med")], "max_loras": 2})),
])
def test_model_spec_parsing(text, expected):
    assert parse_model_spec(text, KEYS) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("./m:colour=red", "--model './m:colour=red': unknown option 'colour'; a model may set name, revision, dtype"),
    ("./m:max-model-len=0", "--model './m:max-model-len=0': max-model-len: expected a positive integer, got '0'"),
    ("./m:dtype=int4", "--model './m:dtype=int4': dtype: expected one of auto, float32"),
    ("./m:task=embed:task=classify", "--model './m:task=embed:task=classify' sets task twice"),
    (":name=x", "--model ':name=x' names no model folder before its options"),
])
def test_model_spec_errors(text, message):
    with pytest.raises(CliError) as error:
        parse_model_spec(text, KEYS)
    assert str(error.value).startswith(message)


def test_serve_command_loads_each_model_and_reports_its_memory(minilm_classifier_folder, tmp_path):
    port = free_port()
    folder = minilm_classifier_folder(3)
    command = [sys.executable, "-m", "poolrunner", "serve", "--port", str(port), "--dtype", "float32",
               "--model", f"{folder}:name=labels:max-model-len=128", "--model", f"{folder}:name=labels2"]
    stderr = tmp_path / "stderr"
    with stderr.open("w") as log:
        process = subprocess.Popen(command, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(process, url)
        cards = _ok(httpx.get(f"{url}/v1/models"))["data"]
        assert [(card["id"], card["max_model_len"]) for card in cards] == [("labels", 128), ("labels2", 512)]
    finally:
        process.terminate()
        process.wait(60)
    lines = [line for line in stderr.read_text().splitlines() if "loaded '" in line]
    assert len(lines) == 2, stderr.read_text()
    assert "loaded 'labels' (" in lines[0] and "task classify, float32 on cpu; resident memory +" in lines[0]


def test_serve_command_refuses_served_model_name_with_several_models(tmp_path):
    folder = Path(tmp_path)
    result = subprocess.run([sys.executable, "-m", "poolrunner", "serve", "--model", f"{folder}:name=a",
                             "--model", f"{folder}:name=b", "--served-model-name", "c"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "--served-model-name names a single model; with several, give each its names as --model " \
           "PATH:name=NAME" in result.stderr


def test_errors_name_the_answering_model_when_two_share_a_folder(minilm_classifier_folder, classifier_runtime):
    folder = minilm_classifier_folder(3)
    short = poolrunner.Runtime(folder, dtype="float32", max_model_len=16)
    models = [ServedModel(classifier_runtime(folder), "labels"), ServedModel(short, "labels-16")]
    text = " ".join(["word"] * 30)
    with ServerThread(models) as running:
        refused = httpx.post(f"{running.url}/classify", json={"model": "labels-16", "input": text})
        assert refused.status_code == 400
        message = refused.json()["error"]["message"]
        assert "max_model_len of labels-16" in message and str(folder) not in message, message
        assert httpx.post(f"{running.url}/classify", json={"model": "labels", "input": text}).status_code == 200
