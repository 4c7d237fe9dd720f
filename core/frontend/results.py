"""Per-input results of the classification and ranking APIs."""

from __future__ import annotations

import numpy as np
from attrs import field, frozen


@frozen(kw_only=True, eq=False)
class ClassificationResult:
    """Scores of one input over the model's labels.

    :ivar probs: ``[num_labels]`` float32: probabilities after the head's activation, or raw
        logits when ``use_activation=False``.
    :ivar labels: Label names by index (``id2label``).
    """

    probs: np.ndarray = field(repr=lambda a: np.array2string(a, precision=4))
    labels: tuple[str, ...]

    @property
    def label(self) -> str:
        """The highest-scoring label."""
        return self.labels[int(np.argmax(self.probs))]

    @property
    def score(self) -> float:
        """The highest score."""
        return float(np.max(self.probs))


@frozen(kw_only=True)
class RerankResult:
    """One document's place in a ranking.

    :ivar index: Position of the document in the input list.
    :ivar score: Relevance: a cross-encoder's probability, or a bi-encoder's similarity (the folder's
        ``similarity_fn_name``, cosine unless it names another).
    :ivar document: The document's text, when ``return_documents=True``.
    """

    index: int
    score: float
    document: str | None = None
