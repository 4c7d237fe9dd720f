"""An attention block's query, key and value projections as one prepacked product.

The three read the same input; at the row counts of small steps a product is mostly call overhead,
so one oneDNN call instead of three saves most of two calls' time: bf16 on 2 Zen 4 cores (best of
3), all-MiniLM-L6-v2's ``[31, 384] x [384, 3 * 384]`` 87 us against 140 us for the three,
SmolLM2-135M's ``[31, 576] x [576, 576 + 2 * 192]`` 104 against 148 us; from 256 rows on the two
take the same time. The weights become one tensor, of which the three layers' weights and biases
are views: no copy is kept besides the prepacked one, and the parameters keep their names (the
three become plain ``nn.Linear`` layers over those views, for transformers' own forward where it
still runs). Where the three are not prepacked alike (int8 layers, bf16-mixed ones of different
dtypes, a layer a plugin replaced) nothing changes.
"""

from __future__ import annotations

import torch
from torch import nn

from poolrunner.core.kernels.onednn import PackedLinear, joined_linear


class JoinedProjections(nn.Module):
    """``[..., hidden]`` -> the projections' outputs, ``[..., size]`` views of one product each,
    each what its own layer computes, in the product's dtype and rounding."""

    def __init__(self, product: PackedLinear, sizes: tuple[int, ...]) -> None:
        super().__init__()
        self.product = product
        self.sizes = sizes

    @classmethod
    def install(cls, attention: nn.Module, names: tuple[str, ...]) -> None:
        """Put one on ``attention`` (as ``projections``) when its layers ``names`` are prepacked
        alike (:class:`~poolrunner.core.kernels.onednn.PackedLinear`, one activation and dtype, all
        with a bias or none); they become ``nn.Linear`` layers over views of the joined weights."""
        linears = [getattr(attention, name) for name in names]
        first = linears[0]
        if not all(type(linear) is PackedLinear and linear.activation == first.activation
                   and linear.matmul_dtype == first.matmul_dtype and (linear.bias is None) == (first.bias is None)
                   for linear in linears):
            return
        product, parts = joined_linear(linears)
        attention.projections = cls(product, tuple(linear.out_features for linear in linears))
        for name, part in zip(names, parts, strict=True):
            setattr(attention, name, part)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.product(hidden_states).split(self.sizes, dim=-1)


def project(attention: nn.Module, names: tuple[str, ...], hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The layers ``names`` of ``attention`` applied to ``hidden_states``: one product where they
    were joined, else each layer called."""
    joined = getattr(attention, "projections", None)
    if isinstance(joined, JoinedProjections):
        return joined(hidden_states)
    return tuple(getattr(attention, name)(hidden_states) for name in names)
