"""Rotary position embeddings in one pass: the attention layers of Llama's family (Llama, SmolLM2,
Qwen2, Qwen3, Mistral, ... whose code calls ``apply_rotary_pos_emb``) and of ModernBERT on the CPU
rotate their queries and keys in poolrunner's kernel (:func:`~poolrunner.core.kernels.cpu_kernels.rotary`)
instead of the formula's ten element-wise passes (ModernBERT's: fourteen, with its conversions to
float32 and back), with the formula's roundings.

transformers' attention code calls its module's global ``apply_rotary_pos_emb``; patching that
global would change every model of the process. Instead each attention module gets, as its own
``forward``, the same function (the same code, unwrapped from transformers' keyword-renaming
decorator, which only maps a caller's deprecated ``past_key_values`` to ``cache``; the decoder
layers pass ``cache``) over a copy of its globals where that one name is the kernel's. Only a
module whose global is ``apply_rotary_pos_emb`` of Llama's or ModernBERT's code (bytecode-identical
copies, with Llama's ``rotate_half``) is changed: Phi's partial rotary calls it on the rotated
slice and is; GPT-NeoX's, Cohere's interleaved and OLMo2's keep theirs.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn
from transformers.models.llama import modeling_llama
from transformers.models.modernbert import modeling_modernbert

from poolrunner.core.kernels import cpu_kernels
from poolrunner.core.kernels.onednn import code_key

ROTARY_NAME = "apply_rotary_pos_emb"


def _function(rotary: Any) -> Callable[..., Any] | None:
    """The Python function behind a module's ``apply_rotary_pos_emb``: the function itself, or,
    where the ``kernels`` package is installed (transformers requires it), the one its hub
    wrapper (a ``Func`` module calling ``func``) was made from; ``None`` for anything else."""
    if isinstance(rotary, types.FunctionType):
        return inspect.unwrap(rotary)
    forward = getattr(type(rotary), "forward", None)
    code = getattr(forward, "__code__", None)
    if isinstance(rotary, nn.Module) and code is not None and "func" in code.co_freevars:
        wrapped = forward.__closure__[code.co_freevars.index("func")].cell_contents
        return inspect.unwrap(wrapped) if isinstance(wrapped, types.FunctionType) else None
    return None


def _code(module: types.ModuleType) -> tuple[bytes, tuple[str, ...]] | None:
    """The code key of ``module``'s ``apply_rotary_pos_emb``."""
    formula = _function(module.apply_rotary_pos_emb)
    assert formula is not None, f"{module.__name__}.apply_rotary_pos_emb is neither a function nor its hub wrapper"
    return code_key(formula)


_ROUND_ONCE = {_code(modeling_llama): False, _code(modeling_modernbert): True}
"""Each known formula's code key, and whether it computes in float32 and rounds once (ModernBERT's)
rather than in the tensors' dtype (Llama's): :func:`~poolrunner.core.kernels.cpu_kernels.rotary`'s
``round_once``."""
_ROTATE_HALF = code_key(modeling_llama.rotate_half)


def fuse_rotary(module: nn.Module, dtypes: Collection[torch.dtype]) -> int:
    """Give each attention module inside ``module`` that calls Llama's ``apply_rotary_pos_emb``
    a forward that rotates in the kernel (in ``dtypes``: the kernel's, from
    :func:`~poolrunner.core.kernels.cpu_kernels.supported_dtypes`; others run the formula).

    :returns: The number of modules changed.
    """
    if not dtypes:
        return 0
    changed = 0
    for child in module.modules():
        forward = _fused_forward(type(child).forward, frozenset(dtypes))
        if forward is not None:
            child.forward = types.MethodType(forward, child)
            changed += 1
    return changed


@functools.cache
def _fused_forward(forward: Callable[..., Any], dtypes: frozenset[torch.dtype]) -> Callable[..., Any] | None:
    """``forward``'s code over its globals with the kernel as ``apply_rotary_pos_emb``, or ``None``
    where its rotary is not Llama's. One per class, shared by its modules."""
    inner = inspect.unwrap(forward)
    code = getattr(inner, "__code__", None)
    if code is None or ROTARY_NAME not in code.co_names:
        return None
    module_globals = inner.__globals__
    formula = _function(module_globals.get(ROTARY_NAME))
    # The rotate_half it calls is the one of its own module (another, where it was imported).
    key = code_key(formula) if formula is not None else None
    if key not in _ROUND_ONCE or code_key(formula.__globals__.get("rotate_half")) != _ROTATE_HALF:
        return None
    rotary = _rotary_in_kernel(formula, dtypes, _ROUND_ONCE[key])
    fused = types.FunctionType(code, {**module_globals, ROTARY_NAME: rotary},
                               inner.__name__, inner.__defaults__, inner.__closure__)
    fused.__kwdefaults__ = inner.__kwdefaults__
    fused.__qualname__, fused.__module__ = inner.__qualname__, inner.__module__
    return fused


def _rotary_in_kernel(formula: Callable[..., Any], dtypes: frozenset[torch.dtype],
                      round_once: bool) -> Callable[..., Any]:
    """``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` in the kernel where it takes the
    arguments (``q`` and ``k`` ``[batch, heads, tokens, head_dim]``, one dtype of ``dtypes``),
    else ``formula`` itself; ``round_once``: see :data:`_ROUND_ONCE`."""

    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        if unsqueeze_dim == 1 and _kernel_takes(q, k, cos, sin, dtypes):
            return cpu_kernels.rotary(q, cos, sin, round_once), cpu_kernels.rotary(k, cos, sin, round_once)
        return formula(q, k, cos, sin, unsqueeze_dim)

    return apply_rotary_pos_emb


def _kernel_takes(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  dtypes: frozenset[torch.dtype]) -> bool:
    if q.dtype not in dtypes or any(t.dtype != q.dtype or t.device.type != "cpu" for t in (q, k, cos, sin)):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    head_dim = q.shape[-1]
    return (head_dim % 2 == 0 and k.shape[-1] == head_dim and cos.shape[-1] == head_dim
            and q.shape[2] == k.shape[2] == cos.shape[1] and k.shape[0] == q.shape[0]
            and cos.shape[0] in (1, q.shape[0])
            and all(t.stride(-1) == 1 for t in (q, k, cos, sin)) and sin.stride() == cos.stride())
