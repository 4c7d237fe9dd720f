"""MaxSim: ColBERT's late-interaction relevance score."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def maxsim(queries: Sequence[torch.Tensor], documents: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum over query tokens of max over document tokens of q . d``, per pair (ColBERT, PyLate).

    :param queries: ``[query_tokens, dim]`` float32 per pair (normalized token vectors).
    :param documents: ``[document_tokens, dim]`` float32 per pair.
    :returns: ``[num_pairs]`` float32.
    """
    return torch.stack([
        (query.float() @ document.float().T).amax(dim=1).sum()
        for query, document in zip(queries, documents, strict=True)
    ]) if queries else torch.zeros(0)
