"""The models of the by-operation tests: the test kit's tiny BERT folders (seeded, session-wide),
each with one shared float32 runtime (``task_runtime``, from ``tests/conftest.py``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from poolrunner.core.server import ServedModel
from poolrunner.core.testing.server import ServerThread
from tests.operations.surfaces import SPLADE


@pytest.fixture(scope="session")
def embed_folder(poolrunner_tiny_folder) -> Path:
    """A ``BertModel``: ``embed`` (CLS pooling, normalized) and ``token_embed``."""
    return poolrunner_tiny_folder("bert", "model")


@pytest.fixture(scope="session")
def classifier_folder(poolrunner_tiny_folder) -> Path:
    """A ``BertForSequenceClassification`` over three labels (softmax); it takes pairs too."""
    return poolrunner_tiny_folder("bert", "sequence", variant="multiclass")


@pytest.fixture(scope="session")
def cross_encoder_folder(poolrunner_tiny_folder) -> Path:
    """A ``BertForSequenceClassification`` with one label (sigmoid): a cross-encoder."""
    return poolrunner_tiny_folder("bert", "sequence", variant="single")


@pytest.fixture(scope="session")
def token_classifier_folder(poolrunner_tiny_folder) -> Path:
    """A ``BertForTokenClassification`` over five labels."""
    return poolrunner_tiny_folder("bert", "token")


@pytest.fixture(scope="session")
def splade_folder(poolrunner_tiny_folder, tmp_path_factory) -> Path:
    """A ``BertForMaskedLM`` laid out as a sentence-transformers SparseEncoder (``modules.json``:
    MLMTransformer, SpladePooling with max pooling), so the installed poolrunner-splade plugin
    serves it with ``sparse_embed`` as its default task (on every surface, the command line's
    ``score`` and ``rerank`` too); the tests that need it skip without the plugin (README's test
    install has it)."""
    pytest.importorskip("poolrunner_splade", reason="poolrunner-splade is not installed (see README's test install)")
    folder = tmp_path_factory.mktemp("splade") / "tiny-splade"
    shutil.copytree(poolrunner_tiny_folder("bert", "masked_lm"), folder)
    modules = [("", "sentence_transformers.sparse_encoder.models.MLMTransformer"),
               ("1_SpladePooling", "sentence_transformers.sparse_encoder.models.SpladePooling")]
    (folder / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": path, "type": kind} for i, (path, kind) in enumerate(modules)]))
    (folder / "1_SpladePooling").mkdir()
    (folder / "1_SpladePooling" / "config.json").write_text(
        json.dumps({"pooling_strategy": "max", "activation_function": "relu"}))
    return folder


@pytest.fixture(scope="module")
def cross(task_runtime, cross_encoder_folder):
    return task_runtime(cross_encoder_folder)


@pytest.fixture(scope="module")
def bi(task_runtime, embed_folder):
    return task_runtime(embed_folder)


@pytest.fixture(scope="module")
def scorers(request, task_runtime, cross, bi):
    """A cross-encoder (``cross``), a bi-encoder (``bi``) and, installed, SPLADE (``splade``) in one server."""
    models = [ServedModel(cross, ("cross",)), ServedModel(bi, ("bi",))]
    if SPLADE:
        models.append(ServedModel(task_runtime(request.getfixturevalue("splade_folder")), ("splade",)))
    with ServerThread(models) as running:
        yield running
