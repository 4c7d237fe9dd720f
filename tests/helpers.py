"""Small numeric helpers shared by test modules (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

from typing import Any

import numpy as np

MIN_COSINE = 0.9999
"""The fp32 parity bar against an independent reference (vLLM's strict bar)."""


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
