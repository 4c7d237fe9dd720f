"""Reads the sentence-transformers files of a model folder, when they exist.

``modules.json`` lists the pipeline (Transformer -> Pooling -> optional Dense -> optional
Normalize); ``1_Pooling/config.json`` gives the pooling mode or modes; ``sentence_bert_config.json``
gives ``max_seq_length``; ``config_sentence_transformers.json`` gives named prompts. Only these
files are read: no sentence-transformers code is imported. Settings poolrunner cannot honour
exactly are refused at load, never mapped to something close.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from attrs import field, frozen

from poolrunner.core.errors import ModelLoadError
from poolrunner.core.similarity import SIMILARITY_FNS
from poolrunner.core.types import POOLING_TYPE_SEPARATOR, DenseLayerSpec, PoolingType

# sentence-transformers' pooling modes (Pooling.POOLING_MODES, in its order) and their pooling_type.
_POOLING_MODES: dict[str, PoolingType] = {
    "cls": "CLS",
    "max": "MAX",
    "mean": "MEAN",
    "mean_sqrt_len_tokens": "MEAN_SQRT_LEN",
    "weightedmean": "WEIGHTEDMEAN",
    "lasttoken": "LAST",
}
# Legacy boolean keys of 1_Pooling/config.json, in sentence-transformers' own order.
_LEGACY_MODE_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# Every key sentence-transformers' Pooling accepts in its config.json; it refuses any other, and
# so does poolrunner: an unknown key may be a new mode or setting that changes the vectors.
_POOLING_KEYS = ("word_embedding_dimension", "embedding_dimension", "pooling_mode", "include_prompt",
                 *_LEGACY_MODE_KEYS)
_MODULE_PREFIX = "sentence_transformers."


@frozen(kw_only=True)
class SentenceTransformerMetadata:
    """The parts of a sentence-transformers pipeline that decide the output.

    :ivar pooling_type: From the Pooling module, several modes joined by ``+`` in the order
        sentence-transformers concatenates them; ``None`` when the folder has none.
    :ivar normalize: Whether ``modules.json`` lists a Normalize module.
    :ivar dense_layers: Dense modules after pooling, in order.
    :ivar max_seq_length: From ``sentence_bert_config.json``, if set.
    :ivar prompts: Named prompts from ``config_sentence_transformers.json``.
    :ivar default_prompt_name: Prompt applied when the caller names none.
    :ivar similarity_fn_name: The similarity the model was trained for (``cosine`` when unset).
    """

    pooling_type: str | None
    normalize: bool
    dense_layers: tuple[DenseLayerSpec, ...] = ()
    max_seq_length: int | None = None
    prompts: dict[str, str] = field(factory=dict)
    default_prompt_name: str | None = None
    similarity_fn_name: str = "cosine"


def read_st_metadata(folder: Path) -> SentenceTransformerMetadata | None:
    """Parse the sentence-transformers pipeline of ``folder``.

    :returns: ``None`` when ``folder`` has no ``modules.json`` (a plain Hugging Face folder).
    :raises ModelLoadError: for a pipeline module, pooling mode or pooling setting poolrunner does
        not run, or prompts that sentence-transformers itself would refuse or cannot apply.
    """
    modules = read_modules(folder)
    if not modules:
        return None
    pooling_type: str | None = None
    normalize = False
    dense: list[DenseLayerSpec] = []
    for module in modules:
        kind = _module_kind(module.type)
        path = module.path
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
                f"{folder}: sentence-transformers module {module.type!r} is not supported "
                "(supported: Transformer, Pooling, Dense, Normalize)"
            )
    prompts, default_prompt_name = _prompts(folder / "config_sentence_transformers.json")
    similarity_fn_name = _similarity_fn_name(folder / "config_sentence_transformers.json")
    bert_config = _read_optional_json(folder / "sentence_bert_config.json")
    return SentenceTransformerMetadata(
        pooling_type=pooling_type,
        normalize=normalize,
        dense_layers=tuple(dense),
        max_seq_length=bert_config.get("max_seq_length"),
        prompts=prompts,
        default_prompt_name=default_prompt_name,
        similarity_fn_name=similarity_fn_name,
    )


def _module_kind(module_type: str) -> str:
    """The class name of a sentence-transformers module type, else the type unchanged.

    Older releases write ``sentence_transformers.models.Dense``; current ones write the class's
    own module path, such as ``sentence_transformers.base.modules.dense.Dense``.
    """
    if module_type.startswith(_MODULE_PREFIX):
        return module_type.rsplit(".", 1)[-1]
    return module_type


def _pooling_type(config_file: Path) -> str:
    """The pooling_type of a Pooling module's ``config.json``, as sentence-transformers reads it.

    ``pooling_mode`` (a mode or a list, concatenated in list order, repeats allowed) wins; else
    the legacy ``pooling_mode_*`` flags that are true, in sentence-transformers' fixed order
    (cls, max, mean, mean_sqrt_len_tokens, weightedmean, lasttoken); no flag at all means mean.

    :returns: One pooling type, or several joined by ``+`` (e.g. ``"MEAN+MAX"``).
    :raises ModelLoadError: naming an unknown key or mode and the supported ones, for an empty
        mode list, and for ``include_prompt`` false (sentence-transformers then leaves the prompt's
        tokens out of pooling; poolrunner pools every token of the prompt).
    """
    config = _read_json(config_file)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_file}: expected a JSON object, got {config!r}")
    unknown = [key for key in config if key not in _POOLING_KEYS]
    if unknown:
        raise ModelLoadError(
            f"{config_file}: unsupported pooling setting(s) {unknown}; supported settings: "
            f"{list(_POOLING_KEYS)} with the pooling modes {list(_POOLING_MODES)}"
        )
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in _LEGACY_MODE_KEYS.items() if config.get(key)] or ["mean"]
    elif isinstance(modes, str):
        modes = [modes]
    if not isinstance(modes, list) or not modes:
        raise ModelLoadError(
            f"{config_file}: pooling_mode must be one of {list(_POOLING_MODES)} or a non-empty list of "
            f"them, got {modes!r}"
        )
    for mode in modes:
        if not isinstance(mode, str) or mode not in _POOLING_MODES:
            raise ModelLoadError(
                f"{config_file}: pooling mode {mode!r} is not supported; supported modes: {list(_POOLING_MODES)}"
            )
    if not config.get("include_prompt", True):
        raise ModelLoadError(f"{config_file}: include_prompt=false is not supported")
    return POOLING_TYPE_SEPARATOR.join(_POOLING_MODES[mode] for mode in modes)


def _prompts(config_file: Path) -> tuple[dict[str, str], str | None]:
    """Named prompts and the default prompt name of ``config_sentence_transformers.json``.

    A ``null`` prompt is the empty prompt, as sentence-transformers reads it.

    :raises ModelLoadError: naming the file, the value and the defined prompt names, when
        ``prompts`` is not a mapping of names to strings, or ``default_prompt_name`` names no
        prompt (sentence-transformers refuses such a folder; every request would fail).
    """
    config = _read_optional_json(config_file)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_file}: expected a JSON object, got {config!r}")
    prompts = config.get("prompts")
    if prompts is None:
        prompts = {}
    if not isinstance(prompts, dict):
        raise ModelLoadError(f"{config_file}: prompts must map prompt names to strings, got {prompts!r}")
    for name, text in prompts.items():
        if text is not None and not isinstance(text, str):
            raise ModelLoadError(
                f"{config_file}: prompt {name!r} is {text!r}, not a string; defined prompts: {sorted(prompts)}"
            )
    default = config.get("default_prompt_name")
    if default is not None and (not isinstance(default, str) or default not in prompts):
        raise ModelLoadError(
            f"{config_file}: default_prompt_name {default!r} names no prompt in prompts; defined "
            f"prompts: {sorted(prompts)}"
        )
    return {name: text or "" for name, text in prompts.items()}, default


def _similarity_fn_name(config_file: Path) -> str:
    """``similarity_fn_name`` of ``config_sentence_transformers.json``; ``cosine`` when unset, as
    sentence-transformers reads it.

    :raises ModelLoadError: for a name sentence-transformers does not define.
    """
    config = _read_optional_json(config_file)
    name = config.get("similarity_fn_name") if isinstance(config, dict) else None
    if name is None:
        return "cosine"
    if name not in SIMILARITY_FNS:
        raise ModelLoadError(f"{config_file}: similarity_fn_name {name!r} is not one of {list(SIMILARITY_FNS)}")
    return name


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


@frozen
class StModule:
    """One entry of a sentence-transformers ``modules.json``.

    :ivar type: The module's class path, e.g. ``sentence_transformers.models.Pooling``.
    :ivar path: Its folder (the model folder itself for the Transformer module).
    """

    type: str
    path: Path


def read_modules(folder: Path) -> tuple[StModule, ...]:
    """The pipeline ``folder/modules.json`` lists, in order; empty when there is no such file.

    The one reader of ``modules.json`` for core and plugins alike (re-exported as
    ``poolrunner.core.read_modules``).

    :raises ModelLoadError: if the file cannot be read or is not a list of modules.
    """
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return ()
    modules = _read_json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(module, dict) for module in modules):
        raise ModelLoadError(f"{modules_file}: expected a list of modules, got {modules!r:.120}")
    return tuple(StModule(str(module.get("type", "")), folder / str(module.get("path", ""))) for module in modules)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _read_optional_json(path: Path) -> dict[str, Any]:
    return _read_json(path) if path.is_file() else {}
