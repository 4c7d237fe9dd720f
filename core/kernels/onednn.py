"""The CPU fast path: linear layers with oneDNN-prepacked weights and fused activations.

``nn.Linear`` on the CPU hands its weight to the matrix-multiply library at every call, which
reorders it into the library's blocked layout each time, and an activation after it is a second
pass over the output. :class:`PackedLinear` reorders the weight once at load
(``torch.ops.mkldnn._reorder_linear_weight``) and runs ``torch.ops.mkldnn._linear_pointwise``,
which applies bias and, where the module's code is known, the activation inside the same kernel
(the fusion torch's inductor performs when it freezes a model). Measured on 2 Zen 4 cores
(AVX512-BF16, no AMX), ``[2048, 384] x [384, 384]``: float32 1.37 ms against 2.88 ms for
``F.linear``, bfloat16 0.59 against 0.64 ms.

In a gated MLP (Llama's and its copies: SiLU, or GELU as Gemma's), :class:`GatedMLP` also makes
the multiply ``act(gate_proj(x)) * up_proj(x)`` up_proj's post-op, which saves a pass over the
``[tokens, intermediate]`` product and its allocation. SmolLM2-135M embedding 100 paragraphs on the
same cores: its 30 MLPs took 1.19-1.31 s against 1.34-1.39 s in float32 (the whole pass 4-10% less);
in bfloat16 0.55 s either way, the post-op costing what the pass did. Without AVX-512 the two
post-ops cost more than they save (:data:`GATE_POST_OPS`), and the activation and the multiply
run as passes instead. ModernBERT's MLP, whose one product makes both the activated half and the
gate (``act(a) * g`` with ``a, g = Wi(x).chunk(2)``), becomes :class:`SplitGatedMLP` the same way.

On a CPU without AVX-512, float32 layers stay ``nn.Linear`` (:data:`PACK_FLOAT32`): there the
products ``F.linear`` hands to MKL run faster than oneDNN's AVX2 kernels.

A bf16 layer without a post-op (in bf16-mixed: without a bias either) runs, for each row count
(in buckets of 64), whichever of its prepacked product and ``F.linear`` over its plain weight
(bf16-mixed: a bf16 copy, kept only where chosen) was measured faster over its first calls
(:data:`PLAIN_OR_PACKED`): oneDNN's prepacked kernel wins at most row counts, but for some shapes
and thread counts, on 2 AMX cores at 320-640 rows ``[768] -> [768]`` and ``[1152] -> [768]``, its
split of the work leaves a core waiting (1.4-1.7x slower).

Only the computation changes, never the function: results equal transformers' own modules to
float32 rounding (or bf16 rounding in bf16), which the architecture tests check for every family.
"""

from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import activations

from poolrunner.core.kernels.int8 import Int8Linear
from poolrunner.core.kernels.measured_choice import MeasuredChoice, row_bucket

logger = logging.getLogger(__name__)

PACKED_DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 2048
"""Rows the weight layout is tuned for: the CPU's step budget; any row count runs."""
PLAIN_OR_PACKED = MeasuredChoice()
"""For bf16 products without a post-op: whether torch's product over the plain weight (``F.linear``)
runs a shape and row count faster than the prepacked one (:mod:`~poolrunner.core.kernels.measured_choice`),
keyed by ``(in_features, out_features, has_bias, input dtype, threads, row_bucket)`` (logged at DEBUG when
measured)."""
NO_ACTIVATION = ("none", "")
PACK_FLOAT32 = torch.cpu._is_avx512_supported()
"""Whether float32 linear layers are prepacked (:func:`pays`). Without AVX-512, oneDNN's float32
kernels are slower than MKL's, which ``F.linear`` calls: on 2 Zen 3 cores (AVX2), 1,917 rows,
median of 25 interleaved runs, GFLOP/s F.linear / oneDNN: all-MiniLM-L6-v2's ``[384, 1536]`` with
GELU 143 / 103 (fused) or 134 (a separate GELU pass), ``[1536, 384]`` 163 / 145; SmolLM2-135M's
``[576, 1536]`` 172 / 148, ``[1536, 576]`` 175 / 153. End to end, leaving the layers to torch
embeds 1.14x the paragraphs, 1.19x the documents and 1.03x SmolLM2's paragraphs (8 interleaved
rounds in one process). With AVX-512 oneDNN's kernels win (the measurement above)."""
GATE_POST_OPS = torch.cpu._is_avx512_supported()
"""Whether :class:`GatedMLP` runs SiLU and the multiply as oneDNN post-ops. A post-op takes vector
registers from the product's tile: with AVX2's 16 the product slows more than the pass it saves
(2 Zen 3 cores, float32, ``[2048, 576] x [576, 1536]``: 17.6 ms plain, 29.5 with SiLU, 21.7 with the
multiply; SmolLM2-135M's linear layers 8.8-9.6 s against 10.4-10.8 s on 200 paragraphs, the two
passes 0.3 s). AVX-512's 32 leave room (measured above). BERT's GELU stays fused on both: on the
same AVX2 cores all-MiniLM-L6-v2's products took 0.4 s longer with it, its separate pass 0.6 s."""


class PackedLinear(nn.Module):
    """``activation(x @ weight.T + bias)`` with the weight prepacked for oneDNN.

    With a ``matmul_dtype`` below the weight's (``bf16-mixed``: float32 weights, bfloat16
    matmuls), the product runs in that dtype (inputs rounded to it, float32 accumulation, output
    rounded to it) and its output is returned in the input's dtype; the output of a fused
    activation stays in the matmul dtype, because in the blocks that fuse one (:data:`_FUSABLE`)
    it feeds the next linear layer, which would round it to that dtype anyway.

    :ivar weight: The original ``[out_features, in_features]`` parameter, kept for code that reads
        it (dtype checks, heads that share it); the forward uses the packed copy.
    """

    def __init__(
        self, linear: nn.Linear, activation: tuple[str, str] = NO_ACTIVATION, matmul_dtype: torch.dtype | None = None,
    ) -> None:
        """:param activation: oneDNN's post-op name and algorithm: :data:`NO_ACTIVATION`,
            ``("gelu", "none")`` (erf), ``("gelu", "tanh")``, ``("relu", "")`` or ``("swish", "")``.
        :param matmul_dtype: The product's input dtype; ``None``: the weight's."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.activation = activation
        self.matmul_dtype = matmul_dtype or linear.weight.dtype
        weight = linear.weight.detach().to(self.matmul_dtype)
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
        # F.linear is a candidate where it rounds as the prepacked product does: bf16 products
        # without a post-op, and in bf16-mixed only without a bias (F.linear would round a float32
        # bias to bf16 first). bf16-mixed's float32 weight needs a bf16 copy (_plain_weight), made
        # when F.linear first runs and kept only while some row count runs it. _plain_faster is this
        # layer's copy of the choices, (threads, row bucket) -> F.linear, to keep the forward short.
        self._plain_candidate = (activation == NO_ACTIVATION and self.matmul_dtype == torch.bfloat16
                                 and (linear.weight.dtype == torch.bfloat16 or linear.bias is None))
        self._plain_weight = linear.weight if linear.weight.dtype == self.matmul_dtype else None
        self._plain_faster: dict[tuple[int, int], bool] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features]`` -> ``[..., out_features]``."""
        if self._plain_candidate:
            key = (torch.get_num_threads(), row_bucket(x.numel() // self.in_features))
            plain = self._plain_faster.get(key)
            if plain is None:
                return self._choose(x, key)
            if plain:
                return self._plain_product(x)
        return self._packed_product(x)

    def _choose(self, x: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
        """The product of ``x`` by the kernel :data:`PLAIN_OR_PACKED` runs for this shape (shared
        by the layers of the same shape), its choice remembered for ``key`` once measured; the
        prepacked one, unmeasured, under ``torch.use_deterministic_algorithms(True)``: a choice
        measured near a tie may differ between processes, and with it the output's bf16 rounding."""
        if torch.are_deterministic_algorithms_enabled():
            return self._packed_product(x)
        shape = (self.in_features, self.out_features, self.bias is not None, x.dtype, *key)
        out = PLAIN_OR_PACKED(shape, lambda: self._packed_product(x), lambda: self._plain_product(x),
                              x.numel() // self.in_features)
        plain = PLAIN_OR_PACKED.chosen(shape)
        if plain is not None:
            self._plain_faster[key] = plain
            if self.weight.dtype != self.matmul_dtype and not any(self._plain_faster.values()):
                self._plain_weight = None
        return out

    def _packed_product(self, x: torch.Tensor) -> torch.Tensor:
        name, algorithm = self.activation
        out = torch.ops.mkldnn._linear_pointwise(x.to(self.matmul_dtype), self._packed, self.bias, name, [], algorithm)
        return out if self.activation != NO_ACTIVATION else out.to(x.dtype)

    def _plain_product(self, x: torch.Tensor) -> torch.Tensor:
        if self._plain_weight is None:  # bf16-mixed: not made where the shape's choice is the prepacked kernel
            self._plain_weight = self.weight.detach().to(self.matmul_dtype)
        return F.linear(x.to(self.matmul_dtype), self._plain_weight, self.bias).to(x.dtype)

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``(x @ weight.T + bias) * other`` in one kernel (oneDNN's binary post-op), for a layer
        without an activation: ``x`` ``[..., in_features]``, ``other`` ``[..., out_features]`` in the
        matmul dtype -> ``[..., out_features]`` in the matmul dtype, rounded once, after the multiply."""
        # The binary kernel wants the bias in the input's dtype; bf16-mixed keeps it in float32.
        bias = None if self.bias is None else self.bias.to(self.matmul_dtype)
        return torch.ops.mkldnn._linear_pointwise.binary(x.to(self.matmul_dtype), other, self._packed, bias, "mul")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, activation={self.activation}, "
                f"matmul_dtype={self.matmul_dtype}")


class GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``, transformers' ``LlamaMLP`` (and its copies:
    Qwen, Mistral, Gemma's GELU-gated MLP...) in three kernels: the activation is gate_proj's
    post-op and the multiply up_proj's, so neither is a separate pass over the
    ``[tokens, intermediate]`` tensors. Without post-ops (:data:`GATE_POST_OPS`) they are passes
    over gate_proj's and up_proj's own outputs (SiLU's and the multiply in place).

    Takes the place of such a module (:func:`prepack`) under the same attribute names,
    so parameter names do not change.
    """

    def __init__(self, mlp: nn.Module, matmul_dtype: torch.dtype | None = None, post_ops: bool = True) -> None:
        """:param mlp: A module that :func:`_is_gated_mlp` accepts.
        :param matmul_dtype: See :class:`PackedLinear`.
        :param post_ops: The activation and the multiply as post-ops of the products (:func:`prepack`
            passes :data:`GATE_POST_OPS`)."""
        super().__init__()
        self.post_ops = post_ops
        self.act_fn = mlp.act_fn
        post_op = _post_op(mlp.act_fn)
        assert post_op is not None, "_is_gated_mlp accepts activations with a post-op only"
        self.gate_proj = packed_linear(mlp.gate_proj, post_op if self.post_ops else NO_ACTIVATION, matmul_dtype)
        self.up_proj = packed_linear(mlp.up_proj, matmul_dtype=matmul_dtype)
        self.down_proj = packed_linear(mlp.down_proj, matmul_dtype=matmul_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> ``[..., hidden]``, in ``x``'s dtype."""
        h = x.to(self.up_proj.matmul_dtype)  # bf16-mixed: rounded once for both products
        return self.down_proj(_gated(h, self.gate_proj, self.up_proj, self.act_fn, self.post_ops)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"post_ops={self.post_ops}"


class SplitGatedMLP(nn.Module):
    """``Wo(act(a) * g)`` with ``a, g = Wi(x).chunk(2, dim=-1)``: transformers' ``ModernBertMLP``
    (GeGLU; its dropout is the identity at inference), in three kernels as :class:`GatedMLP` runs
    Llama's: ``Wi``'s two halves are products of their own, the activation the first's post-op and
    the multiply the second's, where transformers runs ``Wi`` as one product, then the activation
    and the multiply as passes over its ``[tokens, 2 * intermediate]`` output (with ModernBERT's
    rotary in the kernel, ModernBERT-base's shape 1.47-1.50x in bfloat16: bench/README.md).
    Results equal the module's to the dtype's rounding: the activation reads the float32 sums
    instead of their bfloat16 rounding.

    ``Wi`` keeps its parameters under their names (``Wi.weight``, ``Wi.bias``), unused by the
    forward; the halves' packed weights are not parameters. Not for int8 (its calibration finds the
    layers it quantizes by name).
    """

    def __init__(self, mlp: nn.Module, matmul_dtype: torch.dtype | None = None, post_ops: bool = True) -> None:
        """:param mlp: A module that :func:`_is_split_gated_mlp` accepts.
        :param matmul_dtype: See :class:`PackedLinear`.
        :param post_ops: The activation and the multiply as post-ops (:func:`prepack` passes
            :data:`GATE_POST_OPS`); else passes over the halves' outputs."""
        super().__init__()
        self.post_ops = post_ops
        self.act = mlp.act
        half = mlp.Wi.out_features // 2
        post_op = _post_op(mlp.act) if post_ops else NO_ACTIVATION
        assert post_op is not None, "_is_split_gated_mlp accepts activations with a post-op only"
        self.Wi = _Parameters(mlp.Wi)
        self._halves = (PackedLinear(_rows(mlp.Wi, 0, half), post_op, matmul_dtype),
                        PackedLinear(_rows(mlp.Wi, half, 2 * half), matmul_dtype=matmul_dtype))
        self.Wo = PackedLinear(mlp.Wo, matmul_dtype=matmul_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> ``[..., hidden]``, in ``x``'s dtype."""
        activated, gate = self._halves
        h = x.to(self.Wo.matmul_dtype)  # bf16-mixed: rounded once for both products
        return self.Wo(_gated(h, activated, gate, self.act, self.post_ops)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"post_ops={self.post_ops}"


def _gated(h: torch.Tensor, gate: PackedLinear | Int8Linear, up: PackedLinear | Int8Linear, act: nn.Module,
           post_ops: bool) -> torch.Tensor:
    """``act(gate(h)) * up(h)`` in the matmul dtype: the activation ``gate``'s post-op and the
    multiply ``up``'s, or (without post-ops) passes over their outputs, SiLU's in place."""
    if post_ops:
        return up.mul(h, gate(h))
    activated = gate(h)
    activated = F.silu(activated, inplace=True) if _post_op(act) == ("swish", "") else act(activated)
    return up(h).mul_(activated)


class _Parameters(nn.Module):
    """A linear layer's ``weight`` and ``bias`` under their names, without its forward."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias


def _rows(linear: nn.Linear, start: int, stop: int) -> nn.Linear:
    """A linear layer computing output channels ``start:stop`` of ``linear``, on views of its weight."""
    part = nn.Linear(linear.in_features, stop - start, bias=linear.bias is not None, device="meta")
    part.weight = nn.Parameter(linear.weight.detach()[start:stop], requires_grad=False)
    if linear.bias is not None:
        part.bias = nn.Parameter(linear.bias.detach()[start:stop], requires_grad=False)
    return part


def joined_linear(linears: Sequence[PackedLinear]) -> tuple[PackedLinear, list[nn.Linear]]:
    """Layers that read the same input (prepacked alike, all with a bias or none) as one product.

    :returns: A :class:`PackedLinear` whose ``[..., sum of out_features]`` output holds the
        layers' outputs side by side, and for each layer an ``nn.Linear`` whose ``weight`` and
        ``bias`` are views of the joined ones (no copy is kept besides the prepacked one): the
        parameters keep their names, and code that calls a layer alone still gets its output
        (``F.linear``'s, in the weight's dtype).
    """
    first = linears[0]
    joined = nn.Linear(first.in_features, sum(linear.out_features for linear in linears),
                       bias=first.bias is not None, device="meta")
    joined.weight = nn.Parameter(torch.cat([linear.weight.detach() for linear in linears]), requires_grad=False)
    if first.bias is not None:
        joined.bias = nn.Parameter(torch.cat([linear.bias.detach() for linear in linears]), requires_grad=False)
    ends = list(itertools.accumulate(linear.out_features for linear in linears))
    parts = [_rows(joined, end - linear.out_features, end) for linear, end in zip(linears, ends, strict=True)]
    return PackedLinear(joined, first.activation, first.matmul_dtype), parts


def packed_linear(
    linear: nn.Linear, activation: tuple[str, str] = NO_ACTIVATION, matmul_dtype: torch.dtype | None = None,
) -> PackedLinear | Int8Linear:
    """:class:`PackedLinear`, or :class:`~poolrunner.core.kernels.int8.Int8Linear` for an int8 ``matmul_dtype``."""
    if matmul_dtype == torch.int8:
        return Int8Linear(linear, activation)
    return PackedLinear(linear, activation, matmul_dtype)


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the packed path can run products in ``dtype`` here: a CPU build with oneDNN, float32,
    or bfloat16 on a CPU whose oneDNN has bf16 kernels (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; not on
    an AVX2-only CPU)."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pays(matmul_dtype: torch.dtype) -> bool:
    """Whether prepacking makes products in ``matmul_dtype`` faster than torch's own on this CPU
    (:data:`PACK_FLOAT32`; bfloat16 and int8 products always: torch has no faster kernels for them)."""
    return matmul_dtype != torch.float32 or PACK_FLOAT32


def prepack(module: nn.Module, matmul_dtype: torch.dtype | None = None, *, fuse: bool = True) -> int:
    """Replace every ``nn.Linear`` inside ``module`` by a :func:`packed_linear`, in place, fusing
    the activation into the linear layer where the module's forward code is known (:data:`_FUSABLE`)
    and replacing gated MLPs by :class:`GatedMLP` and ModernBERT's by :class:`SplitGatedMLP`
    (not for int8).

    :param matmul_dtype: See :class:`PackedLinear`; ``None``: each weight's own dtype;
        ``torch.int8``: :class:`~poolrunner.core.kernels.int8.Int8Linear` layers, to be calibrated.
    :param fuse: Fuse activations and multiplies; ``False`` keeps every layer's output what
        ``nn.Linear`` returns (and each layer called as a module), for hooks that add to it (LoRA).
    :returns: The number of linear layers replaced.
    """
    gated = fused = 0
    if fuse:
        gated = replace_modules(module, lambda child: _fused_mlp(child, matmul_dtype))
        fused = _fuse_activations(module, matmul_dtype)
    plain = replace_modules(module, lambda child: packed_linear(child, matmul_dtype=matmul_dtype)
                     if type(child) is nn.Linear else None)
    gated_post_ops = gated if GATE_POST_OPS else 0
    logger.debug("prepacked %d linear layers (%d with a fused activation, %d with a fused multiply)",
                 3 * gated + fused + plain, gated_post_ops + fused, gated_post_ops)
    return 3 * gated + fused + plain


def replace_modules(module: nn.Module, replacement: Callable[[nn.Module], nn.Module | None]) -> int:
    """Put ``replacement(child)``, in place, where each module inside ``module`` is, when it is not ``None``.

    :returns: The number of modules replaced.
    """
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            new = replacement(child)
            if new is not None:
                setattr(parent, name, new)
                replaced += 1
    return replaced


def _fused_mlp(module: nn.Module, matmul_dtype: torch.dtype | None) -> nn.Module | None:
    """``module``'s fused replacement if it is a gated MLP of known code, else ``None``."""
    if _is_gated_mlp(module):
        return GatedMLP(module, matmul_dtype, GATE_POST_OPS)
    if matmul_dtype != torch.int8 and _is_split_gated_mlp(module):
        return SplitGatedMLP(module, matmul_dtype, GATE_POST_OPS)
    return None


def _is_split_gated_mlp(module: nn.Module) -> bool:
    """Whether ``module`` computes ``Wo(act(a) * g)`` with ``a, g = Wi(x).chunk(2)``: its forward is
    ``ModernBertMLP.forward`` (or a bytecode-identical copy), its activation one with a post-op,
    its layers ``nn.Linear``, its dropout off."""
    return (
        code_key(type(module).forward) == _SPLIT_GATED_MLP
        and _post_op(getattr(module, "act", None)) is not None
        and all(type(getattr(module, name, None)) is nn.Linear for name in ("Wi", "Wo"))
        and module.Wi.out_features % 2 == 0
        and _inactive(getattr(module, "drop", None))
    )


def _is_gated_mlp(module: nn.Module) -> bool:
    """Whether ``module`` computes ``down_proj(act(gate_proj(x)) * up_proj(x))``: its forward is
    ``LlamaMLP.forward`` or GTE's (the same with a dropout before ``down_proj``, off), or a
    bytecode-identical copy, its activation one with an exact post-op, its layers ``nn.Linear``."""
    return (
        code_key(type(module).forward) in _GATED_MLPS
        and _post_op(getattr(module, "act_fn", None)) is not None
        and all(type(getattr(module, name, None)) is nn.Linear for name in ("gate_proj", "up_proj", "down_proj"))
        and _inactive(getattr(module, "dropout", nn.Identity()))
    )


def _inactive(dropout: object) -> bool:
    """Whether a dropout module passes its input through (no probability, or not training)."""
    return isinstance(dropout, nn.Identity) or (isinstance(dropout, nn.Dropout)
                                                and (dropout.p == 0 or not dropout.training))


def _fuse_activations(module: nn.Module, matmul_dtype: torch.dtype | None) -> int:
    """Fold the activation into its linear layer in each module whose forward is a known one
    (:data:`_FUSABLE`); the activation slot becomes ``nn.Identity``."""
    fused = 0
    for child in module.modules():
        pattern = _FUSABLE.get(_forward_code(type(child)))
        if pattern is None:
            continue
        linear_name, activation_name = pattern
        linear, activation = getattr(child, linear_name, None), getattr(child, activation_name, None)
        post_op = _post_op(activation)
        if type(linear) is nn.Linear and post_op is not None:
            setattr(child, linear_name, packed_linear(linear, post_op, matmul_dtype))
            setattr(child, activation_name, nn.Identity())
            fused += 1
    return fused


def _post_op(activation: object) -> tuple[str, str] | None:
    """oneDNN's exact equivalent of a transformers or torch activation module, if it has one."""
    kind = type(activation)
    if kind is activations.GELUActivation and getattr(activation, "act", None) is F.gelu:
        return ("gelu", "none")
    if kind is nn.GELU:
        return ("gelu", activation.approximate)  # type: ignore[attr-defined]
    if kind is activations.GELUTanh and getattr(getattr(activation, "act", None), "func", None) is F.gelu:
        return ("gelu", "tanh")  # the torch kernel, not the Python formula
    if kind is nn.ReLU:
        return ("relu", "")
    if kind in (nn.SiLU, getattr(activations, "SiLUActivation", nn.SiLU)):
        return ("swish", "")
    return None


def code_key(function: Callable[..., object] | None) -> tuple[bytes, tuple[str, ...]] | None:
    """Bytecode and names of a function: equal for transformers' "Copied from" duplicates. A
    decorated function is keyed by the function it wraps (``__wrapped__``, as ``functools.wraps``
    sets it): the wrapper's own code is the same whatever it wraps (transformers 5 puts
    ``deprecate_kwarg`` on most attention and layer forwards)."""
    if callable(function):
        function = inspect.unwrap(function)
    code = getattr(function, "__code__", None)
    return None if code is None else (code.co_code, code.co_names)


def _gated_mlps() -> frozenset[tuple[bytes, tuple[str, ...]] | None]:
    from transformers.models.gte.modeling_gte import GteMLP
    from transformers.models.llama.modeling_llama import LlamaMLP

    return frozenset({code_key(LlamaMLP.forward), code_key(GteMLP.forward)})


_GATED_MLPS = _gated_mlps()
"""The code of ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: Llama's MLP and its copies, and
GTE's (a dropout before ``down_proj``)."""


def _split_gated_mlp() -> tuple[bytes, tuple[str, ...]] | None:
    from transformers.models.modernbert.modeling_modernbert import ModernBertMLP

    return code_key(ModernBertMLP.forward)


_SPLIT_GATED_MLP = _split_gated_mlp()
"""The code of ``Wo(drop(act(a) * g))`` with ``a, g = Wi(x).chunk(2)``: ModernBERT's MLP."""


def _forward_code(kind: type) -> tuple[object, object]:
    """The code keys of a module class's forward and of the chunk function it hands
    ``apply_chunking_to_forward`` (DistilBERT's ``ff_chunk``; ``None`` where it has none)."""
    chunk = getattr(kind, "ff_chunk", None)
    return code_key(kind.forward), None if chunk is None else code_key(chunk)


def _fusable() -> dict[tuple[object, object], tuple[str, str]]:
    from transformers.models.bert.modeling_bert import BertIntermediate
    from transformers.models.distilbert.modeling_distilbert import FFN
    from transformers.models.jina_embeddings_v3.modeling_jina_embeddings_v3 import JinaEmbeddingsV3MLP
    from transformers.models.t5.modeling_t5 import T5DenseActDense

    return {
        # act(dense(x)): BERT's block and its ~60 copies (RoBERTa, XLM-R, ELECTRA, MPNet, ...)
        _forward_code(BertIntermediate): ("dense", "intermediate_act_fn"),
        # lin2(act(lin1(x))) in DistilBERT's ff_chunk: the activation reads lin1's output alone
        _forward_code(FFN): ("lin1", "activation"),
        # fc2(act(fc1(x))): Jina embeddings v3's MLP; wo(dropout(act(wi(x)))): T5's (sentence-t5)
        _forward_code(JinaEmbeddingsV3MLP): ("fc1", "activation_fn"),
        _forward_code(T5DenseActDense): ("wi", "act"),
    }


_FUSABLE = _fusable()
"""Forward code (:func:`_forward_code`) in which an activation applies to one linear layer's
output and nothing else -> (linear attribute, activation attribute)."""
