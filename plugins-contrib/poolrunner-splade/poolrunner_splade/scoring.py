"""Sparse dot product of SPLADE outputs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def sparse_dot(queries: Sequence[Mapping[str, torch.Tensor]],
               documents: Sequence[Mapping[str, torch.Tensor]]) -> torch.Tensor:
    """``sum(q[t] * d[t])`` over the token ids present in both, per pair.

    :param queries: ``{"token_ids": int64 [k], "weights": float32 [k]}`` per pair.
    :param documents: The same, one per pair.
    :returns: ``[num_pairs]`` float32 (accumulated in float64).
    """
    scores = []
    for query, document in zip(queries, documents, strict=True):
        doc_ids, order = torch.sort(document["token_ids"])
        doc_weights = document["weights"][order].double()
        at = torch.searchsorted(doc_ids, query["token_ids"]).clamp(max=max(len(doc_ids) - 1, 0))
        shared = doc_ids[at] == query["token_ids"] if len(doc_ids) else torch.zeros_like(query["token_ids"], dtype=bool)
        scores.append((query["weights"].double()[shared] * doc_weights[at[shared]]).sum())
    return torch.stack(scores).float() if scores else torch.zeros(0)
