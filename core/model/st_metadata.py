"""Reads the sentence-transformers files of a model folder, when they exist.

``modules.json`` lists the pipeline (Transformer -> Pooling -> optional Dense -> optional
Normalize); ``1_Pooling/config.json`` gives the pooling mode or modes; the Transformer module's
``sentence_bert_config.json`` gives ``max_seq_length`` and ``do_lower_case``;
``config_sentence_transformers.json`` gives the model type, named prompts and the similarity.
Only these files are read: no sentence-transformers code is imported.

Every key sentence-transformers 6.2 reads from these files is in one table per file below, with
what poolrunner does with it: honoured (poolrunner computes what sentence-transformers computes),
inert (it cannot change what sentence-transformers computes), or refused at load, for the values
poolrunner cannot honour exactly, by a :class:`~poolrunner.core.errors.ModelLoadError` naming the
file, the key and the value: never mapped to something close. Unknown keys are refused where
sentence-transformers refuses them (``sentence_bert_config.json``, the Pooling ``config.json``) and
ignored where it ignores them (``modules.json`` entries, ``config_sentence_transformers.json``, the
Dense and Normalize ``config.json``): a key it never reads cannot change its vectors.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path, PureWindowsPath
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
_TANH = "torch.nn.modules.activation.Tanh"
_SENTENCE_EMBEDDING = "sentence_embedding"


@frozen
class _Rule:
    """The values of one key that poolrunner runs as sentence-transformers does (``accepts``),
    and why any other value is refused (``why``, the end of the error message)."""

    accepts: Callable[[Any], bool]
    why: str = ""


_ANY = _Rule(lambda _value: True)


def _null_or(why: str) -> _Rule:
    return _Rule(lambda value: value is None, why)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _relative_path(value: Any) -> bool:
    # sentence-transformers' own check (_validate_relative_path), POSIX and Windows spellings alike.
    return isinstance(value, str) and not (PureWindowsPath(value).anchor or ".." in PureWindowsPath(value).parts
                                           or "\0" in value)


# ----------------------------------------------------------------------------------- modules.json

# The keys of a modules.json entry sentence-transformers reads; it ignores any other, and so does
# poolrunner (a key it never reads cannot change its vectors).
_MODULE_KEYS: dict[str, _Rule] = {
    # Inert: sentence-transformers runs the modules in list order and never reads idx.
    "idx": _ANY,
    # Honoured: names key the pipeline; read_modules refuses a name given twice.
    "name": _ANY,
    # Honoured: the module's folder, relative and without '..' (sentence-transformers refuses others).
    "path": _Rule(_relative_path, "sentence-transformers loads modules only from relative paths without '..'"),
    # Honoured: read_st_metadata runs Transformer, Pooling, Dense and Normalize and refuses other types.
    "type": _Rule(lambda value: isinstance(value, str), "it must be a class path"),
    # Inert: names of encode() keyword arguments a caller may forward to the module;
    # sentence-transformers' encode(texts) forwards none, nor does poolrunner.
    "kwargs": _ANY,
}

# ------------------------------------------------------------------- sentence_bert_config.json

_TRANSFORMER_CONFIG_FILES = (
    "sentence_bert_config.json", "sentence_roberta_config.json", "sentence_distilbert_config.json",
    "sentence_camembert_config.json", "sentence_albert_config.json", "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)
"""Where sentence-transformers reads the Transformer module's settings, in its order: the first of
these files with any setting in it."""
_HUB_KWARGS = frozenset({"subfolder", "token", "cache_dir", "revision", "local_files_only", "trust_remote_code"})
"""Keys of the ``from_pretrained`` argument mappings that sentence-transformers replaces with its
own loading arguments (``trust_remote_code``: drops) whatever the file says: inert there."""
_QUERY_DOCUMENT = ("it changes only what sentence-transformers' encode_query / encode_document compute, "
                   "which poolrunner does not tell apart from encode")


def _from_pretrained(loader: str) -> _Rule:
    return _Rule(
        lambda value: isinstance(value, dict) and set(value) <= _HUB_KWARGS,
        f"sentence-transformers passes these to {loader}.from_pretrained, where they change what it loads; "
        f"poolrunner passes none (only {sorted(_HUB_KWARGS)}, which sentence-transformers overrides, may appear)",
    )


# Every key sentence-transformers' Transformer module takes from its config file (it passes each one
# to Transformer(...), which raises on any other): an unknown key is refused here too.
_TRANSFORMER_KEYS: dict[str, _Rule] = {
    # Honoured: the tokenizer's model_max_length in sentence-transformers (replacing the tokenizer's
    # own), poolrunner's max_model_len.
    "max_seq_length": _Rule(lambda value: value is None or _positive_int(value), "it must be a positive integer"),
    # Honoured: ModelConfig.lowercase, a Lowercase normalizer first in the tokenizer as in sentence-transformers.
    "do_lower_case": _Rule(lambda value: value is None or isinstance(value, bool), "it must be true or false"),
    # Honoured: the task of the folder's model_type, with that task's outputs (_transformer_settings).
    "transformer_task": _ANY,
    "modality_config": _ANY,
    "module_output_name": _ANY,
    # Inert: sentence-transformers 6.2 replaces it with the backend its caller passes (torch by default).
    "backend": _ANY,
    # Inert: whether sentence-transformers' batches skip padding (flash attention): speed only.
    "unpad_inputs": _ANY,
    # Inert: where downloads are cached.
    "cache_dir": _ANY,
    # Refused unless only _HUB_KWARGS: each from_pretrained mapping under its name and its legacy name.
    "model_kwargs": _from_pretrained("AutoModel"),
    "model_args": _from_pretrained("AutoModel"),
    "processor_kwargs": _from_pretrained("AutoProcessor"),
    "tokenizer_args": _from_pretrained("AutoProcessor"),
    "config_kwargs": _from_pretrained("AutoConfig"),
    "config_args": _from_pretrained("AutoConfig"),
    # Refused unless empty: arguments of every tokenizer call (truncation, padding, chat template...).
    "processing_kwargs": _Rule(lambda value: not value, "sentence-transformers passes them to every tokenizer "
                               "call; poolrunner calls the tokenizer with its own settings"),
    # Refused unless null: query and document settings (ColBERT-style).
    "query_length": _null_or(_QUERY_DOCUMENT),
    "document_length": _null_or(_QUERY_DOCUMENT),
    "query_expansion": _null_or(_QUERY_DOCUMENT),
    # Refused unless null: sentence-transformers would load the tokenizer from that other folder.
    "tokenizer_name_or_path": _null_or("poolrunner loads the tokenizer of the model folder itself"),
}
# transformer_task -> the modality_config and module_output_name sentence-transformers gives it by
# default (TRANSFORMER_TASK_DEFAULTS): what poolrunner runs for that task.
_TEXT_IMAGE_OUTPUTS: tuple[dict[str, Any], str] = ({
    "text": {"method": "get_text_features", "method_output_name": "pooler_output"},
    "image": {"method": "get_image_features", "method_output_name": "pooler_output"},
}, "sentence_embedding")
"""A text-image module's outputs: each tower's pooled, projected features as the sentence embedding
(sentence-transformers' legacy ``CLIPModel`` module, its default; or a ``Transformer`` declaring them)."""
_TEXT_IMAGE_MODULE = "CLIPModel"
"""sentence-transformers' legacy CLIP module (``sentence_transformers.models.CLIPModel``, 6.2's
``sentence_transformers.sentence_transformer.modules.clip_model.CLIPModel``): a Transformer whose
outputs are :data:`_TEXT_IMAGE_OUTPUTS`, unnormalized."""
_TASK_OUTPUTS: dict[str, tuple[dict[str, Any], str]] = {
    "feature-extraction": ({"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
                           "token_embeddings"),
    "sequence-classification": ({"text": {"method": "forward", "method_output_name": "logits"}}, "scores"),
}

# ------------------------------------------------------------ config_sentence_transformers.json

_MODEL_TYPES = {"SentenceTransformer": "feature-extraction", "CrossEncoder": "sequence-classification"}
"""The sentence-transformers classes whose folders core runs, with their Transformer's task."""

# The keys sentence-transformers reads from config_sentence_transformers.json; it ignores any other,
# and so does poolrunner.
_MODEL_CONFIG_KEYS: dict[str, _Rule] = {
    # Inert: sentence-transformers only warns when the folder was saved by a newer release.
    "__version__": _ANY,
    # Inert: sentence-transformers refuses to load when the installed packages miss these versions;
    # they never change what it computes.
    "requirements": _ANY,
    # Honoured: which class's pipeline the folder is (a missing key is SentenceTransformer).
    "model_type": _Rule(lambda value: isinstance(value, str) and value in _MODEL_TYPES,
                        f"poolrunner runs the pipelines of {list(_MODEL_TYPES)} only; a folder of another type "
                        "computes other outputs"),
    # Honoured: _prompts and _similarity_fn_name check their values.
    "prompts": _ANY,
    "default_prompt_name": _ANY,
    "similarity_fn_name": _ANY,
    # Honoured: a CrossEncoder's activation (ModelConfig.classifier_activation, read by metadata.py).
    "activation_fn": _ANY,
    # Inert (precision only): the Linear layers a CrossEncoder keeps in float32 when it runs in half
    # precision; poolrunner's dtype sets the precision of every layer, and in float32 both agree.
    "keep_in_fp32_modules": _ANY,
    # Refused unless null: SentenceTransformer.encode cuts every embedding to its first truncate_dim
    # values (after Normalize, so no longer of unit length).
    "truncate_dim": _null_or("sentence-transformers cuts every embedding to its first truncate_dim values; "
                             "poolrunner returns them whole"),
}

# ---------------------------------------------------- Dense and Normalize config.json

_OTHER_FEATURE = f"poolrunner applies the module to the pooled {_SENTENCE_EMBEDDING!r} only"
# The keys of Dense's config.json that sentence-transformers' Dense takes; it drops any other (with
# a warning), and so does poolrunner.
_DENSE_KEYS: dict[str, _Rule] = {
    # Honoured: the projection's shape (in_features is checked against the pooled width at load).
    "in_features": _Rule(_positive_int, "it must be a positive integer"),
    "out_features": _Rule(_positive_int, "it must be a positive integer"),
    "bias": _Rule(lambda value: isinstance(value, bool), "it must be true or false"),
    # Honoured: a torch.nn module class (_dense_layer; no other path is ever imported).
    "activation_function": _ANY,
    # Honoured for the pooled embedding only: sentence-transformers can read and write another feature.
    "module_input_name": _Rule(lambda value: value == _SENTENCE_EMBEDDING, _OTHER_FEATURE),
    "module_output_name": _Rule(lambda value: value in (None, _SENTENCE_EMBEDDING), _OTHER_FEATURE),
    # Refused unless false: poolrunner's Dense adds no residual connection.
    "use_residual": _Rule(lambda value: not value, "poolrunner's Dense layer adds no residual connection"),
}
# Normalize's config.json (sentence-transformers keeps only these keys of it).
_NORMALIZE_KEYS = {key: _DENSE_KEYS[key] for key in ("module_input_name", "module_output_name")}


@frozen(kw_only=True)
class SentenceTransformerMetadata:
    """The parts of a sentence-transformers pipeline that decide the output.

    :ivar pooling_type: From the Pooling module, several modes joined by ``+`` in the order
        sentence-transformers concatenates them; ``None`` when the folder has none.
    :ivar normalize: Whether ``modules.json`` lists a Normalize module.
    :ivar dense_layers: Dense modules after pooling, in order.
    :ivar max_seq_length: From ``sentence_bert_config.json``, if set.
    :ivar lowercase: ``do_lower_case`` of ``sentence_bert_config.json``.
    :ivar prompts: Named prompts from ``config_sentence_transformers.json``.
    :ivar default_prompt_name: Prompt applied when the caller names none.
    :ivar similarity_fn_name: The similarity the model was trained for (``cosine`` when unset).
    :ivar text_image: The first module outputs a text-image model's features (sentence-transformers'
        ``CLIPModel`` module: ``get_text_features`` / ``get_image_features``' pooled output, then
        only an optional Normalize), not token embeddings to pool.
    """

    pooling_type: str | None
    normalize: bool
    dense_layers: tuple[DenseLayerSpec, ...] = ()
    max_seq_length: int | None = None
    lowercase: bool = False
    prompts: dict[str, str] = field(factory=dict)
    default_prompt_name: str | None = None
    similarity_fn_name: str = "cosine"
    text_image: bool = False


def read_st_metadata(folder: Path) -> SentenceTransformerMetadata | None:
    """Parse the sentence-transformers pipeline of ``folder``: ``modules.json``, the Transformer's
    ``sentence_bert_config.json`` (or a legacy name of it), ``config_sentence_transformers.json``
    and each module's ``config.json``.

    :returns: ``None`` when ``folder`` has no ``modules.json`` (a plain Hugging Face folder).
    :raises ModelLoadError: naming the file, the key and the value, for a setting poolrunner cannot
        honour exactly (a module type, a module order, a pooling mode or setting, a model type, a
        from_pretrained argument, a Dense or Normalize feature...), an unknown key where
        sentence-transformers refuses unknown keys, or prompts that sentence-transformers itself
        would refuse or that poolrunner cannot apply.
    """
    modules = read_modules(folder)
    if not modules:
        return None
    config_file = folder / "config_sentence_transformers.json"
    model_config = _read_object(config_file, optional=True)
    _check_keys(config_file, model_config, _MODEL_CONFIG_KEYS, strict=False)
    model_type = model_config.get("model_type", "SentenceTransformer")
    max_seq_length, lowercase, text_image = _transformer_settings(folder, model_type, _module_kind(modules[0].type))
    pooling_type, normalize, dense = _pipeline(folder, modules, text_image=text_image)
    prompts, default_prompt_name = _prompts(config_file, model_config)
    if model_type == "CrossEncoder" and default_prompt_name is not None and prompts[default_prompt_name]:
        raise _refused(config_file, "default_prompt_name", default_prompt_name,
                       f"a CrossEncoder prepends its prompt {prompts[default_prompt_name]!r} to the first text of "
                       "every pair; poolrunner scores pairs without prompts")
    return SentenceTransformerMetadata(
        pooling_type=pooling_type,
        normalize=normalize,
        dense_layers=dense,
        max_seq_length=max_seq_length,
        lowercase=lowercase,
        prompts=prompts,
        default_prompt_name=default_prompt_name,
        similarity_fn_name=_similarity_fn_name(config_file, model_config),
        text_image=text_image,
    )


@frozen
class ClaimedFolderSettings:
    """What sentence-transformers applies to a folder whatever its pipeline, for a folder whose
    pipeline a plugin reads (``SparseEncoder``'s as ``SentenceTransformer``'s)."""

    prompts: dict[str, str]
    default_prompt_name: str | None
    max_seq_length: int | None
    lowercase: bool


def read_claimed_folder_settings(folder: Path) -> ClaimedFolderSettings:
    """The prompts and default prompt name of ``folder``'s ``config_sentence_transformers.json``
    and, where every module is sentence-transformers' own and the first its Transformer
    (``MLMTransformer`` included: a ``SparseEncoder``), that module's ``max_seq_length`` and
    ``do_lower_case``; none without the files. Another library's pipeline (PyLate's) sets its
    own lengths: its plugin reads them.

    :raises ModelLoadError: as :func:`read_st_metadata` for the same keys.
    """
    config_file = folder / "config_sentence_transformers.json"
    prompts, default_prompt_name = _prompts(config_file, _read_object(config_file, optional=True))
    modules = read_modules(folder)
    max_seq_length, lowercase = None, False
    if (modules and all(module.type.startswith(_MODULE_PREFIX) for module in modules)
            and _module_kind(modules[0].type).endswith("Transformer")):
        _, transformer = _transformer_config(modules[0].path)
        max_seq_length, lowercase = transformer.get("max_seq_length"), bool(transformer.get("do_lower_case"))
    return ClaimedFolderSettings(prompts, default_prompt_name, max_seq_length, lowercase)


def _pipeline(folder: Path, modules: tuple[StModule, ...], *, text_image: bool = False,
              ) -> tuple[str | None, bool, tuple[DenseLayerSpec, ...]]:
    """``(pooling_type, normalize, dense_layers)`` of the modules after the Transformer.

    :param text_image: The first module outputs text-image features (a sentence embedding): only
        a Normalize may follow it.
    :raises ModelLoadError: unless the pipeline is one Transformer (or ``CLIPModel``) first, at the
        folder itself (the backbone poolrunner loads), then Pooling, Dense layers and a last
        Normalize, of those types (after ``CLIPModel``: a Normalize alone).
    """
    pooling_type: str | None = None
    normalize = False
    dense: list[DenseLayerSpec] = []
    for index, module in enumerate(modules):
        kind = _module_kind(module.type)
        kind = "Transformer" if kind == _TEXT_IMAGE_MODULE else kind
        if (index == 0) != (kind == "Transformer") or (kind == "Transformer" and module.path != folder):
            path = "" if module.path == folder else str(module.path.relative_to(folder))
            raise ModelLoadError(
                f"{folder / 'modules.json'}: module {index} (type={module.type!r}, path={json.dumps(path)}) is not "
                'supported: the pipeline must start with its only Transformer module, at path "" (the model '
                "folder itself)"
            )
        if kind == "Transformer":
            continue
        if text_image and kind != "Normalize":
            raise ModelLoadError(f"{folder}: a {kind} module after {_module_kind(modules[0].type)}'s text-image "
                                 "features is not supported (only a Normalize may follow them)")
        if kind in ("Dense", "Normalize") and pooling_type is None and not text_image:
            raise ModelLoadError(f"{folder}: a {kind} module before the Pooling module is not supported")
        if kind == "Pooling":
            pooling_type = _pooling_type(module.path / "config.json")
        elif kind == "Dense":
            if normalize:
                # sentence-transformers would project the normalized vector; poolrunner
                # normalizes last, so this order would silently give other vectors.
                raise ModelLoadError(
                    f"{folder}: a Dense module after Normalize is not supported (Normalize must be "
                    "the last module of the pipeline)"
                )
            dense.append(_dense_layer(module.path))
        elif kind == "Normalize":
            normalize = True  # the folder (or its config.json) may be missing: the defaults then
            normalize_config = module.path / "config.json"
            _check_keys(normalize_config, _read_object(normalize_config, optional=True), _NORMALIZE_KEYS,
                        strict=False)
        else:
            raise ModelLoadError(
                f"{folder}: sentence-transformers module {module.type!r} is not supported "
                "(supported: Transformer, Pooling, Dense, Normalize)"
            )
    return pooling_type, normalize, tuple(dense)


def _module_kind(module_type: str) -> str:
    """The class name of a sentence-transformers module type, else the type unchanged.

    Older releases write ``sentence_transformers.models.Dense``; current ones write the class's
    own module path, such as ``sentence_transformers.base.modules.dense.Dense``.
    """
    if module_type.startswith(_MODULE_PREFIX):
        return module_type.rsplit(".", 1)[-1]
    return module_type


def _transformer_settings(folder: Path, model_type: str, kind: str = "Transformer") -> tuple[int | None, bool, bool]:
    """``(max_seq_length, do_lower_case, text_image)`` of the Transformer module's config file,
    checked against :data:`_TRANSFORMER_KEYS` and the task of ``model_type``; ``text_image``: the
    module outputs :data:`_TEXT_IMAGE_OUTPUTS` (a ``CLIPModel`` module, whose default they are, or
    a Transformer whose ``modality_config`` names them).

    :raises ModelLoadError: naming the file, the key and the value.
    """
    config_file, config = _transformer_config(folder)
    task = _MODEL_TYPES[model_type]
    given = config.get("transformer_task", "feature-extraction")
    if given != task:
        raise _refused(config_file, "transformer_task", given, f"the Transformer of a {model_type} runs {task!r}")
    text_image = kind == _TEXT_IMAGE_MODULE
    if "modality_config" in config:  # else sentence-transformers takes the module's own, whatever the file says
        declared = (config.get("modality_config"), config.get("module_output_name"))
        text_image = model_type == "SentenceTransformer" and declared == _TEXT_IMAGE_OUTPUTS
        expected = _TEXT_IMAGE_OUTPUTS if kind == _TEXT_IMAGE_MODULE else _TASK_OUTPUTS[task]
        for key, want, got in zip(("modality_config", "module_output_name"), expected, declared, strict=True):
            if got != want and not text_image:
                raise _refused(config_file, key, got, f"poolrunner runs {task!r} with {key}={json.dumps(want)} only")
    return config.get("max_seq_length"), bool(config.get("do_lower_case")), text_image


def _transformer_config(folder: Path) -> tuple[Path, dict[str, Any]]:
    """The Transformer module's config file and its settings: the first file of
    :data:`_TRANSFORMER_CONFIG_FILES` with any setting, as sentence-transformers picks it, its
    keys checked against :data:`_TRANSFORMER_KEYS`.

    :raises ModelLoadError: naming the file, the key and the value.
    """
    for name in _TRANSFORMER_CONFIG_FILES:
        config = _read_object(folder / name, optional=True)
        if config:
            _check_keys(folder / name, config, _TRANSFORMER_KEYS, strict=True)
            return folder / name, config
    return folder / _TRANSFORMER_CONFIG_FILES[0], {}


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
    config = _read_object(config_file)
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


def _prompts(config_file: Path, config: Mapping[str, Any]) -> tuple[dict[str, str], str | None]:
    """Named prompts and the default prompt name of ``config_sentence_transformers.json``.

    A ``null`` prompt is the empty prompt, as sentence-transformers reads it.

    :raises ModelLoadError: naming the file, the value and the defined prompt names, when
        ``prompts`` is not a mapping of names to strings, or ``default_prompt_name`` names no
        prompt (sentence-transformers refuses such a folder; every request would fail).
    """
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


def _similarity_fn_name(config_file: Path, config: Mapping[str, Any]) -> str:
    """``similarity_fn_name`` of ``config_sentence_transformers.json``; ``cosine`` when unset, as
    sentence-transformers reads it.

    :raises ModelLoadError: for a name sentence-transformers does not define.
    """
    name = config.get("similarity_fn_name")
    if name is None:
        return "cosine"
    if name not in SIMILARITY_FNS:
        raise ModelLoadError(f"{config_file}: similarity_fn_name {name!r} is not one of {list(SIMILARITY_FNS)}")
    return name


def _dense_layer(folder: Path) -> DenseLayerSpec:
    """The Dense module in ``folder``, from its ``config.json`` checked against :data:`_DENSE_KEYS`.

    :raises ModelLoadError: naming the file, the key and the value; for a missing size; for an
        activation that is not a ``torch.nn`` class path (sentence-transformers would fall back to
        Tanh for some, poolrunner never guesses).
    """
    config_file = folder / "config.json"
    config = _read_object(config_file)
    _check_keys(config_file, config, _DENSE_KEYS, strict=False)
    missing = [key for key in ("in_features", "out_features") if key not in config]
    if missing:
        raise ModelLoadError(f"{config_file}: {missing} missing; sentence-transformers' Dense needs both sizes")
    activation = str(config.get("activation_function") or _TANH)
    if not activation.startswith("torch.nn."):
        # Never import an arbitrary path named by a config file.
        raise ModelLoadError(
            f"{folder}: Dense activation {activation!r} is not a torch.nn class; refusing to load it"
        )
    return DenseLayerSpec(
        path=str(folder),
        in_features=config["in_features"],
        out_features=config["out_features"],
        bias=config.get("bias", True),
        activation=activation.rsplit(".", 1)[-1],
    )


def _check_keys(config_file: Path, config: Mapping[str, Any], rules: Mapping[str, _Rule], *, strict: bool) -> None:
    """:raises ModelLoadError: naming ``config_file``, the key and the value, for a value its rule
    refuses; with ``strict``, for keys ``rules`` does not name."""
    unknown = [f"{key}={json.dumps(value)}" for key, value in config.items() if key not in rules]
    if strict and unknown:
        raise ModelLoadError(
            f"{config_file}: unknown setting(s) {', '.join(unknown)}, which sentence-transformers itself refuses; "
            f"the settings it reads there: {list(rules)} (for some, only some values are supported)"
        )
    for key, value in config.items():
        rule = rules.get(key)
        if rule is not None and not rule.accepts(value):
            raise _refused(config_file, key, value, rule.why)


def _refused(config_file: Path, key: str, value: Any, why: str) -> ModelLoadError:
    return ModelLoadError(f"{config_file}: {key}={json.dumps(value)} is not supported: {why}")


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
    ``poolrunner.core.read_modules``). Each entry's keys are checked against :data:`_MODULE_KEYS`.

    :raises ModelLoadError: if the file cannot be read or is not a list of modules; for an entry
        without ``type`` or ``path``, a ``path`` that is absolute or has ``..`` (refused by
        sentence-transformers too), or a ``name`` given to two modules (sentence-transformers would
        keep one of them).
    """
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return ()
    modules = _read_json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(module, dict) for module in modules):
        raise ModelLoadError(f"{modules_file}: expected a list of modules, got {modules!r:.120}")
    for module in modules:
        missing = [key for key in ("type", "path") if key not in module]
        if missing:
            raise ModelLoadError(f"{modules_file}: module {module!r:.120} has no {' or '.join(missing)}")
        _check_keys(modules_file, module, _MODULE_KEYS, strict=False)
    names = [module["name"] for module in modules if "name" in module]
    twice = next((name for index, name in enumerate(names) if name in names[:index]), None)
    if twice is not None:
        raise _refused(modules_file, "name", twice, "two modules have this name; sentence-transformers keeps only "
                       "one of them")
    return tuple(StModule(module["type"], folder / module["path"]) for module in modules)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _read_object(path: Path, *, optional: bool = False) -> dict[str, Any]:
    """The JSON object in ``path``; ``{}`` for a missing ``optional`` file.

    :raises ModelLoadError: if the file cannot be read or holds no JSON object.
    """
    if optional and not path.is_file():
        return {}
    config = _read_json(path)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {config!r}")
    return config
