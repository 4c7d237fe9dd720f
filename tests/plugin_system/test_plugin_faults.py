"""A third-party plugin's bugs are named: an exception its hook raises names the plugin and the
hook, a pooler's output that breaks the ``PoolerOutput`` contract names the task and the
pooler, and the runtime serves the built-in tasks' requests after each failure.

The references are written here: a first-token pooler's expected rows are read from the
model's own hidden states (transformers' ``BertModel`` on the same tiny folder).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import poolrunner
from poolrunner.core import (
    PluginHookError,
    Pooler,
    PoolerOutputError,
    PoolingMetadata,
    hookimpl,
)
from tests.helpers import assert_engine_empty

TASK = "first_embed"
TEXTS = ["a tiny sentence", "another one that is longer than the first", "the third one"]


class FirstPooler(Pooler):
    """Each request's first row, or one of the faults ``mode`` names."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def get_supported_tasks(self) -> frozenset[str]:
        return frozenset({TASK})

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> torch.Tensor | list[torch.Tensor]:
        first = hidden_states.float().index_select(0, metadata.query_start_loc[:-1])
        if self.mode == "unsplit":  # one result for the whole step
            return [first]
        if self.mode == "keepdim":  # [1, hidden] per request
            return [row[None] for row in first]
        if self.mode == "raises":
            raise ZeroDivisionError("pooling went wrong")
        return first


class FirstPlugin:
    """Serves :data:`TASK` with :class:`FirstPooler`; ``fail`` makes one of its hooks raise."""

    def __init__(self, mode: str = "ok", fail: str | None = None) -> None:
        self.mode, self.fail = mode, fail

    @hookimpl
    def supported_tasks(self, model_config):
        if self.fail == "supported_tasks":
            return model_config.vocab_size_typo
        return [TASK]

    @hookimpl
    def get_pooler(self, task):
        return FirstPooler(self.mode) if task == TASK else None

    @hookimpl
    def add_request(self, state):
        if self.fail == "add_request" and len(state.request.prompt_token_ids) == 3:
            raise KeyError("no entry for a three-token prompt")


def _runtime(folder, plugin: FirstPlugin) -> poolrunner.Runtime:
    return poolrunner.Runtime(str(folder), plugins=[plugin], load_entrypoints=False, dtype="float32")


@pytest.fixture(scope="module")
def folder(poolrunner_tiny_model):
    return poolrunner_tiny_model()


@pytest.fixture(scope="module")
def first_rows(folder) -> np.ndarray:
    """transformers' first-token hidden states of :data:`TEXTS`, one text at a time."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModel.from_pretrained(folder, local_files_only=True).eval()
    with torch.inference_mode():
        return np.stack([model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0, 0].numpy()
                         for text in TEXTS])


def _serves_embed(runtime: poolrunner.Runtime) -> None:
    assert runtime.embed(TEXTS).shape == (3, runtime.model_config.hidden_size)


def test_a_working_plugin_pools_the_first_rows(folder, first_rows):
    runtime = _runtime(folder, FirstPlugin())
    np.testing.assert_allclose(np.stack(runtime.encode(TEXTS, task=TASK)), first_rows, atol=1e-5)


def test_an_exception_in_a_load_hook_names_the_plugin(folder):
    with pytest.raises(PluginHookError) as caught:
        _runtime(folder, FirstPlugin(fail="supported_tasks"))
    assert str(caught.value) == (
        "plugin FirstPlugin (programmatic) raised in its supported_tasks hook: AttributeError: 'ModelConfig' object "
        "has no attribute 'vocab_size_typo'; fix it, or leave it out (disable_plugins, --disable-plugin FirstPlugin)")
    assert isinstance(caught.value.__cause__, AttributeError)


def test_an_exception_in_a_request_hook_names_the_plugin_and_fails_that_request_only(folder, first_rows):
    runtime = _runtime(folder, FirstPlugin(fail="add_request"))
    with pytest.raises(PluginHookError, match=r"^plugin FirstPlugin \(programmatic\) raised in its add_request hook: "
                                              r"KeyError: 'no entry for a three-token prompt'; "):
        runtime.encode(["a"], task=TASK)  # [CLS] a [SEP]
    np.testing.assert_allclose(np.stack(runtime.encode(TEXTS, task=TASK)), first_rows, atol=1e-5)


POOLER = f"{FirstPooler.__module__}.FirstPooler"


@pytest.mark.parametrize(("mode", "message"), [
    ("unsplit", f"the pooler of task {TASK!r} ({POOLER}) returned 1 result for 3 requests; a pooler returns one "
                "result per request (PoolerOutput)"),
    ("keepdim", f"the pooler of task {TASK!r} ({POOLER}) returned results of shapes [1, 32], [1, 32], [1, 32]; each "
                "request's first_embed result is a tensor of 1 dimension"),
])
def test_a_pooler_output_that_breaks_the_contract_is_refused_naming_the_pooler(folder, mode, message, monkeypatch):
    from poolrunner.core.engine import runner

    monkeypatch.setitem(runner._RANKS, TASK, 1)  # as the built-in embed: one vector a request
    runtime = _runtime(folder, FirstPlugin(mode))
    with pytest.raises(PoolerOutputError) as caught:
        runtime.encode(TEXTS, task=TASK)
    assert str(caught.value) == message
    _serves_embed(runtime)


def test_a_pooler_that_raises_is_noted_on_its_exception(folder):
    runtime = _runtime(folder, FirstPlugin("raises"))
    with pytest.raises(ZeroDivisionError) as caught:
        runtime.encode(TEXTS[:1], task=TASK)
    assert (str(caught.value), caught.value.__notes__) == (
        "pooling went wrong", [f"raised while pooling task {TASK!r} with {POOLER}"])
    _serves_embed(runtime)


class FlatTokenPooler(Pooler):
    """``token_classify`` as one number a token: the shape of BGE-M3's token weights, which a
    ``*ForTokenClassification`` model's labels must not take."""

    def get_supported_tasks(self) -> frozenset[str]:
        return frozenset({"token_classify"})

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
        return list(torch.split(hidden_states.float()[:, 0], metadata.prompt_lens.tolist()))


class FlatTokenPlugin:
    @hookimpl
    def get_pooler(self, task):
        return FlatTokenPooler() if task == "token_classify" else None


def test_token_labels_of_one_dimension_are_refused_where_the_model_has_a_label_head(poolrunner_tiny_model):
    runtime = _runtime(poolrunner_tiny_model("BertForTokenClassification", num_labels=3), FlatTokenPlugin())
    with pytest.raises(PoolerOutputError) as caught:
        runtime.encode(TEXTS, task="token_classify")
    assert str(caught.value) == (
        f"the pooler of task 'token_classify' ({FlatTokenPooler.__module__}.FlatTokenPooler) returned results of "
        "shapes [5], [10], [5]; each request's token_classify result is a tensor of 2 dimensions")
    assert_engine_empty(runtime)  # the step's requests failed and left; nothing waits
