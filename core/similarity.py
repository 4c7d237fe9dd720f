"""Similarity of embeddings, as sentence-transformers' ``SimilarityFunction`` defines them."""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np

from poolrunner.core.errors import InvalidRequestError

SimilarityFn = Literal["cosine", "dot", "euclidean", "manhattan"]
"""``cosine``; ``dot`` product; ``euclidean`` and ``manhattan`` as the *negative* distance, so
that higher always means more similar (sentence-transformers' convention)."""

SIMILARITY_FNS: tuple[SimilarityFn, ...] = get_args(SimilarityFn)


def check_similarity_fn(name: object) -> SimilarityFn:
    """:raises InvalidRequestError: unless ``name`` is one of :data:`SIMILARITY_FNS`."""
    if name not in SIMILARITY_FNS:
        raise InvalidRequestError(f"similarity_fn_name must be one of {list(SIMILARITY_FNS)}, got {name!r}")
    return name  # type: ignore[return-value]


def similarity(left: np.ndarray, right: np.ndarray, fn: SimilarityFn) -> np.ndarray:
    """Every row of ``left`` ``[n, d]`` against every row of ``right`` ``[m, d]``: ``[n, m]``
    float32 (sentence-transformers' ``model.similarity``). 1-D inputs are one row."""
    a, b = _rows(left, right)
    if fn == "cosine":
        return (_unit(a) @ _unit(b).T).astype(np.float32)
    if fn == "dot":
        return (a @ b.T).astype(np.float32)
    order = 2 if fn == "euclidean" else 1
    return -np.linalg.norm(a[:, None, :] - b[None, :, :], ord=order, axis=-1).astype(np.float32)


def similarity_pairwise(left: np.ndarray, right: np.ndarray, fn: SimilarityFn) -> np.ndarray:
    """Row ``i`` of ``left`` against row ``i`` of ``right``: ``[n]`` float32
    (sentence-transformers' ``model.similarity_pairwise``)."""
    a, b = _rows(left, right)
    if a.shape[0] != b.shape[0]:
        raise InvalidRequestError(f"pairwise similarity needs as many rows on each side, got {a.shape[0]} and "
                                  f"{b.shape[0]}")
    if fn == "cosine":
        return np.einsum("nd,nd->n", _unit(a), _unit(b)).astype(np.float32)
    if fn == "dot":
        return np.einsum("nd,nd->n", a, b).astype(np.float32)
    return -np.linalg.norm(a - b, ord=2 if fn == "euclidean" else 1, axis=-1).astype(np.float32)


def _rows(left: np.ndarray, right: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a, b = (np.atleast_2d(np.asarray(x, dtype=np.float64)) for x in (left, right))
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise InvalidRequestError(f"similarity needs [n, d] and [m, d] embeddings of one width, got shapes "
                                  f"{list(a.shape)} and {list(b.shape)}")
    return a, b


def _unit(rows: np.ndarray) -> np.ndarray:
    # A zero vector stays zero (its cosine is 0), as torch's normalize leaves it.
    return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
