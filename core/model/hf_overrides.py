"""``hf_overrides``: the user's changes to a folder's ``config.json``, applied as vLLM applies them.

vLLM's ``hf_overrides`` (``LLM(..., hf_overrides={...})``, ``--hf-overrides JSON``) sets each key
on the loaded transformers config; a dict given for a key whose value is itself a config (a
multimodal model's ``text_config``) updates that config's keys. poolrunner does the same before it
reads anything else from the config, so an override decides the architecture, the labels and
whatever a plugin reads from ``model_config.hf_config``. What LLM rerankers add
(``classifier_from_token``, ``method``, ``is_original_qwen3_reranker``) is read by
:mod:`poolrunner.core.model.token_logits`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from poolrunner.core.errors import ModelLoadError


def apply_hf_overrides(hf_config: PretrainedConfig, overrides: Mapping[str, Any], path: Path) -> None:
    """Set each of ``overrides`` on ``hf_config``, in place; nested dicts update nested configs.

    :raises ModelLoadError: naming the key, for an ``architectures`` that is not a non-empty list of
        class names, or a value the config refuses.
    """
    for key, value in overrides.items():
        current = getattr(hf_config, key, None)
        if isinstance(current, PretrainedConfig) and isinstance(value, Mapping):
            apply_hf_overrides(current, value, path)
            continue
        if key == "architectures" and not (
            isinstance(value, list) and value and all(isinstance(name, str) and name for name in value)
        ):
            raise ModelLoadError(
                f"hf_overrides 'architectures' must be a non-empty list of class names, got {value!r}"
            )
        try:
            setattr(hf_config, key, value)
        except (TypeError, ValueError, AttributeError) as exc:
            raise ModelLoadError(
                f"hf_overrides {key!r}={value!r} does not apply to the config of {path}: {exc}"
            ) from None
