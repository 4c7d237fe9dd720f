"""Small helpers shared by test modules (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

MIN_COSINE = 0.9999
"""The fp32 parity bar against an independent reference (vLLM's strict bar)."""


def bf16_products() -> bool:
    """Whether this CPU's oneDNN multiplies bfloat16 (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): not on
    an AVX2-only CPU, where ``bf16-mixed`` is refused at load and bfloat16 layers are not packed."""
    import torch

    from poolrunner.core.model import onednn

    return onednn.supported(torch.device("cpu"), torch.bfloat16)


def run_requests(runtime: Any, requests: Sequence[Any]) -> dict[str, Any]:
    """Run ``PoolingRequest``s as given through ``runtime``'s public serving loop
    (:meth:`poolrunner.Runtime.serving`): ``{request_id: output}``. They are admitted together, so
    they share steps as the budget allows; raises what ``Serving.run`` raises
    (``InvalidRequestError`` at admission, and then none of them ran)."""
    import asyncio

    with runtime.serving() as serving:
        outputs = asyncio.run(serving.run(list(requests)))
    return {request.request_id: output for request, output in zip(requests, outputs, strict=True)}


def cosine_rows(a: Any, b: Any) -> np.ndarray:
    """Row-wise cosine similarity of two ``[n, d]`` (or ``[d]``) arrays, in float64."""
    a = np.atleast_2d(np.asarray(a, dtype=np.float64))
    b = np.atleast_2d(np.asarray(b, dtype=np.float64))
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def normalized(x: np.ndarray) -> np.ndarray:
    """L2-normalize along the last axis."""
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def widen_weights(model: Any, std: float = 0.2) -> Any:
    """Redraw every weight matrix of a seeded tiny ``model`` from N(0, ``std``), in place: the
    default init (std 0.02) leaves outputs nearly input-independent, so a wrong row, head or token
    would pass unseen. Returns ``model``."""
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, std)
    return model


def qwen2_style_bpe(corpus: Sequence[str], vocab_size: int, specials: list[str]) -> Any:
    """A byte-level BPE (``tokenizers.Tokenizer``) trained on ``corpus`` with Qwen2's
    pre-tokenization: transformers loads a ``qwen2`` / ``qwen3`` folder's tokenizer as
    ``Qwen2Tokenizer``, which rebuilds this pipeline from the vocabulary and merges (a WordLevel
    model would turn every text into one unknown token)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus, trainer)
    return backend
