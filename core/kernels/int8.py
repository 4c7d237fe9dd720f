"""``dtype="int8"`` on the CPU: linear layers as dynamic int8 products, calibrated at load.

Each linear layer's weight is quantized once, per output channel (symmetric, 127 levels), and
its input at every call per row (per token, asymmetric, 256 levels); the product runs on int8
(``torch._int_mm``: oneDNN's VNNI or AMX-INT8 kernel) with int32 accumulation, and the two
passes around it are poolrunner's kernels (``int8_linear.cpp``); the second also applies the
bias, the layer's activation and a gated MLP's multiply, so none is a pass of its own. Before
either is quantized, a per-input-channel factor moves the activations' outlier channels into the
weight (SmoothQuant, Xiao et al. 2023, ``alpha`` 0.5): ``x @ W.T == (x / s) @ (W * s).T``, with
``s = max|x|**0.5 / max|W|**0.5`` per channel, measured on calibration texts at load. Then
each block of :data:`ROTATION_BLOCK` input channels is rotated by a Hadamard matrix, the input
in the quantization pass, the weight at load (``x @ W.T == (x H) @ (W H).T``, ``H`` orthogonal;
QuaRot, Ashkboos et al. 2024): a token's few large values, in no fixed channel, set the step of
all its other values, and the rotation spreads them over their block.

What it costs in accuracy is a property of the model and of each layer, so it is measured at
load (:func:`poolrunner.core.precision.quantize_checked`): the error each layer alone in int8
causes in the model's outputs ranks the layers, and the fewest most sensitive ones that bring the
probe within cosine 0.999 of float32 stay in bfloat16 (:meth:`Int8Linear.keep`).
all-MiniLM-L6-v2 with every layer in int8 (emulated in float32, min cosine to float32 over the
probe's 6 sentences and 512 words / 1,000 Lee sentences): 0.99909 / 0.99961 with the rotation,
0.99727 / 0.99885 without, where keeping the six layers whose input is the GELU output (the
MLPs' second products) in bfloat16 was needed to hold the bar.

Everything but the linear layers (embeddings, LayerNorm, attention, pooling) runs in the
model's dtype: bfloat16, or float32 for a model whose bfloat16 activations alone miss the bar
(:data:`poolrunner.core.precision.INT8_OVER_FLOAT32`). The products kept out of
int8 run in bfloat16 either way.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from poolrunner.core.kernels import cpu_kernels

logger = logging.getLogger(__name__)

SMOOTHING_ALPHA = 0.5
"""SmoothQuant's migration strength: 0.5 measured best on all-MiniLM-L6-v2 (0.65 and 0.8 lost
accuracy on single words)."""
UNSEEN_CHANNEL_FLOOR = 0.01
"""A channel calibration saw (almost) no activation in is treated as reaching this fraction of
the layer's largest channel, so that its smoothing factor stays bounded."""
KEPT_DTYPE = torch.bfloat16
"""The products of the layers kept out of int8 (:meth:`Int8Linear.keep`): native on every CPU
``dtype="int8"`` runs on."""
ROTATION_BLOCK = 128
"""Input channels rotated together (at most; the largest power of two from 16 dividing the
layer's width): 128 held all-MiniLM-L6-v2's probe within the bar with every layer in int8."""
PACK_BATCH_HINT = 2048
"""Rows a kept layer's weight layout is tuned for (:data:`poolrunner.core.kernels.onednn.BATCH_HINT`)."""

_TORCH_ACTIVATIONS = {
    ("none", ""): lambda x: x,
    ("gelu", "none"): F.gelu,
    ("gelu", "tanh"): lambda x: F.gelu(x, approximate="tanh"),
    ("relu", ""): F.relu,
    ("swish", ""): F.silu,
}
"""oneDNN post-op names (:func:`poolrunner.core.kernels.onednn._post_op`) -> torch's function, for
the float calls before calibration (the int8 ones apply it in the conversion back)."""


class Int8Linear(nn.Module):
    """``activation(x @ weight.T + bias)`` with int8 products, after :meth:`calibrate`.

    Until then (while the calibration texts run) it computes in the weight's dtype and records
    each input channel's largest magnitude. A layer no calibration input reached stays so, without
    recording: nothing says how to quantize its inputs.

    :ivar matmul_dtype: The dtype its inputs arrive in and its outputs leave in (the weight's:
        bfloat16, or float32 over float32 activations); the int8 rounding happens inside.
    """

    def __init__(self, linear: nn.Linear, activation: tuple[str, str] = ("none", "")) -> None:
        """:param activation: A oneDNN post-op name of :data:`_TORCH_ACTIVATIONS`: in int8, applied in
            float32 by the conversion back (:func:`~poolrunner.core.kernels.cpu_kernels.dequantize_rows`)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.activation = activation
        self.matmul_dtype = linear.weight.dtype
        self.block = rotation_block(self.in_features)
        self._function = _TORCH_ACTIVATIONS[activation]
        self._activation_code = cpu_kernels.ACTIVATIONS[activation]
        self.register_buffer("input_absmax", torch.zeros(self.in_features), persistent=False)
        self.recording = True
        self._quantized: tuple[torch.Tensor, ...] | None = None
        self._kept: torch.Tensor | None = None  # the bf16 weight prepacked for oneDNN, while kept

    @property
    def quantized(self) -> bool:
        """Whether its products run in int8: calibrated and not kept (:meth:`keep`)."""
        return self._quantized is not None and self._kept is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features]`` -> ``[..., out_features]``, in ``x``'s dtype."""
        if self._kept is not None:
            name, algorithm = self.activation
            out = torch.ops.mkldnn._linear_pointwise(x.to(KEPT_DTYPE), self._kept, self.bias, name, [], algorithm)
            return out.to(x.dtype)
        if self._quantized is not None:
            return self._int8_forward(x)
        rows = x.reshape(-1, self.in_features)
        if self.recording and len(rows):
            torch.maximum(self.input_absmax, rows.abs().amax(0).float(), out=self.input_absmax)
        return self._function(F.linear(x, self.weight, self.bias))

    def keep(self, kept: bool = True) -> None:
        """Run the product in bfloat16 (``kept``: oneDNN-prepacked, the activation fused, as
        :class:`~poolrunner.core.kernels.onednn.PackedLinear`; over float32 activations, as
        ``bf16-mixed`` runs it) or, after :meth:`calibrate`, in int8 again."""
        if kept != (self._kept is not None):
            weight = self.weight.detach().to(KEPT_DTYPE)
            self._kept = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT) if kept else None

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``activation(x @ weight.T + bias) * other`` (:class:`~poolrunner.core.kernels.onednn.GatedMLP`'s
        call): ``other`` ``[..., out_features]`` in ``x``'s dtype."""
        if self.quantized:
            return self._int8_forward(x, other)
        return self(x) * other

    def calibrate(self, alpha: float = SMOOTHING_ALPHA) -> bool:
        """Quantize the weight with smoothing factors from the inputs seen so far; from now on the
        products run in int8, and nothing more is recorded.

        :returns: Whether it quantized: ``False`` where no input (or only zeros) was seen.
        """
        self.recording = False
        seen = self.input_absmax
        if not bool(seen.any()):
            return False
        weight = self.weight.detach().float()
        activation_max = seen.clamp_min(UNSEEN_CHANNEL_FLOOR * seen.max())
        weight_max = weight.abs().amax(0).clamp_min(torch.finfo(torch.float32).tiny)
        smooth = activation_max.pow(alpha) / weight_max.pow(1 - alpha)
        smoothed, inv_smooth = weight * smooth, 1 / smooth
        if self.block:  # the kernel's Hadamard matrix is unnormalized: 1 / sqrt(block) goes with the input's factor
            norm = math.sqrt(self.block)
            rotation = cpu_kernels.hadamard(self.block) / norm
            smoothed = (smoothed.reshape(self.out_features, -1, self.block) @ rotation).reshape(smoothed.shape)
            inv_smooth = inv_smooth / norm
        col_scale = smoothed.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        qweight = torch.round(smoothed / col_scale[:, None]).clamp(-127, 127).to(torch.int8)
        bias = torch.empty(0) if self.bias is None else self.bias.detach().float()
        self._quantized = (inv_smooth.contiguous(), qweight, col_scale.contiguous(),
                           qweight.sum(1, dtype=torch.int32), bias.contiguous())
        return True

    def _int8_forward(self, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        """The int8 product, its activation and the factor ``other`` in the conversion back."""
        inv_smooth, qweight, col_scale, col_sum, bias = self._quantized  # type: ignore[misc]
        rows = x.reshape(-1, self.in_features).contiguous()
        if not len(rows):
            return x.new_empty(*x.shape[:-1], self.out_features)
        q = torch.empty(rows.shape, dtype=torch.int8)
        scale = torch.empty(len(rows), dtype=torch.float32)
        offset = torch.empty(len(rows), dtype=torch.int32)
        cpu_kernels.quantize_rows(rows, inv_smooth, q, scale, offset, self.block)
        out = torch.empty(len(rows), self.out_features, dtype=x.dtype)
        # One product per call: in row blocks (each block's int32 converted while in cache),
        # oneDNN reorders the weight for every block: [2048, 384] x [384, 1536] took 4.96 ms in
        # blocks of 256 rows against 3.37 ms in one (2 Zen 4 cores)
        if other is not None:
            other = other.to(x.dtype).reshape(len(rows), self.out_features).contiguous()
        cpu_kernels.dequantize_rows(torch._int_mm(q, qweight.t()), scale, offset, col_scale, col_sum, bias, out,
                                    self._activation_code, other)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, activation={self.activation}, "
                f"rotation_block={self.block}, calibrated={self._quantized is not None}, kept={self._kept is not None}")


def rotation_block(width: int) -> int:
    """The rotation block of a layer ``width`` inputs wide: the largest power of two dividing it,
    at most :data:`ROTATION_BLOCK`; 0 (no rotation) below 16, the kernel's vector width."""
    block = min(width & -width, ROTATION_BLOCK)
    return block if block >= 16 else 0


def calibrate(module: nn.Module, run: Callable[[], object]) -> int:
    """Calibrate every int8 layer inside ``module`` on the inputs that reach it during ``run()``
    (:meth:`Int8Linear.calibrate`); what reached them before is forgotten.

    :returns: The number of layers quantized; the others (no input reached them) stay in float.
    """
    layers = [child for child in module.modules() if isinstance(child, Int8Linear)]
    for layer in layers:
        layer.input_absmax.zero_()
    run()
    quantized = sum(layer.calibrate() for layer in layers)
    if quantized < len(layers):
        logger.info("int8: %d of %d linear layers saw no calibration input and stay in %s",
                    len(layers) - quantized, len(layers), layers[0].matmul_dtype)
    return quantized

