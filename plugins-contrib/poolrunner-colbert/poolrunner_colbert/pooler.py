"""The ColBERT pooler and the PyLate projection it reads.

The projection is ``y = W h (+ b)``, no activation other than identity: ``modules.json`` lists
``pylate.models.Dense.Dense`` at ``path``; ``<path>/config.json`` gives ``in_features``,
``out_features``, ``bias`` and ``activation_function`` (must be ``Identity``),
``<path>/model.safetensors`` (or ``pytorch_model.bin``) holds ``linear.weight`` (and ``linear.bias``).

Refused at load (:func:`check_tokenization`): what PyLate and colbert-ai do while tokenizing,
which this plugin does not (poolrunner tokenizes a query and a document alike): the ``[Q]`` /
``[D]`` marker tokens, query expansion with ``[MASK]`` tokens, the documents' skiplist, and
query / document lengths below the model's. PyLate applies its defaults for each setting its
``config_sentence_transformers.json`` leaves out; colbert-ai (a Stanford ``HF_ColBERT``
checkpoint) always marks and expands. So a PyLate folder is served only where that file sets
every one of them off, and then gives the projection of the text's own tokens, which is still
not PyLate's ``encode``: PyLate inserts its prefix's token id after the first token even for an
empty prefix. Serving real ColBERT checkpoints needs the markers and the expansion applied while
tokenizing, which poolrunner's tokenization offers no plugin hook for yet.
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


_PYLATE_NEUTRAL = {"query_prefix": "", "document_prefix": "", "do_query_expansion": False, "skiplist_words": []}
"""PyLate's tokenization settings, each at the value that leaves a text as poolrunner tokenizes it
(PyLate's defaults, used when a key is missing: ``"[Q] "``, ``"[D] "``, ``True``, punctuation)."""
_PYLATE_LENGTHS = ("query_length", "document_length")
"""PyLate's per-role truncation lengths (defaults 32 and 180): none, or at least the model's."""


def check_tokenization(model_config: ModelConfig) -> Path:
    """The folder of a PyLate folder's projection (its ``pylate.models.Dense.Dense`` module).

    :raises ModelLoadError: for a Stanford ColBERT checkpoint, or a PyLate folder whose
        settings change a query's or a document's tokens (see the module's docstring), naming them."""
    folder = Path(model_config.path)
    dense = _pylate_dense(folder)
    if dense is None:
        raise ModelLoadError(
            f"{folder}: colbert-ai marks queries and documents with [unused0] / [unused1] and expands queries with "
            "[MASK] tokens while tokenizing, which poolrunner-colbert does not: its vectors would not be the model's")
    path = folder / "config_sentence_transformers.json"
    settings = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    changed = [key for key, neutral in _PYLATE_NEUTRAL.items() if settings.get(key) != neutral]
    changed += [key for key in _PYLATE_LENGTHS if key not in settings or not (
        settings[key] is None or (isinstance(settings[key], int) and settings[key] >= model_config.max_model_len))]
    if changed:
        found = ", ".join(f"{key} {json.dumps(settings[key])}" if key in settings else f"{key} (unset: PyLate's "
                          "default)" for key in changed)
        where = path if path.is_file() else f"{folder} (no config_sentence_transformers.json)"
        raise ModelLoadError(
            f"{where}: PyLate tokenizes queries and documents with {found}, which poolrunner-colbert does not apply: "
            f"its vectors would not be the model's. Served only with {json.dumps(_PYLATE_NEUTRAL)} and "
            f"{' / '.join(_PYLATE_LENGTHS)} null or at least max_model_len ({model_config.max_model_len})")
    return dense


def load_projection(dense: Path, hidden_size: int) -> nn.Linear:
    """The ColBERT projection in PyLate's ``dense`` module folder, as a float32
    ``nn.Linear(hidden_size, dim)``.

    :raises ModelLoadError: for a missing or misshapen projection, or a non-identity activation.
    """
    config = json.loads((dense / "config.json").read_text(encoding="utf-8"))
    activation = str(config.get("activation_function") or "torch.nn.modules.linear.Identity")
    if activation.rsplit(".", 1)[-1] != "Identity":
        raise ModelLoadError(f"{dense}: ColBERT projection activation {activation!r} is not supported (Identity)")
    state = _read_state(dense)
    weight = state.get("linear.weight")
    if weight is None or weight.ndim != 2 or weight.shape[1] != hidden_size:
        shape = None if weight is None else list(weight.shape)
        raise ModelLoadError(
            f"{dense}: expected a ColBERT projection `linear.weight` of shape [dim, {hidden_size}], "
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
        """:raises ModelLoadError: for a folder :func:`check_tokenization` refuses, or a bad projection."""
        return cls(load_projection(check_tokenization(model_config), model_config.hidden_size))

    def get_supported_tasks(self) -> frozenset[PoolingTask]:
        return frozenset({"token_embed"})

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
        projected = F.normalize(self.projection(hidden_states.float()), dim=-1)
        return list(torch.split(projected, metadata.prompt_lens.tolist()))
