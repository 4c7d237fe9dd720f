"""MPNet (all-mpnet-base-v2's family): its attention in one SDPA call
(``core/kernels/fused_mpnet.py``) against transformers' own eager MPNet and the same model in
float64, and its positions' offset."""

from __future__ import annotations

import gc

import pytest
import torch
import transformers

from poolrunner.core.kernels.fused_mpnet import _MaskSum, fuse_mpnet_attention


def _models(dtype: torch.dtype) -> tuple[transformers.MPNetModel, transformers.MPNetModel]:
    """A seeded 3-layer MPNet in ``dtype`` and its float64 copy."""
    config = transformers.MPNetConfig(vocab_size=100, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                      intermediate_size=96)
    torch.manual_seed(0)
    model = transformers.MPNetModel(config).eval().to(dtype)
    exact = transformers.MPNetModel(config).eval().double()
    exact.load_state_dict({name: value.double() for name, value in model.state_dict().items()})
    return model, exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mpnet_attention_in_one_sdpa_call_computes_what_the_eager_code_computes(dtype):
    """Padded rows and unpadded batches; float32 to rounding, bfloat16 no further from float64
    than the eager code; the attention probabilities still the module's own."""
    model, exact = _models(dtype)
    ids = torch.randint(5, 100, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, 6:] = mask[2, 3:] = 0
    valid = mask.bool()
    with torch.inference_mode():
        eager = [model(ids, attention_mask=mask).last_hidden_state, model(ids).last_hidden_state]
        probabilities = model(ids, attention_mask=mask, output_attentions=True).attentions
        reference = [exact(ids, attention_mask=mask).last_hidden_state, exact(ids).last_hidden_state]
        assert fuse_mpnet_attention(model, join_projections=True) == 3
        fused = [model(ids, attention_mask=mask).last_hidden_state, model(ids).last_hidden_state]
        assert all(torch.equal(a, b) for a, b in zip(
            model(ids, attention_mask=mask, output_attentions=True).attentions, probabilities, strict=True))
    for got, own, truth, rows in zip(fused, eager, reference, (valid, torch.ones_like(valid)), strict=True):
        assert got.dtype == dtype
        error, own_error = ((t.double() - truth)[rows].abs().max() for t in (got, own))
        if dtype == torch.float32:
            torch.testing.assert_close(got[rows], own[rows], rtol=1e-5, atol=1e-5)
        assert error <= 1.05 * own_error + 1e-6, (error, own_error)


def test_prepacked_query_key_and_value_joined_compute_what_the_eager_code_computes():
    """One product for the three (float32, prepacked); the probabilities, which run the module's
    own code, still come from the three layers, over views of the joined weights."""
    from poolrunner.core.kernels import onednn
    from poolrunner.core.kernels.joined_projections import JoinedProjections

    model, _ = _models(torch.float32)
    ids = torch.randint(5, 100, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, 6:] = 0
    with torch.inference_mode():
        eager = model(ids, attention_mask=mask).last_hidden_state
        probabilities = model(ids, attention_mask=mask, output_attentions=True).attentions
        onednn.prepack(model)
        assert fuse_mpnet_attention(model, join_projections=True) == 3
        assert all(isinstance(layer.attention.attn.projections, JoinedProjections) for layer in model.encoder.layer)
        joined = model(ids, attention_mask=mask).last_hidden_state
        again = model(ids, attention_mask=mask, output_attentions=True).attentions
    torch.testing.assert_close(joined[mask.bool()], eager[mask.bool()], rtol=1e-5, atol=1e-5)
    for got, want in zip(again, probabilities, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_bias_and_mask_are_summed_once_per_forward_and_freed_with_it():
    masks = _MaskSum()
    bias, mask = torch.randn(2, 4, 5, 5), torch.zeros(2, 1, 5, 5)
    first = masks.sum(bias, mask)
    assert masks.sum(bias, mask) is first and torch.equal(first, bias + mask)  # every later layer reuses it
    assert masks.sum(bias, None) is bias and masks.sum(None, mask) is mask
    other = mask.clone()
    assert masks.sum(bias, other) is not first  # another forward's mask: summed anew
    del bias, first
    gc.collect()
    assert masks._entry is None  # the sum went with the forward's bias


def test_mpnet_positions_start_after_its_own_padding_index_whatever_the_config_says(tmp_path):
    """transformers' MPNetEmbeddings numbers positions from 2 (its padding index is always 1):
    with ``pad_token_id: 0`` in config.json, 16 position embeddings still hold 14 tokens; the
    longest input equals transformers', the next one is refused (never an IndexError)."""
    from poolrunner import Runtime
    from poolrunner.core.errors import PromptTooLongError
    from tests.test_attention_rules import _folder

    config = transformers.MPNetConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=16, pad_token_id=0,
                                      architectures=["MPNetModel"])
    folder = _folder(config, tmp_path)
    runtime = Runtime(folder, dtype="float32", pooling_type="MEAN", load_entrypoints=False)
    assert runtime.model_config.max_model_len == 14
    ids = list(range(5, 19))
    with torch.inference_mode():
        expected = transformers.MPNetModel.from_pretrained(folder).eval()(torch.tensor([ids])).last_hidden_state
    torch.testing.assert_close(torch.from_numpy(runtime.embed([ids], normalize=False)[0]),
                               expected[0].mean(0), rtol=1e-5, atol=1e-6)
    with pytest.raises(PromptTooLongError, match="input 0 has 15 tokens, more than the maximum of 14"):
        runtime.embed([[*ids, 20]])
    assert runtime.embed([ids]).shape == (1, 32)
