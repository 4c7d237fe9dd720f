"""Folder formats that only a contrib plugin runs, for the hint when that plugin is missing.

Plugins recognise their own folders (the ``claim_model_folder`` hook). This table is consulted
only when no installed plugin claims a folder: a folder in one of these formats then fails at
load naming the distribution to install, instead of silently running the bare backbone with a
built-in pooler (a SPLADE model would return dense mean vectors). Core names the plugins only
as strings; adding a format of your own needs no entry here.
"""

from __future__ import annotations

from pathlib import Path

from attrs import frozen

from poolrunner.core.model.st_metadata import read_modules
from poolrunner.core.types import RequiredPlugin


@frozen
class FolderFormat:
    """Markers of one format: ``modules.json`` module types, or an architecture name.

    :ivar plugin: The plugin that runs it (its entry-point name).
    :ivar dist: The distribution to install for it.
    :ivar package: A module type from this package marks the format (``"pylate."``)...
    :ivar classes: ...when its class name is one of these (``None``: any class).
    :ivar architectures: ``config.json`` architecture names that mark the format.
    """

    plugin: str
    dist: str
    package: str | None = None
    classes: frozenset[str] | None = None
    architectures: tuple[str, ...] = ()

    def marks(self, module_type: str) -> bool:
        return (self.package is not None and module_type.startswith(self.package)
                and (self.classes is None or module_type.rsplit(".", 1)[-1] in self.classes))


FOLDER_FORMATS = (
    # sentence-transformers SparseEncoder folders (SPLADE).
    FolderFormat("splade", "poolrunner-splade", package="sentence_transformers.",
                 classes=frozenset({"MLMTransformer", "SpladePooling"})),
    # PyLate folders and Stanford ColBERT (colbert-ai) checkpoints.
    FolderFormat("colbert", "poolrunner-colbert", package="pylate.", architectures=("HF_ColBERT",)),
)


def unclaimed_format(folder: Path, architecture: str) -> RequiredPlugin | None:
    """The plugin a folder no installed plugin claimed needs, judged from :data:`FOLDER_FORMATS`.

    :raises ModelLoadError: if ``modules.json`` exists but cannot be read.
    """
    module_types = [module.type for module in read_modules(folder)]
    for fmt in FOLDER_FORMATS:
        for module_type in filter(fmt.marks, module_types):
            return RequiredPlugin(name=fmt.plugin, dist=fmt.dist, reason=f"modules.json lists {module_type}")
        if architecture in fmt.architectures:
            return RequiredPlugin(name=fmt.plugin, dist=fmt.dist,
                                  reason=f"config.json names the architecture {architecture}")
    return None
