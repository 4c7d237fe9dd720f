"""Reads the sentence-transformers files of a model folder, when they exist.

``modules.json`` lists the pipeline (Transformer -> Pooling -> optional Dense -> optional
Normalize); ``1_Pooling/config.json`` gives the pooling mode; ``sentence_bert_config.json`` gives
``max_seq_length``; ``config_sentence_transformers.json`` gives named prompts. Only these files
are read: no sentence-transformers code is imported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from attrs import field, frozen

from poolrunner.core.errors import ModelLoadError
from poolrunner.core.types import DenseLayerSpec, PoolingType

# sentence-transformers pooling modes poolrunner runs, and their pooling_type.
_POOLING_MODES: dict[str, PoolingType] = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
# Legacy boolean keys of 1_Pooling/config.json, in sentence-transformers' own order.
_LEGACY_MODE_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_MODULE_PREFIX = "sentence_transformers."


@frozen(kw_only=True)
class SentenceTransformerMetadata:
    """The parts of a sentence-transformers pipeline that decide the output.

    :ivar pooling_type: From the Pooling module; ``None`` when the folder has none.
    :ivar normalize: Whether ``modules.json`` lists a Normalize module.
    :ivar dense_layers: Dense modules after pooling, in order.
    :ivar max_seq_length: From ``sentence_bert_config.json``, if set.
    :ivar prompts: Named prompts from ``config_sentence_transformers.json``.
    :ivar default_prompt_name: Prompt applied when the caller names none.
    """

    pooling_type: PoolingType | None
    normalize: bool
    dense_layers: tuple[DenseLayerSpec, ...] = ()
    max_seq_length: int | None = None
    prompts: dict[str, str] = field(factory=dict)
    default_prompt_name: str | None = None


def read_st_metadata(folder: Path) -> SentenceTransformerMetadata | None:
    """Parse the sentence-transformers pipeline of ``folder``.

    :returns: ``None`` when ``folder`` has no ``modules.json`` (a plain Hugging Face folder).
    :raises ModelLoadError: for a pipeline module or pooling mode poolrunner does not run.
    """
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    pooling_type: PoolingType | None = None
    normalize = False
    dense: list[DenseLayerSpec] = []
    for module in _read_json(modules_file):
        kind = _module_kind(str(module.get("type", "")))
        path = folder / module.get("path", "")
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            pooling_type = _pooling_type(path / "config.json")
        elif kind == "Dense":
            if normalize:
                # sentence-transformers would project the normalized vector; poolrunner
                # normalizes last, so this order would silently give other vectors.
                raise ModelLoadError(
                    f"{folder}: a Dense module after Normalize is not supported (Normalize must be "
                    "the last module of the pipeline)"
                )
            dense.append(_dense_layer(path))
        elif kind == "Normalize":
            normalize = True  # the folder itself may be missing: Normalize has no files
        else:
            raise ModelLoadError(
                f"{folder}: sentence-transformers module {module.get('type')!r} is not supported "
                "(supported: Transformer, Pooling, Dense, Normalize)"
            )
    st_config = _read_optional_json(folder / "config_sentence_transformers.json")
    bert_config = _read_optional_json(folder / "sentence_bert_config.json")
    return SentenceTransformerMetadata(
        pooling_type=pooling_type,
        normalize=normalize,
        dense_layers=tuple(dense),
        max_seq_length=bert_config.get("max_seq_length"),
        prompts=dict(st_config.get("prompts") or {}),
        default_prompt_name=st_config.get("default_prompt_name"),
    )


def _module_kind(module_type: str) -> str:
    """The class name of a sentence-transformers module type, else the type unchanged.

    Older releases write ``sentence_transformers.models.Dense``; current ones write the class's
    own module path, such as ``sentence_transformers.base.modules.dense.Dense``.
    """
    if module_type.startswith(_MODULE_PREFIX):
        return module_type.rsplit(".", 1)[-1]
    return module_type


def _pooling_type(config_file: Path) -> PoolingType:
    config = _read_json(config_file)
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in _LEGACY_MODE_KEYS.items() if config.get(key)] or ["mean"]
    if isinstance(modes, str):
        modes = [modes]
    if len(modes) != 1 or modes[0] not in _POOLING_MODES:
        raise ModelLoadError(
            f"{config_file}: pooling mode {modes} is not supported; poolrunner runs exactly one "
            f"of {sorted(_POOLING_MODES)}"
        )
    if config.get("include_prompt") is False:
        raise ModelLoadError(f"{config_file}: include_prompt=false is not supported")
    return _POOLING_MODES[modes[0]]


def _dense_layer(folder: Path) -> DenseLayerSpec:
    config = _read_json(folder / "config.json")
    activation = str(config.get("activation_function") or "torch.nn.modules.activation.Tanh")
    if not activation.startswith("torch.nn."):
        # Never import an arbitrary path named by a config file.
        raise ModelLoadError(
            f"{folder}: Dense activation {activation!r} is not a torch.nn class; refusing to load it"
        )
    return DenseLayerSpec(
        path=str(folder),
        in_features=int(config["in_features"]),
        out_features=int(config["out_features"]),
        bias=bool(config.get("bias", True)),
        activation=activation.rsplit(".", 1)[-1],
    )


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _read_optional_json(path: Path) -> dict[str, Any]:
    return _read_json(path) if path.is_file() else {}
