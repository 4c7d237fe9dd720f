"""The packed attention implements what a layer asks for, or the model is refused at load.

The architecture matrix (test_architecture_matrix.py) proves the supported families equal
transformers; these tests prove the refusals: an argument the attention function does not
implement, a dropout at inference, a mask built outside transformers' mask interface; and the
load-time probe that decides whether prompts may run in chunks.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama import modeling_llama

from poolrunner import Runtime
from poolrunner.core.errors import ModelLoadError, UnsupportedAttentionError
from poolrunner.core.kernels.attention import LAYOUT_KWARG, MaskRule, PackedLayout, packed_attention
from poolrunner.core.testing.steps import record_steps
from tests.models.architectures import make_tokenizer

_DECODER = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "bos_token_id": 0, "eos_token_id": 2,
            "pad_token_id": 2, "max_position_embeddings": 128}


def _folder(config: transformers.PretrainedConfig, folder) -> str:
    torch.manual_seed(0)
    make_tokenizer().save_pretrained(folder)
    getattr(transformers, config.architectures[0])(config).save_pretrained(folder)
    return str(folder)


def _inputs(num_tokens: int = 5, heads: int = 2, dim: int = 8) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return tuple(torch.randn(1, heads, num_tokens, dim) for _ in range(3))


def _bidirectional(_b, _h, q_idx, kv_idx):
    return q_idx >= 0


def test_an_argument_the_attention_does_not_implement_is_refused():
    q, k, v = _inputs()
    layout = PackedLayout.build([5])
    with pytest.raises(UnsupportedAttentionError, match="does not implement: new_feature$"):
        packed_attention(torch.nn.Identity(), q, k, v, MaskRule(_bidirectional, False),
                         new_feature=2.0, **{LAYOUT_KWARG: layout})


def test_inert_and_empty_arguments_are_accepted():
    q, k, v = _inputs()
    layout = PackedLayout.build([5])
    out, _ = packed_attention(torch.nn.Identity(), q, k, v, MaskRule(_bidirectional, False),
                              position_ids=torch.arange(5), sliding_window=None, new_feature=None,
                              **{LAYOUT_KWARG: layout})
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, expected.transpose(1, 2))


def test_dropout_at_inference_is_refused():
    q, k, v = _inputs()
    layout = PackedLayout.build([5])
    with pytest.raises(UnsupportedAttentionError, match="attention dropout 0.1 at inference"):
        packed_attention(torch.nn.Identity(), q, k, v, MaskRule(_bidirectional, False), dropout=0.1,
                         **{LAYOUT_KWARG: layout})


def test_a_mask_built_outside_the_mask_interface_is_refused():
    q, k, v = _inputs()
    layout = PackedLayout.build([5])
    with pytest.raises(UnsupportedAttentionError, match="did not build its attention mask through"):
        packed_attention(torch.nn.Identity(), q, k, v, torch.ones(1, 1, 5, 5, dtype=torch.bool),
                         **{LAYOUT_KWARG: layout})


def test_a_model_whose_layers_pass_an_unknown_argument_is_refused_at_load(monkeypatch, tiny_llama_folder):
    """What a new transformers release adding an attention feature would look like: the load
    fails naming the architecture and the argument, and the same folder loads once it is gone."""
    original = modeling_llama.LlamaAttention.forward

    def with_new_feature(self, *args, **kwargs):
        return original(self, *args, attention_temperature=0.5, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", with_new_feature)
    with pytest.raises(ModelLoadError) as info:
        Runtime(tiny_llama_folder, dtype="float32", load_entrypoints=False)
    assert str(info.value) == (
        "LlamaModel cannot run on packed batches: LlamaAttention passes attention arguments poolrunner "
        "does not implement: attention_temperature"
    )
    monkeypatch.undo()
    assert Runtime(tiny_llama_folder, dtype="float32", load_entrypoints=False).embed(["w1 w2"]).shape == (1, 64)


@pytest.fixture(scope="module")
def tiny_llama_folder(tmp_path_factory):
    config = transformers.LlamaConfig(**_DECODER, architectures=["LlamaModel"])
    return _folder(config, tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize(("overrides", "causal"), [
    ({}, True),
    ({"is_causal": False}, False),  # the gte-Qwen2 layout
])
def test_the_load_probe_allows_chunks_only_where_every_layer_is_causal(tmp_path, overrides, causal):
    config = transformers.Qwen2Config(**_DECODER, architectures=["Qwen2Model"], **overrides)
    runtime = Runtime(_folder(config, tmp_path), dtype="float32", load_entrypoints=False, max_num_batched_tokens=4)
    with record_steps(runtime) as log:
        runtime.embed([list(range(5, 15))])  # 10 tokens over a 4-token budget
    spans = [chunk.span for chunk in log.chunks(log.admitted[0])]
    assert spans == ([(0, 4), (4, 8), (8, 10)] if causal else [(0, 10)])  # else whole, in a step of its own
    assert runtime.model_config.is_causal is causal
    assert runtime.model_config.pooling_type == "LAST"  # a decoder either way
