"""DeBERTa-v2 / v3: its disentangled attention with the bias in one pass and SDPA
(``core/kernels/fused_deberta.py``, ``relative_bias.cpp``) against transformers' own eager code
and the same model in float64."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from poolrunner.core.kernels import cpu_kernels
from poolrunner.core.kernels.fused_deberta import fuse_deberta_attention

LAYOUTS = {
    # DeBERTa-v3's (deberta-v3-*, mxbai-rerank-*-v1): shared keys, both terms, log buckets past 4 apart
    "v3": {"share_att_key": True, "pos_att_type": ["p2c", "c2p"], "position_buckets": 8},
    # DeBERTa-v2's own position projections, c2p alone
    "c2p": {"share_att_key": False, "pos_att_type": ["c2p"], "position_buckets": 8},
    # no buckets, 6 positions either side: pairs further apart clamped to the last
    "clamped": {"share_att_key": False, "pos_att_type": ["p2c", "c2p"], "max_relative_positions": 6},
    "absolute": {"relative_attention": False, "position_biased_input": True},
}


def _models(layout: dict, dtype: torch.dtype) -> tuple[transformers.DebertaV2Model, transformers.DebertaV2Model]:
    """A seeded 3-layer DeBERTa-v2 with ``layout`` in ``dtype``, and its float64 copy (the same
    weights, as ``dtype`` rounded them: the difference is the computation's alone)."""
    config = transformers.DebertaV2Config(**{
        "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "intermediate_size": 96, "max_position_embeddings": 64, "type_vocab_size": 0, "relative_attention": True,
        "position_biased_input": False, "norm_rel_ebd": "layer_norm", **layout})
    torch.manual_seed(0)
    model = transformers.DebertaV2Model(config).eval().to(dtype)
    return model, copy.deepcopy(model).double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_deberta_attention_fused_computes_what_the_eager_code_computes(layout, dtype):
    """Padded and unpadded inputs of 20 tokens (log buckets and the clamp reached): float32 equal
    to the eager code to rounding, bfloat16 no further from float64; the kernel's bias and torch's
    identical; the attention probabilities still the module's own."""
    model, exact = _models(layout, dtype)
    ids = torch.randint(5, 100, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[0, 13:] = mask[2, 4:] = 0
    valid = mask.bool()
    on_torch = copy.deepcopy(model)
    with torch.inference_mode():
        eager = model(ids, attention_mask=mask).last_hidden_state
        probabilities = model(ids, attention_mask=mask, output_attentions=True).attentions
        reference = exact(ids, attention_mask=mask).last_hidden_state
        assert fuse_deberta_attention(model, cpu_kernels.supported_dtypes()) == 3
        assert fuse_deberta_attention(on_torch) == 3
        fused = model(ids, attention_mask=mask).last_hidden_state
        assert torch.equal(on_torch(ids, attention_mask=mask).last_hidden_state, fused)
        assert all(torch.equal(a, b) for a, b in zip(
            model(ids, attention_mask=mask, output_attentions=True).attentions, probabilities, strict=True))
    assert fused.dtype == dtype
    error, own_error = ((t.double() - reference)[valid].abs().max() for t in (fused, eager))
    if dtype == torch.float32:
        torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)  # padding rows too: they attend as there
    assert error <= 1.05 * own_error + 1e-6, (error, own_error)


@pytest.mark.skipif(not cpu_kernels.supported_dtypes(), reason="poolrunner's CPU kernels cannot be built here")
def test_the_bias_kernel_refuses_an_index_past_the_positions():
    rows = torch.zeros(2, 3, 5)
    index, mask = torch.full((3, 3), 5), torch.ones(1, 3, 3, dtype=torch.bool)
    with pytest.raises(RuntimeError, match=r"index must lie in \[0, positions\)"):
        cpu_kernels.relative_bias(rows, None, index, mask)
    index[:] = 4
    assert torch.equal(cpu_kernels.relative_bias(rows, rows + 1, index, mask), torch.ones(2, 3, 3))
