"""Loads a local model folder through transformers' own modelling code."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from poolrunner.core.config import check_device
from poolrunner.core.errors import ModelLoadError
from poolrunner.core.kernels.attention import ATTENTION_NAME
from poolrunner.core.model import checkpoint, families
from poolrunner.core.model import token_logits as token_logits_rules
from poolrunner.core.model.families import one_line
from poolrunner.core.model.page_retrieval import PageRetrievalModel
from poolrunner.core.model.siglip import TOWERS
from poolrunner.core.types import TextPadding, TokenLogits

_HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    """``auto`` is CUDA when present, else the CPU.

    :raises InvalidRequestError: for a device torch does not know, or CUDA where there is none
        (:func:`~poolrunner.core.config.check_device`).
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_device(device)
    return torch.device(device)


def auto_dtype(hf_config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """``dtype="auto"`` without a measurement: the config's half dtype (else bfloat16) on CUDA,
    float32 elsewhere. On a CPU with native bf16 the runtime measures instead
    (:mod:`poolrunner.core.precision`)."""
    if device.type != "cuda":
        return torch.float32
    declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", "")
    config_dtype = str(declared).removeprefix("torch.")
    return _HALF.get(config_dtype, torch.bfloat16)


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # OSError, ValueError, a tokenizer class of the folder's own code...
        raise ModelLoadError(f"cannot load the tokenizer of {path}: {one_line(exc)}") from exc


def load_model(
    path: Path, hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
    token_logits: TokenLogits | None = None, *, claimed: bool = False, image_positions: int | None = None,
    text_padding: TextPadding | None = None,
) -> nn.Module:
    """Load the weights with the class ``config.architectures`` names, in eval mode.

    Attention runs through poolrunner's packed attention function, so the model accepts
    padding-free batches, where the family dispatches attention through transformers' interface.

    :param token_logits: Load the family's causal LM instead and keep only these rows of its LM
        head, as its classification head (:mod:`~poolrunner.core.model.token_logits`).
    :param claimed: A plugin claimed the folder's format: see
        :func:`~poolrunner.core.model.families.architecture_class` and
        :func:`~poolrunner.core.model.checkpoint.check_loaded`.
    :param image_positions: A text-image model's positions per image; with ``text_padding``,
        given to its backbone (:mod:`~poolrunner.core.model.towers`).
    :returns: The full model (head included); the runner calls its ``base_model``.
    :raises ModelLoadError: if transformers does not know the architecture, the weights fail to
        load, or they differ from the class's (:func:`~poolrunner.core.model.checkpoint.check_loaded`).
    """
    model_class = (token_logits_rules.causal_lm_class(hf_config, path) if token_logits is not None
                   else families.architecture_class(families.architecture_name(hf_config), hf_config.model_type, path,
                                                    claimed=claimed))
    # Families with attention of their own (DeBERTa-v2, MPNet) cannot take the packed attention;
    # the runner gives them padded batches instead.
    vision = families.is_text_image(hf_config) or families.is_page_retrieval(hf_config)
    packed = getattr(model_class, "_supports_attention_backend", True) and not vision
    # Text-image towers and page-retrieval models run padded with transformers' default attention
    # (their reference's); so do other padded families that support SDPA (T5's encoders: its
    # position bias becomes SDPA's additive mask), in one kernel instead of eager passes.
    sdpa = vision or getattr(model_class, "_supports_sdpa", False)
    attention = ATTENTION_NAME if packed else "sdpa" if sdpa else "eager"
    try:
        with _quiet_transformers():
            model, info = model_class.from_pretrained(
                path, config=hf_config, dtype=dtype, attn_implementation=attention,
                local_files_only=True, output_loading_info=True, trust_remote_code=False,
                ignore_mismatched_sizes=True,  # refused by check_loaded, naming the weights
            )
    except Exception as exc:  # OSError, ValueError, a config whose modules transformers cannot build...
        raise ModelLoadError(f"cannot load the weights of {path} as {model_class.__name__}: {one_line(exc)}") from exc
    if token_logits is not None:
        token_logits_rules.check_lm_head_loaded(path, info.get("missing_keys", ()))
    checkpoint.check_loaded(path, model, info, claimed=claimed)
    if token_logits is not None:
        token_logits_rules.install_head(model, token_logits)
    if families.is_text_image(hf_config):
        assert image_positions is not None
        model = TOWERS[hf_config.model_type](model, image_positions=image_positions, text_padding=text_padding)
    elif families.is_page_retrieval(hf_config):
        model = PageRetrievalModel(model)
    return model.to(device).eval()


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    # transformers draws a progress bar and a load report per load; poolrunner reports loading
    # itself, and refuses (one line, check_loaded) what the report would only warn about.
    enabled = transformers.utils.logging.is_progress_bar_enabled()
    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.utils.logging.set_verbosity(verbosity)
        if enabled:
            transformers.utils.logging.enable_progress_bar()
