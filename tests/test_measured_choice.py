"""``MeasuredChoice``: the faster of two kernels per key, measured over its first calls (scripted clocks here: the
real timings are bench/README.md's), and how ``PackedLinear`` serves bf16 products with it."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from poolrunner.core.kernels import measured_choice, onednn
from poolrunner.core.kernels.measured_choice import MeasuredChoice
from tests.helpers import bf16_products


class ScriptedClock:
    """A clock under which the measured kernels' runs take the given seconds in turn, the default's
    and the alternative's alternately (the measurement reads the clock before and after each run,
    the default's first); a number is the same duration for every run."""

    def __init__(self, default: float | list[float], alternative: float | list[float]) -> None:
        defaults, alternatives = (itertools.cycle(d if isinstance(d, list) else [d]) for d in (default, alternative))
        # Each run reads the clock twice: at its start (no time passed) and at its end.
        self._durations = itertools.chain.from_iterable(
            (0.0, next(defaults), 0.0, next(alternatives)) for _ in itertools.count())
        self._now = 0.0

    def __call__(self) -> float:
        self._now += next(self._durations)
        return self._now


class Kernel:
    """A kernel that counts its runs and returns its name."""

    def __init__(self, name: str) -> None:
        self.name, self.runs = name, 0

    def __call__(self) -> str:
        self.runs += 1
        return self.name


MEASURED_CALLS = 2 * measured_choice.RUNS
"""Calls of a key that measure it: the two kernels alternately, the default first."""


def _measure(choice: MeasuredChoice, key: str, default: Kernel, alternative: Kernel) -> list[str]:
    return [choice(key, default, alternative) for _ in range(MEASURED_CALLS)]


@pytest.mark.parametrize(("alternative_seconds", "chosen"), [(0.5, "plain"), (0.89, "plain"), (0.95, "packed"),
                                                              (1.5, "packed")])
def test_the_alternative_replaces_the_default_only_when_faster_by_the_margin(alternative_seconds, chosen, caplog):
    choice = MeasuredChoice(ScriptedClock(1.0, alternative_seconds))
    packed, plain = Kernel("packed"), Kernel("plain")
    with caplog.at_level("DEBUG", logger="poolrunner.core.kernels.measured_choice"):
        # While measured, each call runs one kernel, in turn, and returns its result.
        assert _measure(choice, "shape", packed, plain) == ["packed", "plain"] * measured_choice.RUNS
    assert caplog.messages == [f"measured shape: default 1000.000 ms, alternative {1e3 * alternative_seconds:.3f} ms "
                               f"per unit: the {'alternative' if chosen == 'plain' else 'default'}"]
    assert (packed.runs, plain.runs) == (measured_choice.RUNS, measured_choice.RUNS)
    assert choice.chosen("shape") is (chosen == "plain")
    # Then only the chosen kernel runs for that key.
    assert choice("shape", packed, plain) == chosen
    assert (packed.runs, plain.runs) == (measured_choice.RUNS + (chosen == "packed"),
                                         measured_choice.RUNS + (chosen == "plain"))
    assert choice.choices() == {"shape": chosen == "plain"}


def test_a_key_is_chosen_only_after_its_measurement():
    choice = MeasuredChoice(ScriptedClock(1.0, 0.5))
    packed, plain = Kernel("packed"), Kernel("plain")
    assert choice.chosen("shape") is None
    for _ in range(MEASURED_CALLS - 1):
        choice("shape", packed, plain)
        assert choice.chosen("shape") is None and choice.choices() == {}
    choice("shape", packed, plain)
    assert choice.chosen("shape") is True


def test_each_key_is_measured_on_its_own():
    choice = MeasuredChoice(ScriptedClock(1.0, 0.5))
    packed, plain = Kernel("packed"), Kernel("plain")
    _measure(choice, "a", packed, plain)
    _measure(choice, "b", packed, plain)
    assert plain.runs == packed.runs == 2 * measured_choice.RUNS
    assert choice.choices() == {"a": True, "b": True}


def test_the_fastest_run_of_each_kernel_is_compared():
    # The default's first run is slow (a cold cache, a kernel built): its best run counts, and the
    # alternative, faster than the default's mean but not by the margin than its best, is not chosen.
    choice = MeasuredChoice(ScriptedClock([5.0, 1.0, 1.0, 1.0, 1.0], 0.95))
    _measure(choice, "shape", Kernel("packed"), Kernel("plain"))
    assert choice.chosen("shape") is False


@pytest.mark.parametrize(("alternative_rows", "chosen"), [(105, False), (200, True), (50, False)])
def test_calls_of_different_sizes_are_compared_per_unit(alternative_rows, chosen):
    # Every run takes 1 s: the default's over 100 rows (0.01 s a row), the alternative's over
    # alternative_rows; only over 200 rows is the alternative faster a row by the margin.
    choice = MeasuredChoice(ScriptedClock(1.0, 1.0))
    for call in range(MEASURED_CALLS):
        choice("shape", Kernel("packed"), Kernel("plain"), size=100 if call % 2 == 0 else alternative_rows)
    assert choice.chosen("shape") is chosen


needs_bf16_products = pytest.mark.skipif(not bf16_products(), reason="this CPU's oneDNN has no bfloat16 products")


def _bf16_linear(bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(96, 40, bias=bias).to(torch.bfloat16)


def _reference(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    bias = None if linear.bias is None else linear.bias.double()
    return F.linear(x.double(), linear.weight.double(), bias)


@needs_bf16_products
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("plain_faster", [True, False], ids=["plain-faster", "packed-faster"])
def test_a_bf16_layer_runs_the_kernel_measured_faster_for_each_row_count(monkeypatch, plain_faster, bias):
    choice = MeasuredChoice(ScriptedClock(1.0, 0.5 if plain_faster else 2.0))
    monkeypatch.setattr(onednn, "PLAIN_OR_PACKED", choice)
    linear = _bf16_linear(bias)
    layer = onednn.PackedLinear(linear)
    torch.manual_seed(1)
    threads, rows = torch.get_num_threads(), [3, 64, 65, 200]
    with torch.inference_mode():
        for n in rows:
            x = torch.randn(2, n, 96).to(torch.bfloat16)
            plain = F.linear(x, linear.weight, linear.bias)
            packed = torch.ops.mkldnn._linear_pointwise(x, layer._packed, linear.bias, "none", [], "")
            # Each bucket's first calls run the two kernels in turn, then the one measured faster.
            kernels = [packed, plain] * measured_choice.RUNS + [plain if plain_faster else packed] * 2
            for expected_kernel in kernels:
                got = layer(x)
                assert got.shape == (2, n, 40) and got.dtype == torch.bfloat16
                assert torch.equal(got, expected_kernel)
            expected = _reference(x, linear)
            assert ((got.double() - expected).norm() / expected.norm()).item() < 1e-2
    buckets = {measured_choice.row_bucket(2 * n) for n in rows}
    assert choice.choices() == {(96, 40, bias, torch.bfloat16, threads, bucket): plain_faster for bucket in buckets}


@needs_bf16_products
def test_layers_of_one_shape_share_a_measurement(monkeypatch):
    choice = MeasuredChoice(ScriptedClock(1.0, 0.5))
    monkeypatch.setattr(onednn, "PLAIN_OR_PACKED", choice)
    first, second = onednn.PackedLinear(_bf16_linear()), onednn.PackedLinear(_bf16_linear())
    x = torch.randn(100, 96).to(torch.bfloat16)
    with torch.inference_mode():
        for call in range(MEASURED_CALLS):  # their calls alternate, as a model's layers do
            assert choice.choices() == {}
            (first if call % 2 == 0 else second)(x)
        assert torch.equal(first(x), second(x))
    assert list(choice.choices().values()) == [True]
    assert first._plain_faster == second._plain_faster == {(torch.get_num_threads(), 2): True}


@pytest.mark.parametrize("case", ["float32", "fused-activation", "bf16-mixed-with-bias"])
def test_only_bf16_products_without_a_post_op_have_the_plain_candidate(monkeypatch, case):
    if case != "float32" and not bf16_products():
        pytest.skip("this CPU's oneDNN has no bfloat16 products")
    choice = MeasuredChoice(ScriptedClock(1.0, 0.5))
    monkeypatch.setattr(onednn, "PLAIN_OR_PACKED", choice)
    torch.manual_seed(0)
    linear = nn.Linear(96, 40)
    if case == "fused-activation":
        layer, x = onednn.PackedLinear(linear.to(torch.bfloat16), ("gelu", "none")), torch.randn(7, 96).bfloat16()
    else:
        matmul_dtype = torch.bfloat16 if case == "bf16-mixed-with-bias" else None
        layer, x = onednn.PackedLinear(linear, matmul_dtype=matmul_dtype), torch.randn(7, 96)
    with torch.inference_mode():
        layer(x)
    assert choice.choices() == {}


@needs_bf16_products
@pytest.mark.parametrize("plain_faster", [True, False], ids=["plain-faster", "packed-faster"])
def test_bf16_mixed_measures_a_layer_without_a_bias_on_a_bf16_copy_kept_only_where_chosen(monkeypatch, plain_faster):
    # Without a bias F.linear rounds as the prepacked product does: float32 in, one bf16 rounding.
    choice = MeasuredChoice(ScriptedClock(1.0, 0.5 if plain_faster else 2.0))
    monkeypatch.setattr(onednn, "PLAIN_OR_PACKED", choice)
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=False)
    layer = onednn.PackedLinear(linear, matmul_dtype=torch.bfloat16)
    x = torch.randn(3, 70, 96)
    with torch.inference_mode():
        for _ in range(MEASURED_CALLS):
            layer(x)
        got = layer(x)
        again = layer(x)
        plain = F.linear(x.bfloat16(), linear.weight.bfloat16()).float()
        packed = torch.ops.mkldnn._linear_pointwise(x.bfloat16(), layer._packed, None, "none", [], "").float()
    assert got.dtype == torch.float32
    assert torch.equal(got, plain if plain_faster else packed) and torch.equal(again, got)
    assert list(choice.choices().values()) == [plain_faster]
    if plain_faster:
        assert torch.equal(layer._plain_weight, linear.weight.bfloat16())
        assert layer._plain_weight.dtype == torch.bfloat16
    else:
        assert layer._plain_weight is None
    assert layer.weight is linear.weight  # the float32 parameter itself stays


@needs_bf16_products
def test_deterministic_algorithms_keep_the_prepacked_kernel_unmeasured(monkeypatch):
    choice = MeasuredChoice(ScriptedClock(1.0, 0.5))
    monkeypatch.setattr(onednn, "PLAIN_OR_PACKED", choice)
    linear = _bf16_linear()
    layer = onednn.PackedLinear(linear)
    x = torch.randn(100, 96).to(torch.bfloat16)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with torch.inference_mode():
            got = layer(x)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert torch.equal(got, torch.ops.mkldnn._linear_pointwise(x, layer._packed, linear.bias, "none", [], ""))
    assert choice.choices() == {}
    with torch.inference_mode():  # measured once it is off again
        for _ in range(MEASURED_CALLS):
            layer(x)
        assert torch.equal(layer(x), F.linear(x, linear.weight, linear.bias))
    assert list(choice.choices().values()) == [True]


@needs_bf16_products
def test_bf16_mixed_measures_a_gated_mlps_down_projection_on_its_bf16_input(monkeypatch):
    # GatedMLP hands down_proj the bf16 product of the gate: float32 weight, bf16 input.
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    choice = MeasuredChoice(ScriptedClock(1.0, 0.5))
    monkeypatch.setattr(onednn, "PLAIN_OR_PACKED", choice)
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=160, mlp_bias=False)).eval()
    fused = onednn.GatedMLP(mlp, torch.bfloat16)
    x = torch.randn(50, 64)
    with torch.inference_mode():
        for _ in range(MEASURED_CALLS):
            fused(x)
        got = fused(x)
        expected = mlp.double()(x.double())
    assert got.dtype == torch.float32
    assert ((got.double() - expected).norm() / expected.norm()).item() < 1e-2
    assert (160, 64, False, torch.bfloat16, torch.get_num_threads(), 1) in choice.choices()
