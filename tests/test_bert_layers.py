"""BERT-code layers run by one function (``core/model/bert_layers.py``): every family with BERT's
layer code equals transformers' own, each input run alone, with query, key and value in one
product; where every pooler of a step reads only each request's first row, the last layer
computes those only, and CLS embeddings and CLS classifier scores still equal transformers';
elsewhere every row is computed. Hooks on the layers and on their self-attention still see what
transformers' forward gives them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from poolrunner import Runtime
from poolrunner.core.kernels.joined_projections import JoinedProjections
from poolrunner.core.model import bert_layers
from tests.helpers import assert_captures_equal, normalized
from tests.models.architectures import FAMILIES, Row, build_folder, inputs_for, load_reference, reference_output


def _loaded(tmp_path, family: str, head: str, read_rows_steps: list[str], **options):
    """The row's tiny folder loaded by poolrunner (float32) and by transformers, and its mixed-length inputs."""
    row = Row(next(f for f in FAMILIES if f.id == family), head)
    folder = build_folder(row, tmp_path / family)
    runtime = Runtime(folder, dtype="float32", load_entrypoints=False, **options)
    read_rows_steps.clear()  # the load's own forwards (the attention probe)
    return runtime, load_reference(row, folder), [list(ids) for ids in inputs_for(row).mixed]


@pytest.mark.parametrize("family", ["bert", "roberta", "xlm-roberta"])
def test_a_cls_embedder_equals_transformers_with_its_last_layer_on_the_first_rows(tmp_path, family, read_rows_steps):
    runtime, reference, batch = _loaded(tmp_path, family, "model", read_rows_steps, pooling_type="CLS")
    got = runtime.embed(batch)
    expected = normalized(np.stack([reference_output(reference, ids)[0] for ids in batch]))
    np.testing.assert_allclose(got, expected, atol=2e-6)
    assert read_rows_steps and set(read_rows_steps) == {"first"}


def test_a_cross_encoders_scores_equal_transformers_with_its_last_layer_on_the_first_rows(tmp_path, read_rows_steps):
    runtime, reference, batch = _loaded(tmp_path, "bert", "sequence", read_rows_steps)
    got = np.stack([result.probs for result in runtime.classify(batch, use_activation=False)])
    np.testing.assert_allclose(got, np.stack([reference_output(reference, ids) for ids in batch]), atol=2e-5)
    assert read_rows_steps and set(read_rows_steps) == {"first"}


def test_a_pooler_reading_every_row_gets_every_row_computed(tmp_path, read_rows_steps):
    runtime, reference, batch = _loaded(tmp_path, "bert", "model", read_rows_steps, pooling_type="MEAN")
    got = runtime.embed(batch)
    np.testing.assert_allclose(got, normalized(np.stack([reference_output(reference, ids).mean(0) for ids in batch])),
                               atol=2e-6)
    assert read_rows_steps and set(read_rows_steps) == {"all"}


def test_a_third_party_pool_hook_gets_every_row(tmp_path, read_rows_steps):
    """The ``pool`` hook is promised every row: a plugin that does not ship with poolrunner and
    implements it keeps the whole last layer."""
    from poolrunner import hookimpl

    class Wrapper:
        rows_seen: list[torch.Tensor] = []

        @hookimpl(wrapper=True)
        def pool(self, hidden_states):
            self.rows_seen.append(hidden_states.clone())
            return (yield)

    runtime, _, batch = _loaded(tmp_path, "bert", "model", read_rows_steps, pooling_type="CLS", plugins=[Wrapper()])
    runtime.embed(batch)
    assert read_rows_steps and set(read_rows_steps) == {"all"}
    assert all(bool((states.abs().sum(-1) > 0).all()) for states in Wrapper.rows_seen)


@pytest.mark.parametrize("family", ["bert", "electra", "ernie"])
def test_every_bert_code_family_equals_transformers_with_its_layers_run_directly(tmp_path, family, read_rows_steps):
    runtime, reference, batch = _loaded(tmp_path, family, "model", read_rows_steps, pooling_type="MEAN")
    layers = runtime._engine.runner.backbone.encoder.layer
    assert all(isinstance(layer.attention.self.projections, JoinedProjections) for layer in layers)
    got = runtime.embed(batch)
    np.testing.assert_allclose(got, normalized(np.stack([reference_output(reference, ids).mean(0) for ids in batch])),
                               atol=2e-6)


def test_the_joined_projections_keep_the_weights_names_and_values_without_a_copy(tmp_path, read_rows_steps):
    runtime, reference, _ = _loaded(tmp_path, "bert", "model", read_rows_steps)
    backbone = runtime._engine.runner.backbone
    expected = reference.base_model.state_dict()
    for index, layer in enumerate(backbone.encoder.layer):
        attention, joined = layer.attention.self, layer.attention.self.projections.product.weight
        for name in ("query", "key", "value"):
            key = f"encoder.layer.{index}.attention.self.{name}"
            torch.testing.assert_close(getattr(attention, name).weight, expected[f"{key}.weight"], rtol=0, atol=0)
            torch.testing.assert_close(getattr(attention, name).bias, expected[f"{key}.bias"], rtol=0, atol=0)
            assert getattr(attention, name).weight.untyped_storage().data_ptr() == joined.untyped_storage().data_ptr()


def _tiny_bert(**config):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": 99, "attn_implementation": "eager", **config}
    return BertModel(BertConfig(**small)).eval()


def test_hooks_on_the_layers_and_their_attention_see_what_transformers_gives_them():
    """transformers' hidden-state capture hooks the layers (still called as modules), its
    attention capture the self-attention modules (whose layers then run transformers' forward,
    query, key and value as their own layers again, over views of the joined weights)."""
    import copy

    from poolrunner.core.kernels import onednn

    reference = _tiny_bert()
    model = copy.deepcopy(reference)
    onednn.prepack(model)
    assert bert_layers.run_layers_directly(model)
    assert all(hasattr(layer.attention.self, "projections") for layer in model.encoder.layer)
    assert_captures_equal(model, reference, torch.randint(5, 99, (2, 7)))


def test_a_hook_on_an_inlined_block_sees_its_output():
    """A user's hook on a block the direct forward does not call as a module (here the MLP's first
    half) makes the layer run transformers' forward, so the hook fires with that block's output."""
    import copy

    from poolrunner.core.kernels import onednn

    reference = _tiny_bert()
    model = copy.deepcopy(reference)
    onednn.prepack(model)
    bert_layers.run_layers_directly(model)
    seen: dict[str, torch.Tensor] = {}
    for name, net in (("want", reference), ("got", model)):
        net.encoder.layer[1].intermediate.register_forward_hook(lambda _m, _i, out, name=name: seen.update({name: out}))
    ids = torch.randint(5, 99, (2, 7))
    with torch.inference_mode():
        want, got = reference(ids).last_hidden_state, model(ids).last_hidden_state
    torch.testing.assert_close(seen["got"], seen["want"])
    torch.testing.assert_close(got, want)


def test_only_a_bert_code_encoder_gets_the_forward():
    from transformers import LlamaConfig, LlamaModel

    assert bert_layers.run_layers_directly(_tiny_bert())
    decoder = _tiny_bert(is_decoder=True, add_cross_attention=True)
    assert not bert_layers.run_layers_directly(decoder)
    assert all("forward" not in vars(layer) for layer in decoder.encoder.layer)
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    assert not bert_layers.run_layers_directly(LlamaModel(LlamaConfig(**small, num_key_value_heads=4)))
