"""BGE-M3's relevance scores from two ``m3_embed`` outputs, per part and combined.

As FlagEmbedding's M3 embedder scores them (``FlagEmbedding/inference/embedder/encoder_only/m3.py``):

- dense: the dot product of the normalized vectors;
- sparse: ``compute_lexical_matching_score``, the sum over token ids present in both of
  ``w_query * w_document``;
- colbert: ``colbert_score``, for each query vector the largest dot product with any document
  vector, averaged over the query vectors;
- combined: ``compute_score``'s weighted mean ``sum(w_m * s_m) / sum(w_m)`` over the parts both
  outputs hold (the weights ``[0.4, 0.2, 0.4]`` of BGE-M3's model card by default).

Sums run in float64; results are float32.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .options import PARTS

# The named outputs that carry each part (see M3Pooler).
_PART_KEYS = {"dense": ("dense",), "sparse": ("token_ids", "weights"), "colbert": ("colbert",)}


def dense_score(query: torch.Tensor, document: torch.Tensor) -> torch.Tensor:
    """``q . d`` of two ``[hidden_size]`` float32 unit vectors; a float64 scalar."""
    return query.double() @ document.double()


def sparse_score(query: Mapping[str, torch.Tensor], document: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The lexical matching score of two ``{"token_ids": int64 [m], "weights": float32 [m]}``
    outputs (distinct ids each); a float64 scalar, 0 when no id is shared."""
    shared_query = torch.isin(query["token_ids"], document["token_ids"])
    query_ids, query_weights = query["token_ids"][shared_query], query["weights"][shared_query]
    doc_ids, doc_weights = document["token_ids"], document["weights"]
    order = torch.argsort(doc_ids)
    at = torch.searchsorted(doc_ids[order], query_ids)  # every shared id is found
    return (query_weights.double() * doc_weights[order][at].double()).sum()


def colbert_score(query: torch.Tensor, document: torch.Tensor) -> torch.Tensor:
    """Mean over the ``[n, dim]`` query vectors of the best dot product with any of the
    ``[m, dim]`` document vectors; a float64 scalar, 0 when either side has no vector."""
    if len(query) == 0 or len(document) == 0:
        return torch.zeros((), dtype=torch.float64)
    return (query.double() @ document.double().T).amax(dim=1).mean()


def part_scores(query: Mapping[str, torch.Tensor], document: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The score of every part both outputs hold, by part name."""
    scores = {}
    for part in PARTS:
        if all(key in query and key in document for key in _PART_KEYS[part]):
            if part == "dense":
                scores[part] = dense_score(query["dense"], document["dense"])
            elif part == "sparse":
                scores[part] = sparse_score(query, document)
            else:
                scores[part] = colbert_score(query["colbert"], document["colbert"])
    return scores


def combined_scores(queries: Sequence[Mapping[str, torch.Tensor]], documents: Sequence[Mapping[str, torch.Tensor]],
                    weights: Mapping[str, float]) -> torch.Tensor:
    """``sum(w_m * s_m) / sum(w_m)`` over the parts of each (query, document) pair.

    :param queries: One ``m3_embed`` output per pair.
    :param documents: One per pair, computed with the same ``outputs``.
    :param weights: A positive weight per part name.
    :returns: ``[num_pairs]`` float32.
    """
    combined = []
    for query, document in zip(queries, documents, strict=True):
        scores = part_scores(query, document)
        total = sum(weights[part] for part in scores)
        combined.append(sum(weights[part] * score for part, score in scores.items()) / total)
    return torch.stack(combined).float() if combined else torch.zeros(0)
