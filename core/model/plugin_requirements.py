"""Model folders that declare a pipeline only a contrib plugin runs.

Core names those plugins only as strings, so that loading such a folder without its plugin
fails at load with the command that fixes it, instead of silently running the bare backbone
with a built-in pooler (a SPLADE model would then return dense mean vectors).
"""

from __future__ import annotations

import json
from pathlib import Path

from poolrunner.core.errors import ModelLoadError
from poolrunner.core.types import RequiredPlugin

_ST_PREFIX = "sentence_transformers."
# sentence-transformers SparseEncoder modules (class names): SPLADE pipelines.
_SPLADE_MODULES = frozenset({"MLMTransformer", "SpladePooling"})
_SPLADE = ("splade", "poolrunner-splade")
_COLBERT = ("colbert", "poolrunner-colbert")
# Stanford ColBERT (colbert-ai) saves its checkpoints under this architecture name.
_COLBERT_ARCHITECTURE = "HF_ColBERT"


def required_plugin(folder: Path, architecture: str) -> RequiredPlugin | None:
    """The plugin ``folder`` needs, judged from its ``modules.json`` and architecture.

    - a sentence-transformers module ``MLMTransformer`` or ``SpladePooling`` (a
      ``SparseEncoder`` folder): ``splade`` from ``poolrunner-splade``;
    - a ``pylate.*`` module (a PyLate ColBERT folder) or the architecture ``HF_ColBERT``
      (a Stanford ColBERT checkpoint): ``colbert`` from ``poolrunner-colbert``.

    :returns: ``None`` for every other folder.
    :raises ModelLoadError: if ``modules.json`` exists but cannot be read.
    """
    for module_type in _module_types(folder):
        if module_type.startswith(_ST_PREFIX) and module_type.rsplit(".", 1)[-1] in _SPLADE_MODULES:
            return _required(_SPLADE, f"modules.json lists {module_type}")
        if module_type.startswith("pylate."):
            return _required(_COLBERT, f"modules.json lists {module_type}")
    if architecture == _COLBERT_ARCHITECTURE:
        return _required(_COLBERT, f"config.json names the architecture {architecture}")
    return None


def _required(plugin: tuple[str, str], reason: str) -> RequiredPlugin:
    name, dist = plugin
    return RequiredPlugin(name=name, dist=dist, reason=reason)


def _module_types(folder: Path) -> list[str]:
    path = folder / "modules.json"
    if not path.is_file():
        return []
    try:
        modules = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    return [str(module.get("type", "")) for module in modules if isinstance(module, dict)]
