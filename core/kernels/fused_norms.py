"""RMSNorm in one pass: transformers' ``LlamaRMSNorm`` and Gemma's RMSNorm, with their copies, on
the CPU run in poolrunner's kernel (:func:`~poolrunner.core.kernels.cpu_kernels.rms_norm`), in the
dtypes it takes here (float32; bfloat16 with AVX512-BF16).

Only modules whose code is ``LlamaRMSNorm``'s (Qwen2, Qwen3, Mistral, SmolLM2, ...), T5's
``T5LayerNorm`` (the same numerics in other code, when its weight has the input's dtype) or
``GemmaRMSNorm``'s (Gemma 1-3, EmbeddingGemma: ``x * rsqrt(mean(x**2) + eps) * (1 + weight)`` in
float32, rounded once) are replaced, bytecode-identical copies included; every other code keeps
its own forward. The function does not change: the kernel computes what the module's code does,
in the same order of roundings.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

from poolrunner.core.kernels import cpu_kernels
from poolrunner.core.kernels.onednn import code_key, replace_modules

_LLAMA = (code_key(LlamaRMSNorm.forward), None)
_T5 = (code_key(T5LayerNorm.forward), None)  # Llama's numerics in other code
_GEMMA = (code_key(GemmaRMSNorm.forward), code_key(GemmaRMSNorm._norm))
_EPSILON = {_LLAMA: "variance_epsilon", _T5: "variance_epsilon", _GEMMA: "eps"}
"""Each known code (its forward's and, for Gemma's, its ``_norm``'s) -> its epsilon's attribute."""


class FusedRMSNorm(nn.Module):
    """An RMSNorm module of known code (``LlamaRMSNorm``'s or ``GemmaRMSNorm``'s) whose forward
    runs in one kernel pass.

    Keeps the module's ``weight`` and its epsilon under its name (``variance_epsilon``, Gemma's
    ``eps``); an input of another dtype than the weight's goes through the module's own forward.
    """

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        code = _code(norm)
        self.weight = norm.weight
        self.unit_offset = code == _GEMMA
        self._epsilon_name = _EPSILON[code]
        setattr(self, self._epsilon_name, getattr(norm, self._epsilon_name))
        self._module = type(norm)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> ``[..., hidden]``, in the input's dtype."""
        if hidden_states.dtype != self.weight.dtype:
            return self._module.forward(self, hidden_states)
        return cpu_kernels.rms_norm(hidden_states, self.weight, getattr(self, self._epsilon_name), self.unit_offset)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """Gemma's helper, for its own forward on another dtype."""
        return self._module._norm(self, x)


def fuse_rms_norms(module: nn.Module, dtypes: Collection[torch.dtype]) -> int:
    """Replace, in place, each RMSNorm module of known code inside ``module`` whose weight is in
    one of ``dtypes`` by a :class:`FusedRMSNorm`.

    :param dtypes: Dtypes the kernel runs in here (:func:`~poolrunner.core.kernels.cpu_kernels.supported_dtypes`).
    :returns: The number of modules replaced.
    """
    return replace_modules(module, lambda child: FusedRMSNorm(child) if _fusable(child, dtypes) else None)


def _code(module: nn.Module) -> tuple[object, object]:
    """The code key of ``module``'s forward and, where its forward calls one, of its ``_norm``."""
    kind = type(module)
    forward = code_key(kind.forward)
    return (forward, code_key(kind._norm)) if forward == _GEMMA[0] and hasattr(kind, "_norm") else (forward, None)


def _fusable(module: nn.Module, dtypes: Collection[torch.dtype]) -> bool:
    weight = getattr(module, "weight", None)
    code = _code(module)
    return (code in _EPSILON and isinstance(weight, torch.Tensor) and weight.dtype in dtypes
            and weight.dim() == 1 and hasattr(module, _EPSILON[code]))
