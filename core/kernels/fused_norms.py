"""RMSNorm in one pass: transformers' ``LlamaRMSNorm`` and its copies on the CPU run in
poolrunner's kernel (:func:`~poolrunner.core.kernels.cpu_kernels.rms_norm`), in the dtypes it
takes here (float32; bfloat16 with AVX512-BF16).

Only modules whose forward is ``LlamaRMSNorm.forward`` or a bytecode-identical copy (Qwen2,
Qwen3, Mistral, SmolLM2, ...) are replaced; Gemma's ``(1 + weight)`` norm and every other code
keep their own forward. The function does not change: the kernel computes what the module's
code does, in the same order of roundings.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from poolrunner.core.kernels import cpu_kernels
from poolrunner.core.kernels.onednn import code_key, replace_modules

_RMS_NORM = code_key(LlamaRMSNorm.forward)


class FusedRMSNorm(nn.Module):
    """A ``LlamaRMSNorm``-code module whose forward runs in one kernel pass.

    Keeps the module's ``weight`` and ``variance_epsilon``; an input of another dtype than the
    weight's goes through the module's own forward.
    """

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon
        self._module_forward = type(norm).forward

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> ``[..., hidden]``, in the input's dtype."""
        if hidden_states.dtype != self.weight.dtype:
            return self._module_forward(self, hidden_states)
        return cpu_kernels.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def fuse_rms_norms(module: nn.Module, dtypes: Collection[torch.dtype]) -> int:
    """Replace, in place, each ``LlamaRMSNorm``-code module inside ``module`` whose weight is in
    one of ``dtypes`` by a :class:`FusedRMSNorm`.

    :param dtypes: Dtypes the kernel runs in here (:func:`~poolrunner.core.kernels.cpu_kernels.supported_dtypes`).
    :returns: The number of modules replaced.
    """
    return replace_modules(module, lambda child: FusedRMSNorm(child) if _is_llama_rms_norm(child, dtypes) else None)


def _is_llama_rms_norm(module: nn.Module, dtypes: Collection[torch.dtype]) -> bool:
    weight = getattr(module, "weight", None)
    return (code_key(type(module).forward) == _RMS_NORM and isinstance(weight, torch.Tensor)
            and weight.dtype in dtypes and hasattr(module, "variance_epsilon"))
