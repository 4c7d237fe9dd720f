"""Reading a PEFT LoRA folder: ``adapter_config.json`` checked field by field, and the tensors of
``adapter_model.safetensors`` sorted into LoRA pairs and ``modules_to_save`` weights.

What is served is what PEFT's ``LoraLayer.forward`` computes for a plain ``nn.Linear`` (or
transformers' ``Conv1D``) at inference: ``base(x) + scale * B(A(x))`` with ``scale = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``); ``lora_dropout`` is inert at inference. Every other
variant changes that sum, so a config asking for one is refused naming the field.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attrs import field, frozen

from poolrunner.core import ModelLoadError

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
"""PEFT's prefix of every saved tensor: the wrapped model's module paths follow it."""

# Fields that never change an inference forward: initialisation recipes, bookkeeping, dropout.
_INERT = frozenset({
    "base_model_name_or_path", "revision", "task_type", "inference_mode", "init_lora_weights", "lora_dropout",
    "auto_mapping", "peft_version", "megatron_core", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
    "qalora_group_size", "exclude_modules", "ensure_weight_tying", "layers_pattern",
})
# Fields whose values are served (checked below).
_SERVED = frozenset({"peft_type", "r", "lora_alpha", "use_rslora", "target_modules", "modules_to_save",
                     "fan_in_fan_out", "bias"})


@frozen(kw_only=True, eq=False)
class LoraPair:
    """One adapted layer: ``delta = scale * (x @ a.T) @ b.T``.

    :ivar a: ``[r, in_features]`` float32 (PEFT's ``lora_A.weight``).
    :ivar b: ``[out_features, r]`` float32 (PEFT's ``lora_B.weight``).
    :ivar scale: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``.
    """

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    at: torch.Tensor = field(init=False)
    """``a.T`` contiguous, ``[in_features, r]``: the first product's right operand."""
    bt: torch.Tensor = field(init=False)
    """``scale * b.T`` contiguous, ``[r, out_features]``: the second product's, scale folded in once."""

    @at.default
    def _at(self) -> torch.Tensor:
        return self.a.T.contiguous()

    @bt.default
    def _bt(self) -> torch.Tensor:
        return (self.b * self.scale).T.contiguous()


@frozen(kw_only=True, eq=False)
class PeftFolder:
    """A checked PEFT LoRA folder, module paths as PEFT saved them (``KEY_PREFIX`` removed).

    :ivar pairs: Adapted module path -> its :class:`LoraPair`.
    :ivar saved: ``modules_to_save`` module path -> its whole state dict (a trained head).
    :ivar rank: ``r``.
    """

    path: Path
    pairs: dict[str, LoraPair]
    saved: dict[str, dict[str, torch.Tensor]]
    rank: int


def read_folder(path: Path, max_rank: int) -> PeftFolder:
    """Read and check the PEFT LoRA folder ``path``.

    :raises ModelLoadError: naming the file and the field or tensor: a missing or unreadable
        file, a variant PEFT computes differently (DoRA, ``bias`` other than ``none``,
        ``lora_bias``, ``rank_pattern``, ``layers_to_transform``...), embedding-layer LoRA, a rank
        above ``max_rank``, a tensor of another shape than ``r`` says or outside
        ``target_modules`` / ``modules_to_save``.
    """
    config = _read_config(path / CONFIG_FILE)
    rank = config["r"]
    if not isinstance(rank, int) or rank < 1:
        raise _refused(path / CONFIG_FILE, f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise _refused(path / CONFIG_FILE, f"r {rank} is above max_lora_rank {max_rank} (--max-lora-rank)")
    alpha = config.get("lora_alpha", 8)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _read_tensors(path / WEIGHTS_FILE)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    saved: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        where = f"{path / WEIGHTS_FILE}: tensor {key!r}"
        if not key.startswith(KEY_PREFIX):
            raise ModelLoadError(f"{where} does not start with {KEY_PREFIX!r}: not a PEFT adapter")
        name = key.removeprefix(KEY_PREFIX)
        kind = re.search(r"\.(lora_[A-Za-z_]+)(?:\.weight)?$", name)  # embeddings: no .weight
        if kind is None:
            module, parameter = _saved_module(name, config.get("modules_to_save") or [], where)
            saved.setdefault(module, {})[parameter] = tensor
        elif kind.group(1) in ("lora_A", "lora_B"):
            module = name[: kind.start()]
            _check_target(module, config, where)
            pairs.setdefault(module, {})[kind.group(1)] = tensor
        elif kind.group(1).startswith("lora_embedding"):
            raise ModelLoadError(f"{where}: LoRA on an embedding layer is not served")
        else:
            raise ModelLoadError(f"{where}: {kind.group(1)} is not served (plain LoRA only: no DoRA magnitudes)")
    return PeftFolder(path=path, pairs={module: _pair(path, module, weights, rank, scale)
                                        for module, weights in pairs.items()}, saved=saved, rank=rank)


def _read_config(file: Path) -> dict[str, Any]:
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{file} is missing: not a PEFT adapter folder") from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{file} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise _refused(file, "is not a JSON object")
    if config.get("peft_type") != "LORA":
        raise _refused(file, f"peft_type {config.get('peft_type')!r} is not served (only 'LORA')")
    if config.get("bias", "none") != "none":
        raise _refused(file, f"bias {config['bias']!r} is not served (only 'none')")
    if config.get("fan_in_fan_out") not in (None, False, True):
        raise _refused(file, f"fan_in_fan_out must be true or false, got {config['fan_in_fan_out']!r}")
    for key, value in config.items():
        if key not in _INERT and key not in _SERVED and value not in (None, False, {}, []):
            raise _refused(file, f"{key} {value!r:.80} is not served (DoRA, LoRA biases, per-module ranks and "
                                 "other variants compute differently)")
    if "r" not in config:
        raise _refused(file, "has no r")
    return config


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(file)
    except FileNotFoundError:
        raise ModelLoadError(f"{file} is missing (adapter_model.bin is not read: safetensors only)") from None
    except (OSError, SafetensorError, ValueError) as exc:
        raise ModelLoadError(f"{file} cannot be read: {exc}") from None


def _check_target(module: str, config: dict[str, Any], where: str) -> None:
    """PEFT's rule: a list names module suffixes, a string is a regular expression matching the
    whole path."""
    targets = config.get("target_modules")
    if isinstance(targets, str):
        matches = re.fullmatch(targets, module) is not None
    else:
        matches = any(module == t or module.endswith("." + t) for t in targets or [])
    if not matches:
        raise ModelLoadError(f"{where}: module {module!r} is not in target_modules {targets!r}")


def _saved_module(name: str, modules_to_save: list[str], where: str) -> tuple[str, str]:
    """``(module path, parameter name)`` of a ``modules_to_save`` tensor."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        if any(module == m or module.endswith("." + m) for m in modules_to_save):
            return module, ".".join(parts[cut:])
    raise ModelLoadError(f"{where} is neither a LoRA weight nor in modules_to_save {modules_to_save!r}")


def _pair(path: Path, module: str, weights: dict[str, torch.Tensor], rank: int, scale: float) -> LoraPair:
    where = f"{path / WEIGHTS_FILE}: module {module!r}"
    if set(weights) != {"lora_A", "lora_B"}:
        raise ModelLoadError(f"{where} has {sorted(weights)} but needs lora_A and lora_B")
    a, b = weights["lora_A"], weights["lora_B"]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
        raise ModelLoadError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not "
                             f"[r, in] and [out, r] with r {rank} (adapter_config.json)")
    return LoraPair(a=a.float(), b=b.float(), scale=float(scale))


def _refused(file: Path, reason: str) -> ModelLoadError:
    return ModelLoadError(f"{file}: {reason}")
