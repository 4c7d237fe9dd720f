"""Shapes of scoring requests, the bi-encoder similarity and late interaction (MaxSim)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from poolrunner.core.errors import InvalidRequestError
from poolrunner.core.validators import check_text, shown


def pair_up(queries: str | Sequence[str], documents: str | Sequence[str], *,
            names: tuple[str, str] = ("queries", "documents")) -> list[tuple[str, str]]:
    """The (query, document) pairs of a 1:1, 1:N or N:N request.

    A single query (a string or a one-item list) is paired with every document; N queries are
    paired one-to-one with N documents.

    :param names: What the caller calls the two sides (its parameters, a body's fields), for errors.
    :raises InvalidRequestError: for an empty side, a non-text item, text that is not valid Unicode
        (:func:`check_side`), or N:M with N != M and N > 1.
    """
    query_list = check_side(queries, names[0])
    document_list = check_side(documents, names[1])
    if len(query_list) == 1:
        return [(query_list[0], document) for document in document_list]
    if len(query_list) == len(document_list):
        return list(zip(query_list, document_list, strict=True))
    raise InvalidRequestError(
        f"cannot score {len(query_list)} queries against {len(document_list)} documents: "
        "use 1:1, 1:N (one query) or N:N (equal lengths)"
    )


def text_labels(queries: str | Sequence[str], documents: str | Sequence[str], *,
                names: tuple[str, str] = ("queries", "documents")) -> dict[str, tuple[str, str]]:
    """Each text of a scoring request by where the caller first sent it, ``(label, param)``:
    ``("documents[1]", "documents")``, or ``("query", "query")`` for a side sent as one string;
    errors found after the texts are deduplicated and sorted name them so."""
    labels: dict[str, tuple[str, str]] = {}
    for side, name in zip((queries, documents), names, strict=True):
        items = [side] if isinstance(side, str) else side
        for index, text in enumerate(items):
            labels.setdefault(text, (name if isinstance(side, str) else f"{name}[{index}]", name))
    return labels


def check_side(texts: str | Sequence[str], name: str) -> list[str]:
    """One side of a scoring request as a list, each item checked: a string of valid Unicode.

    Checked here, before pairing, because scoring tokenizes each distinct text once in sorted
    order: an error found there could not say which of the caller's texts it was. The error names
    the side and the position as the caller sent them: ``documents[2]``, or ``query`` for a side
    sent as one string.

    :raises InvalidRequestError: for a side that is one non-text item (an image's bytes: not read
        as a list of numbers), an empty side, a non-text item, or text that is not valid Unicode
        (a lone surrogate), with ``param`` the side's ``name``.
    """
    if not isinstance(texts, str | list | tuple):
        raise InvalidRequestError(f"{name} must be a string or a list of strings, got {shown(texts)}", param=name)
    items = [texts] if isinstance(texts, str) else list(texts)
    if not items:
        raise InvalidRequestError(f"{name} is empty: scoring needs at least one of each", param=name)
    for index, item in enumerate(items):
        where = name if isinstance(texts, str) else f"{name}[{index}]"
        if not isinstance(item, str):
            raise InvalidRequestError(f"{where} must be a string, got {shown(item)}", param=name)
        check_text(item, where, param=name)
    return items


def sigmoid_score(cosines: np.ndarray, logit_scale: float, logit_bias: float) -> np.ndarray:
    """SigLIP's (text, image) probability from the cosine of the pair's embeddings:
    ``sigmoid(cosine * exp(logit_scale) + logit_bias)``, i.e. ``torch.sigmoid`` of
    ``SiglipModel``'s ``logits_per_text`` (transformers' zero-shot pipeline's scores). ``[n]`` float32."""
    logits = cosines.astype(np.float64) * np.exp(logit_scale) + logit_bias
    return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)


def maxsim(queries: Sequence[np.ndarray], documents: Sequence[np.ndarray]) -> np.ndarray:
    """Late interaction per pair: the sum over query tokens of the best dot product with any
    document token (ColBERT's MaxSim; ColPali's ``score_retrieval`` of one query and one page).

    :param queries: ``[query_tokens, d]`` per pair.
    :param documents: ``[document_tokens, d]`` per pair.
    :returns: ``[num_pairs]`` float32.
    """
    return np.array([(query.astype(np.float32) @ document.astype(np.float32).T).max(axis=1).sum()
                     for query, document in zip(queries, documents, strict=True)], dtype=np.float32)
