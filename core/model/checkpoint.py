"""Whether a checkpoint's weights are exactly the configured class's: nothing dropped, nothing random.

transformers loads what matches, drops weights the class has no place for ("unexpected") and
initializes the ones the folder lacks ("missing") at random, with a log line at most. Either
silently changes the answer (a BERT ``relative_key`` checkpoint losing its
``distance_embedding``; a classifier with a random head), so poolrunner refuses the load unless
every difference is on this short list, where no output poolrunner computes reads the weight:

* unexpected ``pooler.*`` (a BERT-style pooler, in a checkpoint loaded by a class without one);
* unexpected masked-LM / causal-LM heads (``cls.*``, ``lm_head.*``, ELECTRA's generator, DistilBERT's
  ``vocab_*``, DeBERTa's ``lm_predictions.*``): a backbone loaded from an LM checkpoint;
* unexpected legacy buffers that transformers now computes from the config (``position_ids``,
  ``token_type_ids``, rotary ``inv_freq``, GPT-2's ``attn.bias`` / ``attn.masked_bias`` masks);
* missing ``pooler.*`` in a class whose output never reads it (every class but a
  ``*ForSequenceClassification``, whose BERT-style head runs the pooler).

A folder a plugin claimed as its own format (``claim_model_folder``: Stanford ColBERT's
``linear.weight`` beside the backbone) may hold weights the class drops: the plugin reads those
itself. Weights of another shape and missing ones are refused all the same.

Modules of the class outside its backbone are applied by poolrunner only as a classification head
(:mod:`~poolrunner.core.model.heads`) or an LM head; any other (``CLIPTextModelWithProjection``'s
``text_projection``, a question-answering head) refuses the load.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from pathlib import Path

from torch import nn

from poolrunner.core.errors import ModelLoadError
from poolrunner.core.model.families import LM_CLASSES, served_classes

# Top-level weight names of classification heads in transformers' *For*Classification classes.
_CLASSIFIER_PREFIXES = frozenset({"classifier", "score", "pre_classifier"})
_POOLER = "pooler"
_LM_HEAD_PREFIXES = frozenset({"cls", "lm_head", "generator_predictions", "generator_lm_head", "vocab_transform",
                               "vocab_layer_norm", "vocab_projector", "lm_predictions"})
_LEGACY_BUFFERS = frozenset({"position_ids", "token_type_ids", "inv_freq", "masked_bias"})
_CLASSIFIER_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification")


def check_loaded(path: Path, model: nn.Module, info: dict[str, Collection[str]], *, claimed: bool = False) -> None:
    """Refuse a load whose weights differ from ``model``'s class beyond the module's allow-list.

    :param info: transformers' ``output_loading_info`` (``mismatched_keys``, ``missing_keys``,
        ``unexpected_keys``), of a load with ``ignore_mismatched_sizes=True``.
    :param claimed: A plugin claimed the folder: it reads the weights the class drops.
    :raises ModelLoadError: naming the folder, the class and the keys (at most five) of another
        shape, dropped or left random, or the modules outside the backbone that poolrunner would
        not apply.
    """
    class_name = type(model).__name__
    prefix = getattr(model, "base_model_prefix", "")
    mismatched = [f"{key} {tuple(saved)} (the config makes {tuple(built)})"
                  for key, saved, built in info.get("mismatched_keys", ())]
    if mismatched:
        raise ModelLoadError(
            f"{path}: weights of another shape than config.json describes: {_keys(mismatched)}; the config does not "
            "belong to these weights"
        )
    unexpected = sorted(info.get("unexpected_keys", ()))
    heads = [key for key in unexpected if _head(key, prefix) in _CLASSIFIER_PREFIXES]
    if heads:
        raise ModelLoadError(
            f"{path}: the weights hold a head ({_keys(heads)}) that {class_name} does not use; config.json "
            f"`architectures` decides the head, so name the class the weights were trained as (for model_type "
            f"{model.config.model_type!r}: {served_classes(model.config.model_type)})"
        )
    dropped = [] if claimed else [key for key in unexpected if not _ignorable_unexpected(key, prefix)]
    if dropped:
        raise ModelLoadError(
            f"{path}: {class_name} has no place for the weights {_keys(dropped)}, which transformers would drop; "
            "the checkpoint was trained as another model (a setting in config.json differs from its training, "
            "such as position_embedding_type), so it is refused rather than run without them"
        )
    reads_pooler = class_name.endswith("ForSequenceClassification")
    random = sorted(key for key in info.get("missing_keys", ())
                    if reads_pooler or _head(key, prefix) != _POOLER)
    if random:
        raise ModelLoadError(
            f"{path}: the weights lack {_keys(random)}, which {class_name} would fill with random values; "
            "name the class the weights were saved as in config.json `architectures`, or complete the folder"
        )
    _check_outside_backbone(path, model)


def _check_outside_backbone(path: Path, model: nn.Module) -> None:
    class_name = type(model).__name__
    if class_name.endswith(_CLASSIFIER_SUFFIXES) or class_name in LM_CLASSES:
        return
    backbone = getattr(model, "base_model", model)
    if backbone is model:  # the class is its own backbone (BertModel, CLIPTextModel)
        return
    extra = [name for name, child in model.named_children()
             if child is not backbone and any(True for _ in child.parameters())]
    if extra:
        raise ModelLoadError(
            f"{path}: {class_name} applies {', '.join(extra)} after its backbone, which poolrunner does not run; "
            f"it is refused rather than served without them (for model_type {model.config.model_type!r} "
            f"poolrunner serves {served_classes(model.config.model_type)})"
        )


def _head(key: str, base_prefix: str) -> str:
    """The top-level module of a weight name, below the backbone's own prefix."""
    parts = key.split(".")
    if base_prefix and parts[0] == base_prefix and len(parts) > 1:
        parts = parts[1:]
    return parts[0]


def _ignorable_unexpected(key: str, base_prefix: str) -> bool:
    head = _head(key, base_prefix)
    last = key.rsplit(".", 1)[-1]
    gpt2_mask = key.endswith(".attn.bias")
    return head == _POOLER or head in _LM_HEAD_PREFIXES or last in _LEGACY_BUFFERS or gpt2_mask


def _keys(keys: Iterable[str]) -> str:
    keys = list(keys)
    return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
