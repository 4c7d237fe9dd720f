"""Shapes of scoring requests and the bi-encoder similarity."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from poolrunner.core.errors import InvalidRequestError


def pair_up(queries: str | Sequence[str], documents: str | Sequence[str]) -> list[tuple[str, str]]:
    """The (query, document) pairs of a 1:1, 1:N or N:N request.

    A single query (a string or a one-item list) is paired with every document; N queries are
    paired one-to-one with N documents.

    :raises InvalidRequestError: for an empty side, a non-text item, or N:M with N != M and N > 1.
    """
    query_list = [queries] if isinstance(queries, str) else list(queries)
    document_list = [documents] if isinstance(documents, str) else list(documents)
    for side, items in (("queries", query_list), ("documents", document_list)):
        if not items:
            raise InvalidRequestError(f"{side} is empty: scoring needs at least one of each")
        bad = next((i for i, item in enumerate(items) if not isinstance(item, str)), None)
        if bad is not None:
            raise InvalidRequestError(f"{side}[{bad}] must be a string, got {items[bad]!r:.80}")
    if len(query_list) == 1:
        return [(query_list[0], document) for document in document_list]
    if len(query_list) == len(document_list):
        return list(zip(query_list, document_list, strict=True))
    raise InvalidRequestError(
        f"cannot score {len(query_list)} queries against {len(document_list)} documents: "
        "use 1:1, 1:N (one query) or N:N (equal lengths)"
    )


def cosine(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of ``[n, d]`` arrays, in float32, ``[n]``."""
    left, right = left.astype(np.float32), right.astype(np.float32)
    norms = np.linalg.norm(left, axis=1) * np.linalg.norm(right, axis=1)
    return (np.einsum("nd,nd->n", left, right) / np.maximum(norms, np.finfo(np.float32).tiny)).astype(np.float32)
