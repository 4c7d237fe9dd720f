"""Builds ColBERT model folders for the tests: a backbone plus a seeded projection, laid out as
PyLate or Stanford ColBERT save them. Imported by the test modules (not a test module itself)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

BACKBONE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "vocab.txt")


def projection(hidden_size: int, dim: int = 96, seed: int = 7) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(dim, hidden_size, generator=generator) / hidden_size**0.5


NEUTRAL = {"query_prefix": "", "document_prefix": "", "do_query_expansion": False, "skiplist_words": [],
           "query_length": None, "document_length": None}
"""PyLate's tokenization settings with every one off: queries and documents tokenized as texts."""


def pylate_folder(backbone: Path, folder: Path, weight: torch.Tensor, settings: dict | None = None) -> Path:
    """PyLate's layout: [Transformer, pylate Dense] in modules.json, the projection in 1_Dense/,
    ``settings`` (default :data:`NEUTRAL`) in config_sentence_transformers.json."""
    folder.mkdir(parents=True)
    (folder / "config_sentence_transformers.json").write_text(json.dumps(NEUTRAL if settings is None else settings))
    for name in BACKBONE_FILES:
        if (backbone / name).is_file():
            shutil.copy(backbone / name, folder / name)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"},
    ]))
    (folder / "1_Dense").mkdir()
    (folder / "1_Dense" / "config.json").write_text(json.dumps({
        "in_features": weight.shape[1], "out_features": weight.shape[0], "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity",
    }))
    save_file({"linear.weight": weight.contiguous()}, folder / "1_Dense" / "model.safetensors")
    return folder


def stanford_folder(backbone: Path, folder: Path, weight: torch.Tensor) -> Path:
    """colbert-ai's layout: architecture HF_ColBERT, `bert.*` backbone keys and `linear.weight`
    in one model.safetensors."""
    folder.mkdir(parents=True)
    for name in BACKBONE_FILES[2:]:
        if (backbone / name).is_file():
            shutil.copy(backbone / name, folder / name)
    config = json.loads((backbone / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["HF_ColBERT"]}))
    state = {f"bert.{key}": value for key, value in load_file(backbone / "model.safetensors").items()
             if not key.startswith("pooler.")}
    save_file({**state, "linear.weight": weight.contiguous()}, folder / "model.safetensors")
    return folder
