"""The last layer computed for the first rows only (``core/model/last_layer.py``): where every
pooler of a step reads only each request's first row, CLS embeddings and CLS classifier scores
still equal transformers' own, each input run alone; elsewhere every row is computed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from poolrunner import Runtime
from poolrunner.core.model import last_layer
from tests.models.architectures import FAMILIES, Row, build_folder, inputs_for, load_reference, reference_output


@pytest.fixture
def first_rows_steps(monkeypatch):
    """Per call of a pruning last layer: whether its step asked for the first rows only."""
    seen: list[bool] = []
    forward = last_layer._forward

    def spy(self, hidden_states, *args, **kwargs):
        seen.append(kwargs["poolrunner_layout"].first_rows_only)
        return forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(last_layer, "_forward", spy)
    return seen


def _loaded(tmp_path, family: str, head: str, first_rows_steps: list[bool], **options):
    """The row's tiny folder loaded by poolrunner (float32) and by transformers, and its mixed-length inputs."""
    row = Row(next(f for f in FAMILIES if f.id == family), head)
    folder = build_folder(row, tmp_path / family)
    runtime = Runtime(folder, dtype="float32", load_entrypoints=False, **options)
    first_rows_steps.clear()  # the load's own forwards (the attention probe)
    return runtime, load_reference(row, folder), [list(ids) for ids in inputs_for(row).mixed]


def _normalized(rows: list[np.ndarray]) -> np.ndarray:
    stacked = np.stack(rows)
    return stacked / np.linalg.norm(stacked, axis=-1, keepdims=True)


@pytest.mark.parametrize("family", ["bert", "roberta", "xlm-roberta"])
def test_a_cls_embedder_equals_transformers_with_its_last_layer_on_the_first_rows(tmp_path, family, first_rows_steps):
    runtime, reference, batch = _loaded(tmp_path, family, "model", first_rows_steps, pooling_type="CLS")
    got = runtime.embed(batch)
    np.testing.assert_allclose(got, _normalized([reference_output(reference, ids)[0] for ids in batch]), atol=2e-6)
    assert first_rows_steps and all(first_rows_steps)


def test_a_cross_encoders_scores_equal_transformers_with_its_last_layer_on_the_first_rows(tmp_path, first_rows_steps):
    runtime, reference, batch = _loaded(tmp_path, "bert", "sequence", first_rows_steps)
    got = np.stack([result.probs for result in runtime.classify(batch, use_activation=False)])
    np.testing.assert_allclose(got, np.stack([reference_output(reference, ids) for ids in batch]), atol=2e-5)
    assert first_rows_steps and all(first_rows_steps)


def test_a_pooler_reading_every_row_gets_every_row_computed(tmp_path, first_rows_steps):
    runtime, reference, batch = _loaded(tmp_path, "bert", "model", first_rows_steps, pooling_type="MEAN")
    got = runtime.embed(batch)
    np.testing.assert_allclose(got, _normalized([reference_output(reference, ids).mean(0) for ids in batch]),
                               atol=2e-6)
    assert first_rows_steps and not any(first_rows_steps)


def test_a_third_party_pool_hook_gets_every_row(tmp_path, first_rows_steps):
    """The ``pool`` hook is promised every row: a plugin that does not ship with poolrunner and
    implements it keeps the whole last layer."""
    from poolrunner import hookimpl

    class Wrapper:
        rows_seen: list[torch.Tensor] = []

        @hookimpl(wrapper=True)
        def pool(self, hidden_states):
            self.rows_seen.append(hidden_states.clone())
            return (yield)

    runtime, _, batch = _loaded(tmp_path, "bert", "model", first_rows_steps, pooling_type="CLS", plugins=[Wrapper()])
    runtime.embed(batch)
    assert first_rows_steps and not any(first_rows_steps)
    assert all(bool((states.abs().sum(-1) > 0).all()) for states in Wrapper.rows_seen)


def test_only_a_bert_code_encoder_gets_the_forward():
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaModel

    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    assert last_layer.compute_first_rows_only(BertModel(BertConfig(**small)))
    assert not last_layer.compute_first_rows_only(BertModel(BertConfig(**small, is_decoder=True,
                                                                       add_cross_attention=True)))
    assert not last_layer.compute_first_rows_only(LlamaModel(LlamaConfig(**small, num_key_value_heads=4)))
