"""One int8 linear layer four ways, at all-MiniLM-L6-v2's shapes (2,048 rows): oneDNN's bf16
product with its activation fused (what ``dtype="bfloat16"`` runs), poolrunner's
:class:`~poolrunner.core.kernels.int8.Int8Linear` (per-token quantization, ``torch._int_mm``,
conversion back with the activation in it), and oneDNN's fused int8 product
``torch.ops.onednn.qlinear_pointwise`` (bias, activation and the conversion to bf16 in the
product, but one activation scale per tensor) with and without its quantization pass.

Interleaved rounds, median and minimum per call in ms, and each one's relative error against the
float32 product: ``python bench/int8_products.py [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from poolrunner.core.kernels import cpu_kernels, int8

ROWS = 2048
SHAPES = ((384, 1536, ("gelu", "none")), (1536, 384, ("none", "")), (384, 384, ("none", "")))


def _ms(function: Callable[[], object], calls: int = 10) -> float:
    function()
    start = time.perf_counter()
    for _ in range(calls):
        function()
    return (time.perf_counter() - start) / calls * 1e3


def _per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, float, int]:
    """Asymmetric uint8 with one scale and zero point for the whole tensor (what qlinear takes)."""
    lo, hi = x.min().clamp_max(0), x.max().clamp_min(0)
    scale = float((hi - lo) / 255)
    zero = int(torch.round(-lo / scale))
    return (torch.round(x / scale) + zero).clamp(0, 255).to(torch.uint8), scale, zero


def _ways(in_features: int, out_features: int, activation: tuple[str, str]) -> tuple[dict, torch.Tensor, torch.Tensor]:
    linear = nn.Linear(in_features, out_features).bfloat16()
    x = torch.randn(ROWS, in_features).bfloat16()
    layer = int8.Int8Linear(linear, activation)
    int8.calibrate(layer, lambda: layer(x))
    weight, bias = linear.weight.float(), linear.bias.float()
    w_scale = weight.abs().amax(1) / 127
    packed = torch.ops.onednn.qlinear_prepack(torch.round(weight / w_scale[:, None]).clamp(-127, 127).to(torch.int8),
                                              [ROWS, in_features])
    w_zero = torch.zeros(out_features, dtype=torch.int64)
    bf16_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight, ROWS)
    name, algorithm = activation

    def qlinear(qx: torch.Tensor, scale: float, zero: int) -> torch.Tensor:
        return torch.ops.onednn.qlinear_pointwise(qx, scale, zero, packed, w_scale, w_zero, bias, 1.0, 0,
                                                  torch.bfloat16, name, [], algorithm)

    fixed = _per_tensor(x.float())
    ways = {
        "bf16 product, activation fused": lambda: torch.ops.mkldnn._linear_pointwise(x, bf16_weight, linear.bias,
                                                                                   name, [], algorithm),
        "Int8Linear, per token": lambda: layer(x),
        "qlinear_pointwise + quantization": lambda: qlinear(*_per_tensor(x.float())),
        "qlinear_pointwise alone": lambda: qlinear(*fixed),
    }
    expected = F.linear(x.float(), weight, bias)
    return ways, x, F.gelu(expected) if name == "gelu" else expected


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if torch.bfloat16 not in cpu_kernels.supported_dtypes():
        raise SystemExit("needs poolrunner's CPU kernels (x86 with AVX-512) and native bf16")
    torch.manual_seed(0)
    for in_features, out_features, activation in SHAPES:
        ways, _, expected = _ways(in_features, out_features, activation)
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, way in ways.items():
                times[name].append(_ms(way))
        print(f"[{ROWS}, {in_features}] x [{in_features}, {out_features}], activation {activation[0]}")
        for name, way in ways.items():
            error = float((way().float() - expected).norm() / expected.norm())
            print(f"  {name:34s} median {statistics.median(times[name]):8.3f} ms  min {min(times[name]):8.3f}"
                  f"  relative error {error:.4f}")


if __name__ == "__main__":
    main()
