"""Plugin-declared tasks, the ``score_outputs`` hook and folders that require a plugin.

A code-passed plugin declares the task ``first_token`` (the raw CLS hidden state as a named
output) and scores it by dot product; references come from transformers on the same weights.
"""

from __future__ import annotations

import json
import shutil
import types

import numpy as np
import pytest
import torch

import poolrunner
from poolrunner.core import (
    ModelConfig,
    ModelLoadError,
    Pooler,
    PoolingMetadata,
    UnsupportedTaskError,
    hookimpl,
)

TASK = "first_token"


class FirstTokenPooler(Pooler):
    def get_supported_tasks(self) -> frozenset[str]:
        return frozenset({TASK})

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> list[dict[str, torch.Tensor]]:
        return [{"vector": row.float()} for row in hidden_states[metadata.query_start_loc[:-1]]]


class FirstToken:
    """Declares ``first_token`` for encoders and scores it with a dot product."""

    def __init__(self) -> None:
        self.scored: list[int] = []

    @hookimpl
    def supported_tasks(self, model_config: ModelConfig) -> frozenset[str]:
        return frozenset() if model_config.is_causal else frozenset({TASK})

    @hookimpl
    def get_pooler(self, model_config: ModelConfig, task: str) -> Pooler | None:
        return FirstTokenPooler() if task == TASK and not model_config.is_causal else None

    @hookimpl
    def score_outputs(self, task: str, queries, documents) -> torch.Tensor | None:
        if task != TASK:
            return None
        self.scored.append(len(queries))
        return torch.stack([(q["vector"] * d["vector"]).sum() for q, d in zip(queries, documents, strict=True)])


@pytest.fixture(scope="module")
def first_token():
    plugin = FirstToken()
    runtime = poolrunner.Runtime(plugins=[plugin], load_entrypoints=False, task=TASK, dtype="float32")
    return plugin, runtime


def test_a_plugin_declared_task_is_served_and_encoded(first_token, hf_hidden):
    _, runtime = first_token
    assert runtime.task == TASK
    texts = ["A cat sat on the mat.", "Paris is the capital of France."]
    outputs = runtime.encode(texts)
    states, _ = hf_hidden(runtime.inputs.encode(texts))
    for output, reference in zip(outputs, states[:, 0], strict=True):
        assert set(output) == {"vector"} and output["vector"].dtype == np.float32
        np.testing.assert_allclose(output["vector"], reference.numpy(), atol=1e-4)


def test_hook_score_outputs(first_token, hf_hidden):
    plugin, runtime = first_token
    query, documents = "capital of France", ["Paris is the capital of France.", "A cat sat.", "capital of France"]
    plugin.scored.clear()
    scores = runtime.score(query, documents)
    assert plugin.scored == [3]  # one call for all pairs, each text pooled once
    states, _ = hf_hidden(runtime.inputs.encode([query, *documents]))
    cls = states[:, 0].double()
    expected = (cls[1:] @ cls[0]).numpy()
    assert scores.dtype == np.float32 and scores.shape == (3,)
    np.testing.assert_allclose(scores, expected, rtol=1e-4)
    ranked = runtime.rerank(query, documents)
    assert [r.index for r in ranked] == list(np.argsort(-expected, kind="stable"))


def test_score_without_a_scoring_plugin_still_fails_clearly(first_token, tmp_path):
    class Quiet(FirstToken):
        @hookimpl
        def score_outputs(self, task: str) -> None:
            return None

    runtime = poolrunner.Runtime(plugins=[Quiet()], load_entrypoints=False, task=TASK, dtype="float32")
    with pytest.raises(UnsupportedTaskError) as caught:
        runtime.score("a", ["b"])
    assert str(caught.value) == (
        "score needs an embed model (bi-encoder) or a classify model with one label (cross-encoder); this "
        f"runtime serves {TASK!r} with 0 labels, and no plugin scores {TASK!r} outputs (see `poolrunner "
        "plugins --hook score_outputs`)."
    )
    assert set(runtime.encode("still serving")[0]) == {"vector"}


def test_a_plugin_task_is_never_the_default_beside_builtin_tasks(first_token):
    runtime = poolrunner.Runtime(plugins=[FirstToken()], load_entrypoints=False, dtype="float32")
    assert runtime.task == "embed"


def test_an_undeclared_task_fails_at_load(default_model_path):
    with pytest.raises(UnsupportedTaskError, match=r"does not support task 'sparse_embed'\. Supported: \["):
        poolrunner.Runtime(default_model_path, load_entrypoints=False, task="sparse_embed", dtype="float32")


@pytest.fixture
def splade_folder(default_model_path, tmp_path):
    """The default model's folder with a sentence-transformers SparseEncoder modules.json."""
    folder = tmp_path / "sparse"
    shutil.copytree(default_model_path, folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.sparse_encoder.models.MLMTransformer"},
        {"idx": 1, "name": "1", "path": "1_SpladePooling",
         "type": "sentence_transformers.sparse_encoder.models.SpladePooling"},
    ]))
    return folder


def test_a_folder_that_needs_a_missing_plugin_fails_at_load_naming_the_distribution(splade_folder):
    with pytest.raises(ModelLoadError) as caught:
        poolrunner.Runtime(splade_folder, load_entrypoints=False, dtype="float32")
    assert str(caught.value) == (
        f"model {str(splade_folder)!r} needs the 'splade' plugin (modules.json lists "
        "sentence_transformers.sparse_encoder.models.MLMTransformer), which is not installed or is "
        "disabled: pip install poolrunner-splade"
    )


def test_a_folder_that_needs_a_plugin_is_served_only_by_it(splade_folder):
    stand_in = types.ModuleType("splade")  # registered under the name the folder asks for
    stand_in.supported_tasks, stand_in.get_pooler = FirstToken().supported_tasks, FirstToken().get_pooler
    runtime = poolrunner.Runtime(splade_folder, plugins=[stand_in], load_entrypoints=False, dtype="float32")
    assert runtime.task == TASK  # the only task of the required plugin, not the built-in embed
    with pytest.raises(UnsupportedTaskError, match=r"does not support task 'embed'\. Supported: \['first_token'\]"):
        poolrunner.Runtime(splade_folder, plugins=[stand_in], load_entrypoints=False, task="embed", dtype="float32")
