"""poolrunner's CPU kernels against torch and transformers: packed attention in float64, RMSNorm.

The kernel (``core/kernels/packed_attention.cpp``) attends every request of a packed step in one
call. Each request must get what torch's scaled_dot_product_attention gives it alone, no further
from the float64 truth than torch's own SDPA in the same dtype: both compute in float32 and
round the output once.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from poolrunner import Runtime
from poolrunner.core.kernels import cpu_kernels
from poolrunner.core.kernels.attention import (
    LAYOUT_KWARG,
    LONG_ROWS,
    TILE_ROWS,
    MaskRule,
    PackedLayout,
    packed_attention,
)
from tests.helpers import ModelSpy, pretend_amx
from tests.models.architectures import FAMILIES, Row, build_folder, load_reference, reference_output

SUPPORTED = cpu_kernels.supported_dtypes()
pytestmark = pytest.mark.skipif(not SUPPORTED, reason="the kernel needs an x86 CPU with AVX2 and a C++ compiler")
DTYPES = [pytest.param(dtype, marks=pytest.mark.skipif(dtype not in SUPPORTED, reason=f"no {dtype} kernel here"))
          for dtype in (torch.float32, torch.bfloat16)]

# The kernel's paths: float32 and bfloat16 on the vector units, bfloat16 on AMX tiles.
PATHS = [*(pytest.param(dtype, False, id=f"{dtype}".removeprefix("torch.") + "-vector", marks=param.marks)
           for param in DTYPES for dtype in param.values),
         pytest.param(torch.bfloat16, True, id="bfloat16-tiles",
                      marks=pytest.mark.skipif(not cpu_kernels.has_tiles(), reason="no AMX tiles here"))]

# Lengths around the kernel's blocks: 16 keys per vector, 4 query rows per micro-kernel, 256
# query rows per work item; on tiles 16 query rows and keys per block, 32 keys per step, items
# under 12 keys on the vector units.
LENGTHS = [1, 3, 16, 17, 4, 31, 64, 255, 300, 5]
LONG_LENGTHS = [1300, 513, 512, 1027, 7]


def _packed(lengths: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype, extra_rows: int = 0):
    """q, k, v as linear layers leave them: ``[num_tokens, heads, dim]`` views of ``[num_tokens, heads * dim]``."""
    torch.manual_seed(0)
    tokens = sum(lengths) + extra_rows
    q = (torch.randn(tokens, heads * dim) * 2).to(dtype).view(tokens, heads, dim)
    k = (torch.randn(tokens, kv_heads * dim) * 2).to(dtype).view(tokens, kv_heads, dim)
    v = torch.randn(tokens, kv_heads * dim).to(dtype).view(tokens, kv_heads, dim)
    return q, k, v


def _band(length: int, window: tuple[int, int]) -> torch.Tensor:
    """The dense ``[length, length]`` mask of a kernel ``window`` (query i sees i - before .. i + after)."""
    rows = torch.arange(length)
    offset = rows[None] - rows[:, None]  # key - query
    before, after = window
    return ((offset >= -before) | (before < 0)) & ((offset <= after) | (after < 0))


def _reference(q, k, v, lengths, causal, dtype):
    """Each request alone through torch's SDPA, in ``dtype`` and in float64; ``causal`` a bool
    or a kernel window (a dense mask)."""
    outputs = {dtype: [], torch.float64: []}
    start = 0
    for length in lengths:
        alone = [t[start : start + length].transpose(0, 1) for t in (q, k, v)]
        gqa = q.shape[1] != k.shape[1]
        mask = _band(length, causal) if isinstance(causal, tuple) else None
        for kind in outputs:
            out = F.scaled_dot_product_attention(*(t.to(kind) for t in alone), is_causal=causal is True,
                                                 attn_mask=mask, enable_gqa=gqa)
            outputs[kind].append(out.transpose(0, 1))
        start += length
    return torch.cat(outputs[dtype]), torch.cat(outputs[torch.float64])


def _run_kernel(q, k, v, lengths, causal, scale, tiles=False):
    out = torch.full_like(q, 7.0)
    starts = torch.tensor([sum(lengths[:i]) for i in range(len(lengths))])
    window = cpu_kernels.CAUSAL if causal is True else cpu_kernels.FULL if causal is False else causal
    cpu_kernels.attend(q, k, v, out, starts, torch.tensor(lengths), window, scale, tiles)
    return out


@pytest.mark.parametrize(("dtype", "tiles"), PATHS)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 32), (6, 2, 64), (2, 2, 80), (2, 1, 128)])
def test_each_request_gets_what_torch_gives_it_alone(dtype, tiles, causal, heads, kv_heads, dim):
    _assert_as_close_as_torch(LENGTHS, dtype, causal, heads, kv_heads, dim, tiles=tiles)


@pytest.mark.parametrize(("dtype", "tiles"), PATHS)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(6, 2, 64), (2, 1, 128)])
def test_long_requests_get_what_torch_gives_them_alone(dtype, tiles, causal, heads, kv_heads, dim):
    """Requests past 512 tokens (and past a work item's 256 query rows): float32 sums of 1,300
    keys in another order than torch's flash kernel, mean error within 1.2x of its."""
    _assert_as_close_as_torch(LONG_LENGTHS, dtype, causal, heads, kv_heads, dim, float32_mean=1.2, tiles=tiles)


@pytest.mark.parametrize(("dtype", "tiles"), PATHS)
@pytest.mark.parametrize("window", [(64, 64), (3, 3), (15, 0), (0, 0), (100, 5), (-1, 30), (40, -1)])
def test_sliding_windows_get_what_torch_gives_them_alone(dtype, tiles, window):
    """Query i sees keys i - before .. i + after: ModernBERT's (64, 64), Mistral's (w - 1, 0),
    a key alone, lopsided windows, and windows bounded on one side only."""
    _assert_as_close_as_torch(LENGTHS + [1300, 600], dtype, window, 6, 2, 64, float32_mean=1.2, tiles=tiles)


def _assert_as_close_as_torch(lengths, dtype, causal, heads, kv_heads, dim, float32_mean=1.1, tiles=False):
    q, k, v = _packed(lengths, heads, kv_heads, dim, dtype, extra_rows=3)
    out = _run_kernel(q, k, v, lengths, causal, dim**-0.5, tiles)
    tokens = sum(lengths)
    torch_out, truth = _reference(q, k, v, lengths, causal, dtype)
    ours = (out[:tokens].double() - truth).abs()
    theirs = (torch_out.double() - truth).abs()
    # float32: the same rounding, summed in another order (the largest error ~7e-6 on outputs
    # of ~1, from scores of ~20); bfloat16: the output's rounding dominates both.
    worst, mean = (1.5, float32_mean) if dtype == torch.float32 else (1.05, 1.05)
    assert ours.max() <= theirs.max() * worst, (ours.max(), theirs.max())
    assert ours.mean() <= theirs.mean() * mean, (ours.mean(), theirs.mean())
    assert torch.equal(out[tokens:], torch.full_like(out[tokens:], 7.0))  # rows of no request: untouched


@pytest.mark.parametrize(("dtype", "tiles"), PATHS)
def test_a_custom_scale_is_applied(dtype, tiles):
    """The scale multiplies the scores (on tiles: inside the exponent's FMA), here 0.05 and 0.4
    against head_dim ** -0.5 = 0.18, to float32 rounding of scores of tens (bfloat16: the output's)."""
    lengths = [9, 12, 40]
    q, k, v = _packed(lengths, 2, 2, 32, dtype)
    for scale in (0.05, 0.4):
        out = _run_kernel(q, k, v, lengths, False, scale, tiles)
        expected = torch.cat([
            F.scaled_dot_product_attention(*(t[s:e].transpose(0, 1).double() for t in (q, k, v)),
                                           scale=scale).transpose(0, 1)
            for s, e in [(0, 9), (9, 21), (21, 61)]
        ])
        tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-8, "atol": 1e-5}
        torch.testing.assert_close(out.double(), expected, **tolerance)


@pytest.mark.parametrize(("change", "message"), [
    (lambda q, k, v, out: (q.half(), k.half(), v.half(), out.half()), "packed_attention takes bfloat16 or float32"),
    (lambda q, k, v, out: (q[..., :24], k[..., :24], v[..., :24], out[..., :24].contiguous()),
     "head_dim must be a multiple of 16"),
    (lambda q, k, v, out: (q, k[:, :3], v[:, :3], out), "query heads must be a multiple of kv heads"),
])
def test_inputs_it_does_not_take_are_refused_by_name(change, message):
    q, k, v = _packed([5], 4, 4, 32, torch.float32)
    args = change(q, k, v, torch.empty_like(q))
    with pytest.raises(RuntimeError, match=message):
        cpu_kernels.attend(*args, torch.tensor([0]), torch.tensor([5]), cpu_kernels.FULL, 0.1)
    out = _run_kernel(q, k, v, [5], False, 32**-0.5)  # and the next call is served
    torch.testing.assert_close(out.double(), _reference(q, k, v, [5], False, torch.float32)[1], rtol=1e-5, atol=2e-6)


def test_a_request_spanning_tokens_outside_q_is_refused():
    q, k, v = _packed([5], 2, 2, 32, torch.float32)
    with pytest.raises(RuntimeError, match="request 0 spans tokens outside q"):
        cpu_kernels.attend(q, k, v, torch.empty_like(q), torch.tensor([2]), torch.tensor([5]), cpu_kernels.FULL, 0.1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_packed_attention_function_sends_windows_to_it_and_other_masks_to_sdpa(dtype, monkeypatch):
    """A sliding window (Mistral's: a key at most 7 before the query) attends in the kernel with
    its window (causal for the requests it does not cut); a mask that is no window (keys of even
    distance) on torch's SDPA with that mask."""
    lengths = [6, 6, 20]
    windows: list[tuple[int, int]] = []
    attend = cpu_kernels.attend
    monkeypatch.setattr(cpu_kernels, "attend", lambda *args: windows.append(args[6]) or attend(*args))

    def sliding(_b, _h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 8)

    def even(_b, _h, q_idx, kv_idx):
        return (q_idx - kv_idx) % 2 == 0

    q, k, v = _packed(lengths, 2, 2, 32, dtype)
    as_transformers = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # [1, heads, tokens, dim]
    rows = torch.arange(max(lengths))
    dense = {sliding: (rows[None] <= rows[:, None]) & (rows[:, None] - rows[None] < 8),
             even: (rows[:, None] - rows[None]) % 2 == 0}
    for function, kernel_windows in ((sliding, [cpu_kernels.CAUSAL, (7, 0)]), (even, [])):
        windows.clear()
        with torch.inference_mode():
            out, _ = packed_attention(torch.nn.Identity(), *as_transformers, MaskRule(function, False),
                                      **{LAYOUT_KWARG: PackedLayout.build(lengths, native=True)})
        assert windows == kernel_windows
        start = 0
        for length in lengths:
            alone = [t[start : start + length].transpose(0, 1).double() for t in (q, k, v)]
            mask = dense[function][:length, :length]
            expected = F.scaled_dot_product_attention(*alone, attn_mask=mask).transpose(0, 1)
            tolerance = {"rtol": 1e-5, "atol": 2e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
            torch.testing.assert_close(out[0, start : start + length].double(), expected, **tolerance)
            start += length


@pytest.mark.parametrize("native", [True, False])
def test_long_requests_attend_in_tiles_without_a_whole_mask(native):
    """Past LONG_ROWS tokens a sliding-window layer (ModernBERT's local layers: keys within 64
    positions either side) attends in tiles of query rows over the keys they see, a full layer
    whole, and no [length, length] mask is built; both equal SDPA over the whole request with
    its dense mask (float64)."""
    length = LONG_ROWS + 300
    lengths = [length, 7]
    q, k, v = _packed(lengths, 2, 2, 32, torch.float32)

    def local(_b, _h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 64

    def everything(_b, _h, q_idx, kv_idx):
        return q_idx >= 0

    rows = torch.arange(length)
    masks = {local: (rows[:, None] - rows[None]).abs() <= 64, everything: None}
    as_transformers = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    for function, dense in masks.items():
        rule = MaskRule(function, False)
        with torch.inference_mode():
            out, _ = packed_attention(torch.nn.Identity(), *as_transformers, rule,
                                      **{LAYOUT_KWARG: PackedLayout.build(lengths, native=native)})
        alone = [t[:length].transpose(0, 1).double() for t in (q, k, v)]
        expected = F.scaled_dot_product_attention(*alone, attn_mask=dense).transpose(0, 1)
        torch.testing.assert_close(out[0, :length].double(), expected, rtol=1e-5, atol=1e-5)  # fp32 sums of 1,324 keys
        assert all(key[1] <= LONG_ROWS for key in rule._blocks), "a whole mask of the long request was built"


def test_the_tiles_of_a_long_request_are_built_once_per_step(monkeypatch):
    """Every local layer of a step shares one rule (transformers builds each mask once per
    forward): the second layer reuses the first's tiles and gets the same answer."""
    length = LONG_ROWS + 300
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in _packed([length], 2, 2, 32, torch.float32))
    rule = MaskRule(lambda _b, _h, q_idx, kv_idx: (q_idx - kv_idx).abs() <= 64, False)
    reads: list[int] = []
    rows = MaskRule.rows
    monkeypatch.setattr(MaskRule, "rows", lambda self, *args: reads.append(args[0]) or rows(self, *args))
    layout = PackedLayout.build([length])
    with torch.inference_mode():
        first, _ = packed_attention(torch.nn.Identity(), q, k, v, rule, **{LAYOUT_KWARG: layout})
        built = len(reads)
        second, _ = packed_attention(torch.nn.Identity(), q, k, v, rule, **{LAYOUT_KWARG: layout})
    assert built == 1 + -(-length // TILE_ROWS)  # one tile read to classify the mask, then each tile once
    assert len(reads) == built and torch.equal(first, second)


def test_a_modernbert_request_past_long_rows_equals_transformers(tmp_path):
    """End to end on a seeded ModernBERT (local layers over a window of 8, every other layer
    global): a request of LONG_ROWS + 276 tokens, its local layers in tiles, gives transformers'
    own hidden states (eager attention, the request alone)."""
    family = next(family for family in FAMILIES if family.id == "modernbert-mean")
    row = Row(dataclasses.replace(family, config={**family.config, "max_position_embeddings": 1536}), "model")
    folder = build_folder(row, tmp_path / "modernbert")
    ids = [1, *torch.randint(5, 200, (LONG_ROWS + 274,), generator=torch.Generator().manual_seed(0)).tolist(), 2]
    got = Runtime(str(folder), dtype="float32", load_entrypoints=False).encode([ids], task="token_embed")[0]
    expected = reference_output(load_reference(row, folder), ids)
    np.testing.assert_allclose(got, expected, atol=1e-4)


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_requests_past_the_kernels_key_limit_go_to_sdpa_and_equal_it(dtype, amx, monkeypatch):
    """The kernel keeps full requests up to kernel_keys tokens (float32: its build's float32_keys;
    with AMX, in either dtype, AMX_KEY_ELEMENTS // head_dim) and causal ones up to twice that;
    longer ones go to SDPA (faster there). Either way the output equals SDPA over each request
    alone (float64)."""
    pretend_amx(monkeypatch, amx)
    limit = cpu_kernels.kernel_keys(dtype, 16)
    if amx:  # 160 keys, below every build's float32 limit
        assert limit == cpu_kernels.AMX_KEY_ELEMENTS // 16
    full = min(limit, 1024)
    lengths = [2 * full + 40, full + 40, full, 9]
    q, k, v = _packed(lengths, 2, 1, 16, dtype)
    kernel_lengths: list[int] = []
    attend = cpu_kernels.attend

    def recording(*args):
        kernel_lengths.extend(args[5].tolist())
        attend(*args)

    monkeypatch.setattr(cpu_kernels, "attend", recording)

    def everything(_b, _h, q_idx, kv_idx):
        return q_idx >= 0

    def earlier(_b, _h, q_idx, kv_idx):
        return kv_idx <= q_idx

    as_transformers = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    for function, is_causal, seen in ((everything, False, lambda n: n), (earlier, True, lambda n: n // 2)):
        kernel_lengths.clear()
        with torch.inference_mode():
            out, _ = packed_attention(torch.nn.Identity(), *as_transformers, MaskRule(function, False),
                                      **{LAYOUT_KWARG: PackedLayout.build(lengths, native=True)})
        assert sorted(kernel_lengths) == sorted(n for n in lengths if seen(n) <= limit)
        start = 0
        for length in lengths:
            alone = [t[start : start + length].transpose(0, 1).double() for t in (q, k, v)]
            expected = F.scaled_dot_product_attention(*alone, is_causal=is_causal, enable_gqa=True).transpose(0, 1)
            tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
            torch.testing.assert_close(out[0, start : start + length].double(), expected, **tolerance)
            start += length


@pytest.mark.skipif(not cpu_kernels.has_tiles(), reason="no AMX tiles here")
def test_on_tiles_bfloat16_rows_go_to_sdpa_past_tile_keys():
    """With bf16 on tiles the kernel keeps rows up to TILE_KEYS keys (heads a multiple of 32);
    float32 and other heads keep AMX's SDPA limit; sliding windows have none."""
    assert cpu_kernels.kernel_keys(torch.bfloat16, 32) == cpu_kernels.kernel_keys(torch.bfloat16, 64) == 256
    assert cpu_kernels.kernel_keys(torch.bfloat16, 16) == cpu_kernels.AMX_KEY_ELEMENTS // 16
    assert cpu_kernels.kernel_keys(torch.float32, 32) == cpu_kernels.AMX_KEY_ELEMENTS // 32
    assert cpu_kernels.kernel_keys(torch.bfloat16, 32, banded=True) == sys.maxsize


@pytest.mark.parametrize("dtype", DTYPES)
def test_queries_whose_head_dim_is_strided_are_copied_for_it(dtype):
    """A layer may hand over head_dim-strided views (the kernel reads head_dim contiguous)."""
    lengths = [5, 5, 9]
    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), 32, 2).to(dtype).transpose(1, 2) for _ in range(3))  # [tokens, 2, 32]
    assert q.stride(-1) != 1
    layout = PackedLayout.build(lengths, native=True)

    def bidirectional(_b, _h, q_idx, kv_idx):
        return q_idx >= 0

    as_transformers = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    with torch.inference_mode():
        out, _ = packed_attention(torch.nn.Identity(), *as_transformers, MaskRule(bidirectional, False),
                                  **{LAYOUT_KWARG: layout})
    torch_out, truth = _reference(q, k, v, lengths, False, dtype)
    assert (out[0].double() - truth).abs().max() <= (torch_out.double() - truth).abs().max() * 1.5


@pytest.mark.parametrize("family", ["llama", "t5", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 40, 7])
def test_rms_norm_computes_what_the_rms_norm_module_computes(hidden, dtype, family):
    """The same roundings as the module (Llama's and T5's: x * scale rounded, then times the
    weight; Gemma's: times (1 + weight) in float32, rounded once); only the order of the sum of
    squares differs."""
    import importlib

    from poolrunner.core.kernels.fused_norms import FusedRMSNorm

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    torch.manual_seed(0)
    name = "T5LayerNorm" if family == "t5" else f"{family.capitalize()}RMSNorm"
    norm = getattr(module, name)(hidden, eps=1e-5)
    norm.weight.data = torch.rand(hidden) + (0.5 if family == "llama" else -0.5)  # Gemma's: an offset from 1
    norm = norm.to(dtype)
    x = (torch.randn(3, 300, hidden) * 3).to(dtype)
    other = torch.float64  # another dtype than the weight's: the module's code
    with torch.inference_mode():
        expected, got = norm(x), FusedRMSNorm(norm)(x)
        assert torch.equal(FusedRMSNorm(norm)(x.to(other)), norm(x.to(other)))
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:  # the sum's order moves the scale by an ulp; with the two products' roundings,
        torch.testing.assert_close(got, expected, rtol=4 * 2**-23, atol=0)  # within 4 ulps
        return
    assert (got == expected).float().mean() >= 0.99
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=0)  # at most one bf16 rounding step


def test_only_rms_norms_of_known_code_in_a_kernel_dtype_are_replaced():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from poolrunner.core.kernels.fused_norms import FusedRMSNorm, fuse_rms_norms

    model = torch.nn.ModuleDict({
        "llama": LlamaRMSNorm(16), "gemma": GemmaRMSNorm(16), "gemma3n": Gemma3nRMSNorm(16),
        "fp16": LlamaRMSNorm(16).half(),
    })
    assert fuse_rms_norms(model, {torch.float32}) == 2
    assert [type(m) for m in model.values()] == [FusedRMSNorm, FusedRMSNorm, Gemma3nRMSNorm, LlamaRMSNorm]
    assert [m.unit_offset for m in list(model.values())[:2]] == [False, True]


@pytest.mark.parametrize("family", ["Llama", "Gemma3Text"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decoder_on_the_fast_path_runs_its_norms_in_the_kernel(tmp_path, dtype, family):
    """Llama's norms (2 a layer and the last), and Gemma 3's (EmbeddingGemma's bidirectional
    layers: 4 a layer, the queries' and keys', the last)."""
    import transformers

    from poolrunner.core.kernels.fused_norms import FusedRMSNorm
    from tests.test_attention_rules import _DECODER, _folder

    extra = {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 4,
             "use_bidirectional_attention": True} if family == "Gemma3Text" else {}
    config = getattr(transformers, f"{family}Config")(**_DECODER, **extra, architectures=[f"{family}Model"])
    folder = _folder(config, tmp_path)
    fast_model, eager_model = ModelSpy(), ModelSpy()  # the backbones as loaded, norms fused
    name = str(dtype).removeprefix("torch.")
    kwargs = {"dtype": name, "load_entrypoints": False, "pooling_type": "MEAN"}
    fast = Runtime(folder, **kwargs, plugins=[fast_model])
    eager = Runtime(folder, **kwargs, compile="off", plugins=[eager_model])
    norms = 2 * (2 if family == "Llama" else 6) + 1
    assert sum(type(m) is FusedRMSNorm for m in fast_model.model.base_model.modules()) == norms
    assert not any(type(m) is FusedRMSNorm for m in eager_model.model.base_model.modules())
    texts = ["a b c d", "b c", "a b c d e f g h i j k"]
    cosine = (fast.embed(texts) * eager.embed(texts)).sum(-1) / (
        np.linalg.norm(fast.embed(texts), axis=-1) * np.linalg.norm(eager.embed(texts), axis=-1))
    assert cosine.min() > (0.999 if dtype == torch.bfloat16 else 0.999999)


@pytest.mark.parametrize("family", ["llama", "modernbert"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("batch", "angle_batch", "tokens", "heads", "head_dim"),
                         [(1, 1, 300, 9, 64), (2, 1, 17, 3, 128), (2, 2, 5, 2, 10)])
def test_rotary_computes_what_apply_rotary_pos_emb_computes(dtype, batch, angle_batch, tokens, heads, head_dim,
                                                            family):
    """Bit for bit: Llama's formula (products and sum each rounded to the dtype) and ModernBERT's
    (float32 throughout, rounded once: ``round_once``), on the strided [batch, heads, tokens, d]
    view transformers hands over, tails of the vector width included."""
    import importlib

    formula = importlib.import_module(f"transformers.models.{family}.modeling_{family}").apply_rotary_pos_emb
    torch.manual_seed(0)
    q = (torch.randn(batch, tokens, heads, head_dim) * 3).to(dtype).transpose(1, 2)
    k = (torch.randn(batch, tokens, 1, head_dim) * 3).to(dtype).transpose(1, 2)
    angles = torch.randn(angle_batch, tokens, head_dim // 2) * 40
    cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype) for f in (torch.cos, torch.sin))
    expected = formula(q, k, cos, sin)
    round_once = family == "modernbert"
    got = cpu_kernels.rotary(q, cos, sin, round_once), cpu_kernels.rotary(k, cos, sin, round_once)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert got[0].stride() == q.stride()


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_layers_of_llamas_rotary_rotate_in_the_kernel_with_the_same_output(dtype):
    """Llama's apply_rotary_pos_emb and its copies (Qwen3, Mistral; Phi's partial rotary on its
    rotary slice, StableLM's) run in the kernel, each layer's forward otherwise transformers' own
    code: the backbone's output is bit for bit the same. Other rotaries (GPT-NeoX's, Cohere's
    interleaved, OLMo2's) keep theirs, and transformers' module globals stay as they were."""
    import transformers
    from transformers.models.llama import modeling_llama

    from poolrunner.core.kernels.fused_rotary import fuse_rotary

    original = modeling_llama.apply_rotary_pos_emb
    shape = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "pad_token_id": 0}
    ids = torch.randint(1, 64, (1, 23), generator=torch.Generator().manual_seed(0))
    # Llama's, Qwen3's, Mistral's and Phi's come wrapped by the kernels package (a hub hook),
    # StableLM's as the plain function: both forms are read through to the code.
    modernbert = {"global_attn_every_n_layers": 2, "local_attention": 8, "bos_token_id": 1, "eos_token_id": 2,
                  "cls_token_id": 1, "sep_token_id": 2, "num_hidden_layers": 3}
    for family, layers in (("Llama", 2), ("Qwen3", 2), ("Mistral", 2), ("Phi", 2), ("StableLm", 2),
                           ("ModernBert", 3), ("GPTNeoX", 0), ("Cohere", 0), ("Olmo2", 0)):
        torch.manual_seed(0)
        config = {**shape, **(modernbert if family == "ModernBert" else {})}
        model = getattr(transformers, f"{family}Model")(getattr(transformers, f"{family}Config")(**config))
        model = model.to(dtype).eval()
        with torch.inference_mode():
            expected = model(ids).last_hidden_state
            assert fuse_rotary(model, SUPPORTED) == layers, family
            assert torch.equal(model(ids).last_hidden_state, expected), family
    assert modeling_llama.apply_rotary_pos_emb is original
