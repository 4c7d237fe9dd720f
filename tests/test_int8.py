"""``dtype="int8"``: the quantization kernels against torch, int8 linear layers against float
arithmetic, and the load-time bar against transformers and sentence-transformers.

The kernels (``core/kernels/int8_linear.cpp``) must compute the formulas their header states: the
quantization bit for bit as torch computes them, the conversion back as float64 does, to float32
rounding. The load keeps the layers whose int8 error the model cannot afford in bfloat16, so that
the real models here (all-MiniLM-L6-v2, SmolLM2-135M) stay within cosine 0.999 of float32
sentence-transformers / transformers on 100 Lee sentences the probe never saw, and refuses a
model that misses the bar even so.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import poolrunner
from poolrunner.core import precision
from poolrunner.core.block_replay import BlockReplay, block_of
from poolrunner.core.errors import ModelLoadError
from poolrunner.core.kernels import cpu_kernels, int8, onednn
from tests.helpers import ModelSpy, cosine_rows, pretend_amx
from tests.models import architectures

LEE_SENTENCES = 100

pytestmark = pytest.mark.skipif(
    torch.bfloat16 not in cpu_kernels.supported_dtypes(),
    reason="int8 needs poolrunner's kernels on an x86 CPU with AVX512-BF16 (or AMX) and a C++ compiler",
)


def _rotated_by_torch(y: torch.Tensor, block: int) -> torch.Tensor:
    """``y`` times the block-diagonal unnormalized Hadamard matrix, by the kernel's butterflies in
    its order (strides ``block / 2`` down to 1), so that float32 rounds as it does there."""
    rows, width = y.shape
    for stride in (block >> i for i in range(1, block.bit_length())):
        pairs = y.reshape(rows, width // (2 * stride), 2, stride)
        y = torch.stack([pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]], 2).reshape(rows, width)
    return y


def _quantized_by_torch(x: torch.Tensor, inv_smooth: torch.Tensor, block: int = 0):
    """The header's formulas, in torch: ``(q, scale, offset)``."""
    y = x.float() * inv_smooth
    if block:
        y = _rotated_by_torch(y, block)
    lo, hi = y.amin(1).clamp_max(0), y.amax(1).clamp_min(0)
    step = (hi - lo) / 255
    step = torch.where(step > 0, step, torch.ones_like(step))
    inverse = 1 / step
    zero = torch.round(-lo * inverse)
    q = (torch.round(y * inverse[:, None]) + zero[:, None]).clamp(0, 255) - 128
    return q.to(torch.int8), step, (128 - zero).to(torch.int32)


def _quantize(x: torch.Tensor, inv_smooth: torch.Tensor, block: int = 0):
    q = torch.empty(x.shape, dtype=torch.int8)
    scale, offset = torch.empty(len(x)), torch.empty(len(x), dtype=torch.int32)
    cpu_kernels.quantize_rows(x, inv_smooth, q, scale, offset, block)
    return q, scale, offset


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width"), [(1, 16), (7, 33), (300, 384), (5, 1536), (3, 1)])
def test_rows_are_quantized_as_torch_computes_the_formulas(dtype, rows, width):
    torch.manual_seed(0)
    x = (torch.randn(rows, width) * 3).to(dtype)
    x[0] = 0  # an all-zero row: its zero point, scale 1
    if rows > 2:
        x[1] = x[1].abs()  # all positive: the range starts at 0
        x[2] = -x[2].abs()
    inv_smooth = torch.rand(width) + 0.5
    got = _quantize(x, inv_smooth)
    for g, expected in zip(got, _quantized_by_torch(x, inv_smooth), strict=True):
        assert torch.equal(g, expected)
    assert got[1][0] == 1 and got[2][0] == 128


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width", "block"), [(1, 16, 16), (7, 96, 32), (300, 384, 128), (5, 1536, 128),
                                                      (3, 576, 64)])
def test_rotated_rows_are_quantized_as_torch_computes_the_formulas(dtype, rows, width, block):
    torch.manual_seed(0)
    x = (torch.randn(rows, width) * 3).to(dtype)
    x[0, 3] = 400.0  # one large value: the rotation spreads it over its block
    inv_smooth = torch.rand(width) + 0.5
    got = _quantize(x, inv_smooth, block)
    for g, expected in zip(got, _quantized_by_torch(x, inv_smooth, block), strict=True):
        assert torch.equal(g, expected)
    rotated = (x.double() * inv_smooth.double()).reshape(rows, -1, block) @ cpu_kernels.hadamard(block).double()
    q, scale, offset = got
    dequantized = (q.double() + offset.double()[:, None]) * scale.double()[:, None]
    assert (dequantized - rotated.reshape(rows, width)).abs().max() <= scale.max() / 2 * (1 + 1e-5)


def test_a_rotation_spreads_a_tokens_outlier_so_its_other_values_keep_their_precision():
    torch.manual_seed(1)
    x = torch.randn(64, 384)
    x[:, 7] = 300.0
    ones = torch.ones(384)
    errors = []
    for block in (0, 128):
        q, scale, offset = _quantize(x, ones / (block ** 0.5 if block else 1), block)
        values = (q.float() + offset[:, None]) * scale[:, None]
        back = values.reshape(64, -1, block) @ (cpu_kernels.hadamard(block) / block ** 0.5) if block else values
        errors.append(float((back.reshape(64, 384) - x).norm() / x.norm()))
    assert errors[1] < errors[0] / 4, errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_products_are_converted_back_as_float64_computes_them(dtype, bias):
    torch.manual_seed(1)
    rows, width, out_features = 37, 70, 45
    q, scale, offset = _quantize(torch.randn(rows, width).to(dtype), torch.rand(width) + 0.5)
    weight = torch.randint(-127, 128, (out_features, width), dtype=torch.int8)
    acc = torch._int_mm(q, weight.t())
    col_scale, col_sum = torch.rand(out_features) * 1e-3, weight.sum(1, dtype=torch.int32)
    b = torch.randn(out_features) if bias else torch.empty(0)
    out = torch.empty(rows, out_features, dtype=dtype)
    cpu_kernels.dequantize_rows(acc, scale, offset, col_scale, col_sum, b, out)
    # (q + 128 - zero) @ w.T, from the int8 values, in float64
    levels = q.double() + offset.double()[:, None]
    expected = (levels @ weight.double().t()) * scale.double()[:, None] * col_scale.double()
    expected = expected + (b.double() if bias else 0)
    if dtype == torch.bfloat16:
        assert torch.equal(out, expected.to(dtype))
    else:
        torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)  # float32 sums of terms ~1


EXACT_ACTIVATIONS = {  # in float64, written where they lose no digits: GELU's left tail without 1 + erf
    ("gelu", "none"): lambda x: x / 2 * torch.special.erfc(-x / math.sqrt(2)),
    ("gelu", "tanh"): lambda x: x * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)),
    ("relu", ""): F.relu,
    ("swish", ""): F.silu,
}
TORCH_ACTIVATIONS = {("gelu", "none"): F.gelu, ("gelu", "tanh"): lambda x: F.gelu(x, approximate="tanh"),
                     ("relu", ""): F.relu, ("swish", ""): F.silu}


def _conversion(activation: int, other: torch.Tensor | None = None) -> torch.Tensor:
    """A float32 conversion spanning about -9..9 (GELU's tails, SiLU's saturation), with ``activation``."""
    torch.manual_seed(2)
    rows, width, out_features = 40, 64, 300
    q, scale, offset = _quantize(torch.randn(rows, width) * 4, torch.ones(width))
    weight = torch.randint(-127, 128, (out_features, width), dtype=torch.int8)
    col_scale, col_sum = torch.rand(out_features) * 1e-3, weight.sum(1, dtype=torch.int32)
    bias, out = torch.randn(out_features), torch.empty(rows, out_features)
    acc = torch._int_mm(q, weight.t())
    cpu_kernels.dequantize_rows(acc, scale, offset, col_scale, col_sum, bias, out, activation, other)
    return out


@pytest.mark.parametrize("activation", list(EXACT_ACTIVATIONS))
def test_the_conversion_applies_the_activation_within_1e5_relative_of_float64_and_then_the_factor(activation):
    linear = _conversion(0)  # itself checked against float64 above
    got = _conversion(cpu_kernels.ACTIVATIONS[activation])
    expected = EXACT_ACTIVATIONS[activation](linear.double())
    assert linear.min() < -8 and linear.max() > 8
    assert ((got.double() - expected).abs() <= 1e-5 * expected.abs()).all()  # relative, down to GELU's 1e-19 tail
    # and agrees with torch, within what torch's float32 GELU loses where 1 + erf cancels (1e-6)
    torch.testing.assert_close(got, TORCH_ACTIVATIONS[activation](linear), rtol=1e-5, atol=2e-6)
    other = torch.randn(got.shape)
    assert torch.equal(_conversion(cpu_kernels.ACTIVATIONS[activation], other), got * other)  # one float32 multiply


@pytest.mark.parametrize("activation", list(EXACT_ACTIVATIONS))
def test_a_nan_row_stays_nan_through_every_activation(activation):
    layer = int8.Int8Linear(_linear(32, 8), activation)
    int8.calibrate(layer, lambda: layer(torch.randn(4, 32)))
    x = torch.randn(2, 32)
    x[1, 3] = float("nan")
    got = layer(x)
    assert got[1].isnan().all() and torch.isfinite(got[0]).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_row_holding_a_nan_or_an_infinity_comes_out_nan_as_from_the_float_layer(bad):
    layer = int8.Int8Linear(_linear(32, 8))
    int8.calibrate(layer, lambda: layer(torch.randn(4, 32)))
    x = torch.randn(3, 32, dtype=torch.float32)
    x[1, 5] = bad
    got = layer(x.bfloat16())
    assert got[1].isnan().all() and torch.isfinite(got[[0, 2]]).all()
    assert not torch.isfinite(F.linear(x, layer.weight, layer.bias)[1]).all()  # nor is the float layer's row


def test_kernel_inputs_of_the_wrong_kind_are_refused_by_name_and_the_next_call_served():
    x, inv_smooth = torch.randn(4, 32), torch.ones(32)
    with pytest.raises(RuntimeError, match=re.escape("x must be float32 or bfloat16")):
        _quantize(x.double(), inv_smooth)
    with pytest.raises(RuntimeError, match=re.escape("inv_smooth must be float32 [in]")):
        _quantize(x, torch.ones(31))
    refused = re.escape("block must be 0 (no rotation) or a power of two from 16 to 128")
    for block in (8, 24, 64):  # below the vector width, not a power of two, not dividing 32
        with pytest.raises(RuntimeError, match=refused):
            _quantize(x, inv_smooth, block)
    acc = torch.zeros(4, 8, dtype=torch.int32)
    scale, offset = torch.ones(4), torch.zeros(4, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=re.escape("col_sum must be int32 [out]")):
        cpu_kernels.dequantize_rows(acc, scale, offset, torch.ones(8), torch.zeros(8), torch.empty(0),
                                    torch.empty(4, 8))
    q, _, _ = _quantize(x, inv_smooth)
    assert torch.equal(q, _quantized_by_torch(x, inv_smooth)[0])


def _linear(in_features: int, out_features: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


def test_an_int8_layer_computes_the_product_of_its_quantized_operands():
    linear = _linear(96, 40)
    layer = int8.Int8Linear(linear)
    calibration = torch.randn(64, 96) * torch.linspace(0.1, 8, 96)  # outlier channels to smooth
    assert int8.calibrate(layer, lambda: layer(calibration)) == 1
    x = torch.randn(2, 5, 96) * torch.linspace(0.1, 8, 96)
    got = layer(x)
    # float64: the dequantized smoothed input times the dequantized smoothed weight
    inv_smooth, qweight, col_scale, _, _ = layer._quantized
    assert layer.block == 32  # 96 = 3 x 32
    q, scale, offset = _quantized_by_torch(x.reshape(-1, 96), inv_smooth, layer.block)
    x_hat = (q.double() + offset.double()[:, None]) * scale.double()[:, None]
    w_hat = qweight.double() * col_scale.double()[:, None]
    expected = (x_hat @ w_hat.t() + linear.bias.double()).reshape(2, 5, 40)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    # and close to the float layer: int8 rounding only
    assert cosine_rows(got.reshape(-1, 40).detach(), linear(x).reshape(-1, 40).detach()).min() > 0.9999


def test_until_calibrated_an_int8_layer_is_the_float_layer_and_records_its_inputs():
    linear = _linear(24, 8)
    layer = int8.Int8Linear(linear, ("gelu", "none"))
    x = torch.randn(6, 24)
    torch.testing.assert_close(layer(x), F.gelu(linear(x)), rtol=0, atol=0)
    assert torch.equal(layer.input_absmax, x.abs().amax(0))


def test_calibration_forgets_what_ran_before_it():
    layer = int8.Int8Linear(_linear(16, 4))
    layer(torch.full((1, 16), 100.0))
    assert int8.calibrate(layer, lambda: layer(torch.ones(1, 16))) == 1
    assert torch.equal(layer.input_absmax, torch.ones(16))


def test_a_layer_calibration_never_reached_stays_the_float_layer_and_stops_recording():
    model = nn.Sequential(int8.Int8Linear(_linear(16, 4)), int8.Int8Linear(_linear(4, 4, seed=1)))
    assert int8.calibrate(model, lambda: model[0](torch.ones(1, 16))) == 1
    x = torch.randn(3, 4)
    assert torch.equal(model[1](x), F.linear(x, model[1].weight, model[1].bias))
    assert not model[1].input_absmax.any()


def test_an_activation_and_a_gate_are_applied_to_the_int8_product():
    linear = _linear(32, 48, seed=3)
    plain, with_silu = int8.Int8Linear(linear), int8.Int8Linear(linear, ("swish", ""))
    x, gate = torch.randn(9, 32), torch.randn(9, 48)
    for layer in (plain, with_silu):
        int8.calibrate(layer, lambda layer=layer: layer(x))
    torch.testing.assert_close(with_silu(x).double(), F.silu(plain(x).double()), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(with_silu.mul(x, gate).double(), F.silu(plain(x).double()) * gate.double(),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_kept_layer_computes_in_bfloat16_with_its_activation_and_can_return_to_int8(dtype):
    linear = _linear(32, 48, seed=4).to(dtype)
    layer = int8.Int8Linear(linear, ("gelu", "none"))
    x = torch.randn(9, 32).to(dtype)
    int8.calibrate(layer, lambda: layer(x))
    in_int8 = layer(x)
    layer.keep()
    assert not layer.quantized
    got = layer(x)
    # bf16 products (float32 accumulation) over the input's dtype, as bf16-mixed runs them
    bf16 = [t.to(torch.bfloat16).double() for t in (x, linear.weight.detach())]
    expected = F.gelu(F.linear(*bf16, linear.bias.detach().double()))
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=1e-2)
    layer.keep(False)
    assert layer.quantized and torch.equal(layer(x), in_int8)


@pytest.mark.parametrize(("fewest", "most", "expected_calls"), [
    (0, 36, [0]), (1, 36, [0, 1]), (6, 36, [0, 1, 2, 4, 8, 6, 5]), (36, 36, [0, 1, 2, 4, 8, 16, 32, 36, 34, 35]),
    (None, 36, [0, 1, 2, 4, 8, 16, 32, 36]),
])
def test_the_fewest_layers_kept_are_found_by_doubling_then_bisecting(fewest, most, expected_calls):
    calls = []

    def passes(kept):
        calls.append(kept)
        return fewest is not None and kept >= fewest

    assert precision._fewest_passing(passes, most) == fewest
    assert calls == expected_calls


def test_prepacking_for_int8_puts_int8_layers_where_packed_layers_would_be():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    assert onednn.prepack(model, torch.int8) == 2
    assert [type(m) for m in model] == [int8.Int8Linear, nn.ReLU, int8.Int8Linear]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A seeded tiny BERT (the architecture matrix's): its int8 outputs stay within the bar."""
    row = next(r for r in architectures.rows() if r.id == "bert/model")
    folder = architectures.build_folder(row, tmp_path_factory.mktemp("int8") / "bert")
    return folder, architectures.load_reference(row, folder)


AMX_WARNING = ("dtype 'int8' is slower than 'bfloat16' on this CPU (AMX): its products are no faster than "
               "bfloat16's and it adds a quantization and a conversion pass (all-MiniLM-L6-v2: 0.6-0.7x "
               "bfloat16's speed; bench/README.md)")


@pytest.mark.parametrize("amx", [False, True])
def test_a_model_within_the_bar_is_served_in_int8_within_it_on_inputs_the_probe_never_saw(tiny_bert, amx,
                                                                                         monkeypatch, caplog):
    """Served either way; on a CPU with AMX, where bfloat16 is the faster dtype, with a warning saying so."""
    folder, reference = tiny_bert
    spy = ModelSpy()  # the model served, as loaded
    pretend_amx(monkeypatch, amx)
    with caplog.at_level(logging.WARNING, logger="poolrunner.core.loading"):
        runtime = poolrunner.Runtime(str(folder), dtype="int8", pooling_type="MEAN", load_entrypoints=False,
                                     plugins=[spy])
    warned = [r.getMessage() for r in caplog.records if r.name == "poolrunner.core.loading"]
    assert warned == ([AMX_WARNING] if amx else [])
    assert (runtime.precision, runtime.dtype) == ("int8", torch.bfloat16)
    assert sum(isinstance(m, int8.Int8Linear) for m in spy.model.base_model.modules()) == 13
    torch.manual_seed(7)
    inputs = [torch.randint(5, architectures.VOCAB_SIZE, (n,)).tolist() for n in (3, 9, 40, 100)]
    got = runtime.embed(inputs, normalize=False)
    with torch.inference_mode():
        expected = [reference(input_ids=torch.tensor([ids])).last_hidden_state[0].mean(0).numpy() for ids in inputs]
    assert cosine_rows(got, expected).min() >= 0.999


def test_a_cross_encoder_that_misses_the_score_bar_is_refused_naming_the_score_error_and_its_bar(tmp_path,
                                                                                                   monkeypatch):
    """A one-label cross-encoder's scores are held to an absolute bar, and the refusal says so (it
    printed the relative error against the vectors' bar, which the score had passed)."""
    from transformers import AutoConfig, BertForSequenceClassification

    row = next(r for r in architectures.rows() if r.id == "bert/sequence")
    architectures.build_folder(row, tmp_path)  # its tokenizer; the model saved again with one label
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(tmp_path)
    config.num_labels = 1  # its label names go with it
    BertForSequenceClassification(config).save_pretrained(tmp_path)
    monkeypatch.setattr(precision, "MAX_SCORE_ERROR", 1e-12)  # a bar no bfloat16 score holds
    with pytest.raises(ModelLoadError) as error:
        poolrunner.Runtime(str(tmp_path), dtype="int8", load_entrypoints=False)
    found = re.fullmatch(r"dtype 'int8' is refused for this model: on the probe texts, even with all 13 linear layers "
                         r"in bfloat16 over float32 activations, a score is (\S+) away from float32's; the bar for "
                         r"scores is 1e-12 \(absolute\); use dtype 'auto' \(it measures which precision holds the "
                         r"bar\) or 'float32'", str(error.value))
    assert found and float(found.group(1)) > 1e-12, str(error.value)
    served = poolrunner.Runtime(str(tmp_path), dtype="float32", load_entrypoints=False)
    assert served.score("a query", ["a document"]).shape == (1,)


def test_a_model_that_misses_the_bar_even_all_in_bfloat16_is_refused_naming_its_error(tiny_bert, monkeypatch):
    # a bar no bfloat16 model holds (relative error 1e-6) stands in for a model bf16 itself fails
    monkeypatch.setattr(precision, "MAX_INT8_RELATIVE_ERROR", 1e-6)
    with pytest.raises(ModelLoadError) as error:
        poolrunner.Runtime(str(tiny_bert[0]), dtype="int8", pooling_type="MEAN", load_entrypoints=False)
    message = str(error.value)
    found = re.search(r"up to (\d\.\d{4}) away .* cosine (\d\.\d{4})\)", message)
    measured, cosine = float(found.group(1)), float(found.group(2))
    assert 0 < measured < 0.02 and abs(cosine - (1 - measured**2 / 2)) < 1e-4
    assert message == (
        "dtype 'int8' is refused for this model: on the probe texts, even with all 13 linear layers in bfloat16 "
        "over float32 activations, "
        f"its outputs are up to {measured:.4f} away from float32's (relative error; for unit vectors cosine "
        f"{cosine:.4f}); the bar is 0.0000 (cosine 1); use dtype 'auto' (it measures which precision holds the "
        "bar) or 'float32'"
    )
    served = poolrunner.Runtime(str(tiny_bert[0]), dtype="float32", pooling_type="MEAN", load_entrypoints=False)
    assert served.embed(["next"]).shape == (1, 64)


@pytest.mark.parametrize(("row_id", "pooling_type"), [("bert/model", "MEAN"), ("llama/model", "LAST")])
def test_sensitivities_measured_with_the_leading_blocks_replayed_equal_full_runs(row_id, pooling_type, tmp_path,
                                                                                 monkeypatch):
    """Each layer's run replays the blocks before its own from the reference run: the same
    sensitivities, bit for bit, as computing every block (on a seeded encoder and decoder)."""
    row = next(r for r in architectures.rows() if r.id == row_id)
    folder = architectures.build_folder(row, tmp_path / "model")
    measured, replayed_calls, skipped = [], [], []
    replay = BlockReplay._replay

    def counted(self, path, index):
        forward = replay(self, path, index)
        return lambda *args, **kwargs: (replayed_calls.append(index), forward(*args, **kwargs))[1]

    def with_and_without_replay(engine, layers, texts):
        blocks = [block_of(engine.runner.backbone, name) for name in layers]
        skipped.append(sum(block[1] for block in blocks if block is not None))  # blocks before each layer's
        monkeypatch.setattr(BlockReplay, "_replay", counted)
        measured.append(sensitivities(engine, layers, texts))
        monkeypatch.setattr(BlockReplay, "replaying", lambda _self, _block: contextlib.nullcontext())
        measured.append(sensitivities(engine, layers, texts))
        return measured[0]

    sensitivities = precision._sensitivities
    monkeypatch.setattr(precision, "_sensitivities", with_and_without_replay)
    poolrunner.Runtime(str(folder), dtype="int8", pooling_type=pooling_type, load_entrypoints=False)
    replayed, full = measured
    assert replayed == full and len(full) >= 13
    # every block before a layer's own was replayed, not computed, in that layer's run (once per step)
    assert skipped[0] > 0 and len(replayed_calls) > 0 and len(replayed_calls) % skipped[0] == 0


@pytest.fixture(scope="module")
def lee_100(lee_docs) -> list[str]:
    """The first 100 sentences of the Lee news documents (split at sentence ends)."""
    sentences = [s for doc in lee_docs for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'])", doc)]
    return sentences[:LEE_SENTENCES]


def _int8_runtime(folder, caplog, **options):
    """The model served in int8, its layers as loaded, and the load log's line on the layers kept."""
    spy = ModelSpy()
    with caplog.at_level(logging.INFO, logger="poolrunner.core.precision"):
        runtime = poolrunner.Runtime(str(folder), dtype="int8", load_entrypoints=False, plugins=[spy], **options)
    layers = [m for m in spy.model.modules() if isinstance(m, int8.Int8Linear) and m._quantized is not None]
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype int8:")]
    return runtime, layers, logged


def test_all_minilm_l6_v2_is_served_in_int8_within_cosine_0999_of_sentence_transformers_float32(
        model_path, st_model, lee_100, caplog):
    runtime, layers, logged = _int8_runtime(model_path, caplog)
    kept = [layer for layer in layers if not layer.quantized]
    assert len(layers) == 37 and len(kept) <= 12  # most products run in int8 (37: with the BERT pooler)
    assert logged == [_kept_line(logged, len(kept), 37)]
    cosines = cosine_rows(runtime.embed(lee_100), st_model.encode(lee_100))
    print(f"\n[int8] all-MiniLM-L6-v2: {len(kept)} of 37 layers kept in bf16, min cosine {cosines.min():.5f} "
          f"on {len(lee_100)} Lee sentences")
    assert cosines.min() >= 0.999


@pytest.mark.slow
def test_smollm2_is_refused_in_int8_because_even_bf16_mixed_misses_the_bar_on_single_words():
    """SmolLM2-135M's residual stream, RMSNorm and attention in bf16 move its LAST-token embedding
    past the bar, and over float32 activations (every product kept in bf16: bf16-mixed) a few of
    the probe's single words still miss it (a lone token is the decoder's first, whose massive
    activations leave the other channels few bits): no choice of int8 layers can hold it, so the
    load refuses, and transformers float32 confirms that bf16-mixed misses cosine 0.999 there."""
    from transformers import AutoModel, AutoTokenizer

    from tests.models.smollm2 import smollm2_folder

    folder = smollm2_folder()
    with pytest.raises(ModelLoadError) as error:
        poolrunner.Runtime(str(folder), dtype="int8", pooling_type="LAST", load_entrypoints=False)
    found = re.fullmatch(r"dtype 'int8' is refused for this model: on the probe texts, even with all 210 linear "
                         r"layers in bfloat16 over float32 activations, its outputs are up to (\d\.\d{4}) away from "
                         r"float32's \(relative error; for unit vectors cosine \d\.\d{4}\); the bar is 0\.0447 "
                         r"\(cosine 0\.999\); use dtype 'auto' \(it measures which precision holds the bar\) "
                         r"or 'float32'", str(error.value))
    assert found and float(found.group(1)) > 0.0447
    mixed = poolrunner.Runtime(str(folder), dtype="bf16-mixed", pooling_type="LAST", load_entrypoints=False)
    texts = precision.probe_texts(mixed.inputs.tokenizer, mixed.model_config.max_model_len)
    words = texts[len(precision.PROBE_TEXTS):-1]
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModel.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    # All words in one call, padded on the right: causal attention keeps the padding out of every
    # real token's state, so each word's last real token is as it would be alone.
    tokenizer.padding_side = "right"
    batch = tokenizer(words, return_tensors="pt", padding=True)
    with torch.inference_mode():
        states = model(**batch).last_hidden_state
    expected = states[torch.arange(len(words)), batch["attention_mask"].sum(1) - 1].numpy()
    assert cosine_rows(mixed.embed(words), expected).min() < 0.999
    assert mixed.embed(["next"]).shape == (1, 576)


def _kept_line(logged: list[str], kept: int, layers: int) -> str:
    """The log line expected for ``kept`` layers in bf16 over bf16 activations, with the figures it measured."""
    assert len(logged) == 1
    if not kept:
        assert logged[0].startswith(f"dtype int8: all {layers} linear layers in int8 over bfloat16 activations")
        return logged[0]
    found = re.fullmatch(rf"dtype int8: {kept} of {layers} linear layers stay in bfloat16 over bfloat16 "
                         r"activations, those whose int8 error "
                         r"alone moves the outputs most \((.+): mean squared relative error on 40 calibration "
                         r"texts\); with them the probe error against float32 is (\d\.\d{4}) <= 0\.0447, all in "
                         r"int8 it was (\d\.\d{4}) \(\d+ probe runs\)", logged[0])
    assert found, logged[0]
    names = [item.rsplit(" ", 1) for item in found.group(1).split(", ")]
    assert len(names) == kept and float(found.group(3)) > 0.0447 >= float(found.group(2))
    errors = [float(error) for _, error in names]
    assert errors == sorted(errors, reverse=True)
    return logged[0]


def test_int8_off_the_fast_path_is_refused_saying_what_it_needs(tiny_bert):
    with pytest.raises(ModelLoadError) as error:
        poolrunner.Runtime(str(tiny_bert[0]), dtype="int8", compile="off", load_entrypoints=False)
    assert str(error.value) == (
        "dtype 'int8' needs the CPU fast path (compile='auto' on a CPU whose oneDNN multiplies bfloat16: AVX-512 "
        "BW/VL/DQ or AVX-NE-CONVERT); this runtime has device 'cpu', compile='off' and oneDNN bfloat16 products")


def test_int8_without_the_kernels_is_refused(tiny_bert, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "supported_dtypes", lambda: frozenset())
    with pytest.raises(ModelLoadError) as error:
        poolrunner.Runtime(str(tiny_bert[0]), dtype="int8", load_entrypoints=False)
    assert str(error.value) == ("dtype 'int8' needs poolrunner's CPU kernels, which could not be built here "
                                "(see the warning above)")
