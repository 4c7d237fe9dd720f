"""The ColBERT pooler and the projection layouts it reads.

Supported layouts (the projection is ``y = W h (+ b)``, no activation other than identity):

- PyLate: ``modules.json`` lists ``pylate.models.Dense.Dense`` at ``path``; ``<path>/config.json``
  gives ``in_features``, ``out_features``, ``bias`` and ``activation_function`` (must be
  ``Identity``), ``<path>/model.safetensors`` (or ``pytorch_model.bin``) holds ``linear.weight``
  (and ``linear.bias``).
- Stanford ColBERT (colbert-ai): architecture ``HF_ColBERT``; ``linear.weight`` sits in the main
  ``model.safetensors`` (or ``pytorch_model.bin``) beside the backbone's weights, without bias.

Not applied (documented limits): the ``[Q]``/``[D]`` marker tokens and query augmentation with
``[MASK]`` tokens, which PyLate and colbert-ai add while tokenizing, and the punctuation skiplist
of documents. Pass the markers in the text yourself if your model expects them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from poolrunner.core import ModelConfig, ModelLoadError, Pooler, PoolingMetadata, PoolingTask, read_modules

_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def _read_state(folder: Path) -> dict[str, torch.Tensor]:
    for name in _WEIGHT_FILES:
        path = folder / name
        if path.is_file():
            if name.endswith(".safetensors"):
                return load_file(path)
            return torch.load(path, map_location="cpu", weights_only=True)
    raise ModelLoadError(f"{folder}: no projection weights ({' or '.join(_WEIGHT_FILES)})")


def _pylate_dense(folder: Path) -> Path | None:
    return next((module.path for module in read_modules(folder)
                 if module.type.startswith("pylate.") and module.type.endswith(".Dense")), None)


def load_projection(model_config: ModelConfig) -> nn.Linear:
    """The ColBERT projection of the folder, as a float32 ``nn.Linear(hidden_size, dim)``.

    :raises ModelLoadError: for a missing or misshapen projection, or a non-identity activation.
    """
    folder = Path(model_config.path)
    dense = _pylate_dense(folder)
    if dense is not None:
        config = json.loads((dense / "config.json").read_text(encoding="utf-8"))
        activation = str(config.get("activation_function") or "torch.nn.modules.linear.Identity")
        if activation.rsplit(".", 1)[-1] != "Identity":
            raise ModelLoadError(f"{dense}: ColBERT projection activation {activation!r} is not supported (Identity)")
        state = _read_state(dense)
        source = dense
    else:
        state = _read_state(folder)
        source = folder
    weight = state.get("linear.weight")
    if weight is None or weight.ndim != 2 or weight.shape[1] != model_config.hidden_size:
        shape = None if weight is None else list(weight.shape)
        raise ModelLoadError(
            f"{source}: expected a ColBERT projection `linear.weight` of shape [dim, {model_config.hidden_size}], "
            f"found {shape}"
        )
    bias = state.get("linear.bias")
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    linear.load_state_dict({"weight": weight.float(), **({"bias": bias.float()} if bias is not None else {})})
    return linear


class ColbertPooler(Pooler):
    """``token_embed`` for ColBERT: ``normalize(W h)`` for every prompt token,
    ``[num_tokens, dim]`` float32. Special tokens are kept, as PyLate keeps them."""

    def __init__(self, projection: nn.Linear) -> None:
        super().__init__()
        self.projection = projection

    @classmethod
    def from_model_config(cls, model_config: ModelConfig) -> ColbertPooler:
        return cls(load_projection(model_config))

    def get_supported_tasks(self) -> frozenset[PoolingTask]:
        return frozenset({"token_embed"})

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
        projected = F.normalize(self.projection(hidden_states.float()), dim=-1)
        return list(torch.split(projected, metadata.prompt_lens.tolist()))
