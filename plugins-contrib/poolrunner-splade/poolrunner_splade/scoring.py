"""Sparse dot product and cosine of SPLADE outputs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def sparse_similarity(queries: Sequence[Mapping[str, torch.Tensor]],
                      documents: Sequence[Mapping[str, torch.Tensor]], fn: str = "dot") -> torch.Tensor:
    """``sum(q[t] * d[t])`` over the token ids present in both, per pair (``fn`` "dot"), or that
    divided by both vectors' norms ("cosine"; 0 for a zero vector), as sentence-transformers'
    ``SparseEncoder.similarity`` computes them.

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
        dot = (query["weights"].double()[shared] * doc_weights[at[shared]]).sum()
        if fn == "cosine":
            norms = torch.linalg.vector_norm(query["weights"].double()) * torch.linalg.vector_norm(doc_weights)
            dot = dot / norms if norms > 0 else dot * 0
        scores.append(dot)
    return torch.stack(scores).float() if scores else torch.zeros(0)
