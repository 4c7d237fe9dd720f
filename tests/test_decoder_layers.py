"""Llama-code decoder layers run by one function (``core/model/decoder_layers.py``): Llama's,
Mistral's, Qwen2's (causal and bidirectional) and Qwen3's (with sliding layers) equal
transformers' own, each input run alone, with query, key and value in one product; hooks on the
layers and on their attention still see what transformers' forward gives them; other codes keep
transformers' forward."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from poolrunner import Runtime
from poolrunner.core.kernels import onednn
from poolrunner.core.kernels.joined_projections import JoinedProjections
from poolrunner.core.model import decoder_layers
from tests.helpers import assert_captures_equal, normalized
from tests.models.architectures import FAMILIES, Row, build_folder, inputs_for, load_reference, reference_output


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen2-bidirectional", "qwen3", "qwen3-sliding"])
def test_a_decoder_embedder_equals_transformers_with_its_layers_run_directly(tmp_path, family):
    row = Row(next(f for f in FAMILIES if f.id == family), "model")
    folder = build_folder(row, tmp_path / family)
    runtime = Runtime(folder, dtype="float32", pooling_type="MEAN", load_entrypoints=False)
    layers = runtime._engine.runner.backbone.layers
    assert all("forward" in vars(layer) and isinstance(layer.self_attn.projections, JoinedProjections)
               for layer in layers)
    reference = load_reference(row, folder)
    batch = [list(ids) for ids in inputs_for(row).mixed]
    expected = np.stack([reference_output(reference, ids).mean(0) for ids in batch])
    np.testing.assert_allclose(runtime.embed(batch), normalized(expected),
                               atol=2e-6)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2-bidirectional", "qwen3-sliding"])
def test_a_last_token_embedder_equals_transformers_with_its_last_layer_on_the_last_rows(tmp_path, family,
                                                                                          read_rows_steps):
    row = Row(next(f for f in FAMILIES if f.id == family), "model")
    folder = build_folder(row, tmp_path / family)
    runtime = Runtime(folder, dtype="float32", pooling_type="LAST", load_entrypoints=False)
    read_rows_steps.clear()  # the load's own forwards (the attention probe)
    reference = load_reference(row, folder)
    batch = [list(ids) for ids in inputs_for(row).mixed]
    expected = np.stack([reference_output(reference, ids)[-1] for ids in batch])
    np.testing.assert_allclose(runtime.embed(batch), normalized(expected),
                               atol=2e-6)
    assert read_rows_steps and set(read_rows_steps) == {"last"}


def test_prefill_chunks_read_the_last_row_of_their_last_chunk(tmp_path, read_rows_steps):
    """Prompts longer than the step run in chunks: a step where no request finishes computes every
    row; one where some do (chunks beside whole prompts) computes the last row of each finishing
    one, and the embeddings still equal transformers'."""
    row = Row(next(f for f in FAMILIES if f.id == "llama"), "model")
    folder = build_folder(row, tmp_path / "llama")
    runtime = Runtime(folder, dtype="float32", pooling_type="LAST", max_num_batched_tokens=16,
                      load_entrypoints=False)
    reference = load_reference(row, folder)
    batch = [list(ids) for ids in inputs_for(row).mixed]
    assert max(len(ids) for ids in batch) > 16
    for inputs in ([max(batch, key=len)], batch):
        read_rows_steps.clear()
        expected = np.stack([reference_output(reference, ids)[-1] for ids in inputs])
        np.testing.assert_allclose(runtime.embed(inputs), normalized(expected),
                                   atol=2e-6)
        if len(inputs) == 1:  # 30 tokens in 16-token steps: a chunk alone, then its last chunk
            assert read_rows_steps == ["all", "last"]
        assert set(read_rows_steps) == {"all", "last"}


def _tiny_llama(**config):
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 99, "attn_implementation": "eager", **config}
    return LlamaModel(LlamaConfig(**small)).eval()


def test_hooks_on_the_layers_and_their_attention_see_what_transformers_gives_them():
    """transformers' hidden-state capture hooks the layers (still called as modules), its
    attention capture the attention modules (whose layers then run transformers' forward, the
    projections as their own layers again, over views of the joined weights)."""
    reference = _tiny_llama()
    model = copy.deepcopy(reference)
    onednn.prepack(model)
    assert decoder_layers.run_layers_directly(model)
    assert_captures_equal(model, reference, torch.randint(5, 99, (2, 7)))


def test_only_known_codes_get_the_forward():
    from transformers import BertConfig, BertModel, Gemma2Config, Gemma2Model

    llama = _tiny_llama()
    assert decoder_layers.run_layers_directly(llama) and all("forward" in vars(layer) for layer in llama.layers)
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    gemma2 = Gemma2Model(Gemma2Config(**small, num_key_value_heads=2, head_dim=8))
    assert not decoder_layers.run_layers_directly(gemma2)
    assert all("forward" not in vars(layer) for layer in gemma2.layers)
    assert not decoder_layers.run_layers_directly(BertModel(BertConfig(**small)))
