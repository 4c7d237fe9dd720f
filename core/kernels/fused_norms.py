"""RMSNorm in one pass: transformers' ``LlamaRMSNorm`` and its copies in a bfloat16 model on the
CPU run in poolrunner's kernel (:func:`~poolrunner.core.kernels.cpu_kernels.rms_norm`).

Only modules whose forward is ``LlamaRMSNorm.forward`` or a bytecode-identical copy (Qwen2,
Qwen3, Mistral, SmolLM2, ...) are replaced; Gemma's ``(1 + weight)`` norm and every other code
keep their own forward. The function does not change: the kernel computes what the module's
code does, in the same order of roundings.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from poolrunner.core.kernels import cpu_kernels
from poolrunner.core.kernels.onednn import code_key, replace_modules

_RMS_NORM = code_key(LlamaRMSNorm.forward)


class FusedRMSNorm(nn.Module):
    """A ``LlamaRMSNorm``-code module whose bfloat16 forward runs in one kernel pass.

    Keeps the module's ``weight`` and ``variance_epsilon``; inputs in another dtype go through the
    module's own forward.
    """

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon
        self._module_forward = type(norm).forward

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> ``[..., hidden]``, in the input's dtype."""
        if hidden_states.dtype != torch.bfloat16:
            return self._module_forward(self, hidden_states)
        return cpu_kernels.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def fuse_rms_norms(module: nn.Module) -> int:
    """Replace, in place, each bfloat16 ``LlamaRMSNorm``-code module inside ``module`` by a
    :class:`FusedRMSNorm`; the caller has checked that the kernels run bfloat16 here.

    :returns: The number of modules replaced.
    """
    return replace_modules(module, lambda child: FusedRMSNorm(child) if _is_bf16_llama_rms_norm(child) else None)


def _is_bf16_llama_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (code_key(type(module).forward) == _RMS_NORM and isinstance(weight, torch.Tensor)
            and weight.dtype == torch.bfloat16 and hasattr(module, "variance_epsilon"))
