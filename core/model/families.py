"""Which transformers configs and classes poolrunner runs, judged before any weight is read.

poolrunner runs transformers' own classes only, never a folder's code: every config, tokenizer
and model is read with ``trust_remote_code=False`` (so transformers never asks on stdin either).
A folder is refused at load, with a one-line :class:`ModelLoadError` that says what is supported,
when its config cannot be read as a transformers config, when it is composite (a text-image or
other multimodal model: several sub-configs) outside :data:`TEXT_IMAGE_FAMILIES` and
:data:`PAGE_RETRIEVAL_FAMILIES`, when it is the
text tower of a text-image family (whose embedding is the family's own pooled output: CLIP's EOS
row and projection), or when ``architectures`` names no transformers model class.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from transformers.models.auto import modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from poolrunner.core.errors import ModelLoadError

# The class mappings whose classes poolrunner serves: the backbone (embed), the sequence and token
# classifiers, and the LM classes (embed from the backbone; SPLADE and LLM rerankers use the head).
_SERVED_MAPPINGS = (
    modeling_auto.MODEL_MAPPING_NAMES,
    modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
    modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
)
# LM classes: their head (MLM or causal LM) sits outside the backbone and embed never reads it.
_LM_MAPPINGS = (modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                modeling_auto.MODEL_FOR_PRETRAINING_MAPPING_NAMES)
LM_CLASSES = frozenset(name for mapping in _LM_MAPPINGS for name in mapping.values() if isinstance(name, str))
# Text towers of text-image (and text-audio) families are named `<family>_text_model`.
_TEXT_TOWER_SUFFIX = "_text_model"
# Composite (text-image) families served, model_type -> the one class served: both towers run,
# each request through the tower its input needs (poolrunner.core.model.towers).
TEXT_IMAGE_FAMILIES = {"clip": "CLIPModel", "siglip": "SiglipModel", "siglip2": "Siglip2Model"}
# Page-retrieval families served, model_type -> the one class served: a vision-language model whose
# every prompt token gives a vector (pages and queries; poolrunner.core.model.page_retrieval).
PAGE_RETRIEVAL_FAMILIES = {"colpali": "ColPaliForRetrieval", "colqwen2": "ColQwen2ForRetrieval"}
NATIVE_FAMILIES = ("NomicBERT 'nomic_bert', GTE 'gte', Jina-v3 'jina_embeddings_v3', ModernBERT 'modernbert', "
                   "EuroBERT 'eurobert'")


def load_hf_config(path: Path) -> PretrainedConfig:
    """``config.json`` as transformers' own config class reads it (no folder code runs); the caller
    checks it with :func:`check_config` once its overrides are applied.

    :raises ModelLoadError: one line naming the folder and what is wrong: unreadable or not a JSON
        object, no or an unknown ``model_type`` (with remote code: what poolrunner runs instead),
        a value transformers rejects.
    """
    raw = _read_config_json(path)
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelLoadError(f"{path}/config.json has no model_type, so it names no transformers family; "
                             f"got {model_type!r}")
    if model_type not in CONFIG_MAPPING_NAMES:
        raise ModelLoadError(_unknown_model_type(path, model_type, raw.get("auto_map")))
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers' validation: ValueError, TypeError, its strict-field errors
        raise ModelLoadError(f"cannot read the model config of {path}: {one_line(exc)}") from exc
    return config


def check_config(path: Path, config: PretrainedConfig) -> None:
    """Refuse what poolrunner does not run: a composite config, a text-image text tower, an
    ``architectures`` that is not a list of class names, a missing or non-positive hidden size.

    :raises ModelLoadError: naming the folder, the architecture and the ``model_type``.
    """
    architectures = config.architectures
    if architectures is not None and (
        not isinstance(architectures, list) or not all(isinstance(name, str) and name for name in architectures)
    ):
        raise ModelLoadError(f"{path}/config.json: architectures must be a list of class names, got {architectures!r}")
    name = architecture_name(config)
    served = served_text_image()
    if config.sub_configs:
        if is_text_image(config):
            _check_projections(path, config)
            return  # its size is the projection's, not a hidden_size
        if is_page_retrieval(config):
            return  # its size is embedding_dim, not a hidden_size
        served = ", ".join(f"{cls} ({model_type!r})" for model_type, cls in
                           {**TEXT_IMAGE_FAMILIES, **PAGE_RETRIEVAL_FAMILIES}.items())
        raise ModelLoadError(
            f"{path}: {name} (model_type {config.model_type!r}) is a composite model whose config holds "
            f"{', '.join(sorted(config.sub_configs))}; of the composite families poolrunner serves only {served}; "
            "other multimodal models (vision-language, audio, other heads of these families) are refused until it "
            "implements them"
        )
    if (modality := _non_text_input(name)) is not None:
        raise ModelLoadError(
            f"{path}: {name} (model_type {config.model_type!r}) is {modality} model; poolrunner embeds images "
            f"only with the text-image families {served_text_image()}, each with both towers, and pages with "
            f"{', '.join(PAGE_RETRIEVAL_FAMILIES.values())}, and serves no other vision or audio model"
        )
    if config.model_type.endswith(_TEXT_TOWER_SUFFIX):
        raise ModelLoadError(
            f"{path}: {name} (model_type {config.model_type!r}) is the text tower of a text-image family; its "
            "embedding is the family's own pooled output (CLIP's: the EOS row, then text_projection), which "
            "poolrunner serves only from the whole model's folder (text-image families: "
            f"{served_text_image()}), so the folder is refused rather than pooled another way"
        )
    hidden_size = getattr(config, "hidden_size", None)
    if not isinstance(hidden_size, int) or isinstance(hidden_size, bool) or hidden_size < 1:
        raise ModelLoadError(f"{path}/config.json: {name} needs a positive integer hidden_size, got {hidden_size!r}")


def served_text_image() -> str:
    """The served text-image classes, as a readable list: ``CLIPModel ('clip'), ...``."""
    return ", ".join(f"{cls} ({model_type!r})" for model_type, cls in TEXT_IMAGE_FAMILIES.items())


def _non_text_input(architecture: str) -> str | None:
    """``"a vision"`` / ``"an audio"`` when transformers' class ``architecture`` takes images or
    audio (its ``main_input_name`` is ``pixel_values``, ``input_features`` or ``input_values``),
    else ``None``."""
    model_class = getattr(transformers, architecture, None)
    main_input = getattr(model_class, "main_input_name", "input_ids") if _is_model_class(model_class) else "input_ids"
    return {"pixel_values": "a vision", "input_features": "an audio", "input_values": "an audio"}.get(main_input)


def _check_projections(path: Path, config: PretrainedConfig) -> None:
    """SigLIP's text head and vision pooling head must give one size (no projection joins them)."""
    if config.model_type in ("siglip", "siglip2"):
        text, vision = config.text_config.projection_size, config.vision_config.hidden_size
        if text != vision:
            raise ModelLoadError(f"{path}: text_config.projection_size {text} differs from vision_config.hidden_size "
                                 f"{vision}; {architecture_name(config)}'s text and image embeddings must share a size")


def is_text_image(config: PretrainedConfig) -> bool:
    """A served text-image model: its ``model_type`` is in :data:`TEXT_IMAGE_FAMILIES` and its
    architecture is that family's served class."""
    return TEXT_IMAGE_FAMILIES.get(config.model_type) == architecture_name(config)


def is_page_retrieval(config: PretrainedConfig) -> bool:
    """A served page-retrieval model: its ``model_type`` is in :data:`PAGE_RETRIEVAL_FAMILIES`
    and its architecture is that family's served class."""
    return PAGE_RETRIEVAL_FAMILIES.get(config.model_type) == architecture_name(config)


def architecture_name(config: PretrainedConfig) -> str:
    """``config.json``'s ``architectures[0]``, else the family's backbone class (``AutoModel``'s,
    e.g. ``BertModel``), else the config class's name."""
    if config.architectures:
        return config.architectures[0]
    backbone = modeling_auto.MODEL_MAPPING_NAMES.get(config.model_type)
    return backbone if isinstance(backbone, str) else type(config).__name__


def architecture_class(architecture: str, model_type: str, path: Path, *, claimed: bool = False,
                       ) -> type[PreTrainedModel]:
    """transformers' model class named ``architecture``.

    :param claimed: A plugin claimed the folder as its own format (``claim_model_folder``, e.g.
        Stanford ColBERT's ``HF_ColBERT``): an architecture transformers lacks is then the family's
        backbone class, and the rest of the folder is the plugin's to read.
    :raises ModelLoadError: when transformers has no such model class (a remote-code class such as
        ``Qwen2ForRewardModel``, a typo), naming the classes poolrunner serves for ``model_type``.
    """
    model_class = getattr(transformers, architecture, None)
    if not _is_model_class(model_class) and claimed:
        backbone = modeling_auto.MODEL_MAPPING_NAMES.get(model_type)
        model_class = getattr(transformers, backbone, None) if isinstance(backbone, str) else None
    if _is_model_class(model_class):
        return model_class
    raise ModelLoadError(
        f"{path}: architectures names {architecture!r}, which is not a transformers model class (poolrunner runs "
        f"only transformers' own classes, never a folder's code); for model_type {model_type!r} it serves "
        f"{served_classes(model_type)}. A class written as remote code has its own head layout: renaming it "
        "would load other weights, so such a folder cannot be served"
    )


def _is_model_class(candidate: Any) -> bool:
    return isinstance(candidate, type) and issubclass(candidate, PreTrainedModel)


def served_classes(model_type: str) -> str:
    """The transformers classes of ``model_type`` that poolrunner loads, as a readable list."""
    names = dict.fromkeys(
        name for mapping in _SERVED_MAPPINGS if isinstance(name := mapping.get(model_type), str)
        and hasattr(transformers, name)
    )
    return ", ".join(names) if names else "no class (transformers has no text model of this type)"


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (transformers' messages span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def _read_config_json(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {config_file}: {one_line(exc)}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_file}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _unknown_model_type(path: Path, model_type: str, auto_map: Any) -> str:
    if auto_map:
        files = sorted({str(ref).split(".", 1)[0] + ".py" for ref in _auto_map_refs(auto_map)})
        code = f"its auto_map names code inside the folder ({', '.join(files)}), which poolrunner never runs: "
    else:
        code = ""
    return (
        f"{path}: config.json's model_type {model_type!r} is not a transformers model type (transformers "
        f"{transformers.__version__}); {code}poolrunner runs only transformers' own classes. Families "
        f"transformers ships natively ({NATIVE_FAMILIES}, ...) load when config.json's model_type is "
        "transformers' own name for them"
    )


def _auto_map_refs(auto_map: Any) -> list[str]:
    """``module.Class`` references of an ``auto_map`` (values may be lists, with ``repo--`` prefixes)."""
    values = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
    refs = [ref for value in values for ref in (value if isinstance(value, list) else [value]) if ref]
    return [str(ref).rsplit("--", 1)[-1] for ref in refs]
