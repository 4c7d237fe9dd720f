"""Engine outputs -> answers: arrays, classification results, rank order, quantized embeddings.

Every surface answers from these, so the Python API, the CLI and HTTP give the same numbers,
the same ``top_n`` and the same order. Errors are :class:`~poolrunner.core.errors.InvalidRequestError`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from poolrunner.core.frontend.quantize import Precision, quantize
from poolrunner.core.frontend.results import ClassificationResult, RerankResult
from poolrunner.core.plugin_api.output import RequestOutput

Result = np.ndarray | dict[str, np.ndarray]
"""One input's raw result: an array, or named arrays for a task with several outputs."""


def to_array(output: RequestOutput) -> Result:
    """An engine output on the CPU as numpy: floats as float32 whatever the model's dtype,
    integers (SPLADE's ``token_ids``) as they are; a dict of outputs stays a dict."""
    if isinstance(output, dict):
        return {name: to_array(tensor) for name, tensor in output.items()}  # type: ignore[misc]
    return output.float().numpy() if output.is_floating_point() else output.numpy()


def results(outputs: Sequence[RequestOutput], precision: Precision = "float32",
            ranges: np.ndarray | None = None) -> list[Result]:
    """One raw result per output; at a quantized ``precision`` (``embed`` outputs, float32
    ``[d]`` each) the vectors as :func:`~poolrunner.core.frontend.quantize.quantize` codes them,
    calibrated on these vectors unless ``ranges`` ``[2, d]`` are given."""
    arrays = [to_array(output) for output in outputs]
    if precision == "float32" or not arrays:
        return arrays
    return list(quantize(np.stack(arrays), precision, ranges))  # type: ignore[arg-type]


def classifications(outputs: Sequence[RequestOutput], labels: tuple[str, ...]) -> list[ClassificationResult]:
    """One :class:`ClassificationResult` per ``classify`` output ``[num_labels]``, over ``labels``."""
    return [ClassificationResult(probs=to_array(output), labels=labels) for output in outputs]  # type: ignore[arg-type]


def rank(scores: np.ndarray, documents: Sequence[str], *, top_n: int | None = None,
         return_documents: bool = False) -> list[RerankResult]:
    """Documents best first by ``scores`` ``[num_documents]`` (ties keep input order), the best
    ``top_n`` of them (all when ``None``), as vLLM, Cohere and Jina rank them."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]
    return [RerankResult(index=i, score=float(scores[i]), document=documents[i] if return_documents else None)
            for i in order]
