"""Loads a local model folder through transformers' own modelling code."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from poolrunner.core.errors import ModelLoadError
from poolrunner.core.model import token_logits as token_logits_rules
from poolrunner.core.model.attention import ATTENTION_NAME
from poolrunner.core.types import TokenLogits

_HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# Top-level weight names of classification heads in transformers' *For*Classification classes.
_HEAD_PREFIXES = frozenset({"classifier", "score", "pre_classifier"})


def resolve_device(device: str) -> torch.device:
    """``auto`` is CUDA when present, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def auto_dtype(hf_config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """``dtype="auto"`` without a measurement: the config's half dtype (else bfloat16) on CUDA,
    float32 elsewhere. On a CPU with native bf16 the runtime measures instead
    (:mod:`poolrunner.core.engine.precision`)."""
    if device.type != "cuda":
        return torch.float32
    declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", "")
    config_dtype = str(declared).removeprefix("torch.")
    return _HALF.get(config_dtype, torch.bfloat16)


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {path}: {exc}") from exc


def load_model(
    path: Path, hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
    token_logits: TokenLogits | None = None,
) -> nn.Module:
    """Load the weights with the class ``config.architectures`` names, in eval mode.

    Attention runs through poolrunner's packed attention function, so the model accepts
    padding-free batches, where the family dispatches attention through transformers' interface.

    :param token_logits: Load the family's causal LM instead and keep only these rows of its LM
        head, as its classification head (:mod:`~poolrunner.core.model.token_logits`).
    :returns: The full model (head included); the runner calls its ``base_model``.
    :raises ModelLoadError: if transformers does not know the architecture or the weights fail to load.
    """
    model_class = (token_logits_rules.causal_lm_class(hf_config, path) if token_logits is not None
                   else architecture_class((hf_config.architectures or ["AutoModel"])[0]))
    # Families with attention of their own (DeBERTa-v2, MPNet) cannot take the packed attention;
    # the runner gives them padded batches instead.
    packed = getattr(model_class, "_supports_attention_backend", True)
    try:
        with _quiet_progress():
            model, info = model_class.from_pretrained(
                path, config=hf_config, dtype=dtype, attn_implementation=ATTENTION_NAME if packed else "eager",
                local_files_only=True, output_loading_info=True,
            )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the weights of {path} as {model_class.__name__}: {exc}") from exc
    if token_logits is not None:
        token_logits_rules.check_lm_head_loaded(path, info.get("missing_keys", ()))
    _check_no_dropped_head(path, model_class.__name__, info.get("unexpected_keys", ()))
    if token_logits is not None:
        token_logits_rules.install_head(model, token_logits)
    return model.to(device).eval()


def architecture_class(architecture: str) -> type:
    """transformers' class named ``architecture`` (``config.architectures[0]``), else ``AutoModel``."""
    return getattr(transformers, architecture, None) or transformers.AutoModel


def _check_no_dropped_head(path: Path, class_name: str, unexpected_keys: Iterable[str]) -> None:
    """A trained head that the configured class has no place for would be dropped silently:
    a cross-encoder saved with ``architectures: ["BertModel"]`` would then embed instead of score."""
    heads = sorted(key for key in unexpected_keys if key.split(".", 1)[0] in _HEAD_PREFIXES)
    if heads:
        raise ModelLoadError(
            f"{path}: the weights hold a head ({', '.join(heads)}) that {class_name} does not use; "
            "config.json `architectures` decides the head, so name the class the weights were "
            "trained as (e.g. BertForSequenceClassification)"
        )


@contextmanager
def _quiet_progress() -> Iterator[None]:
    # transformers draws a progress bar per load; poolrunner reports loading itself.
    enabled = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            transformers.utils.logging.enable_progress_bar()
