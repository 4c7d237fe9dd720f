"""The request options of ``m3_embed``: which parts a request computes, and how ``score`` weighs them.

Pure Python (no torch), so the plugin imports cheaply.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from poolrunner.core import RequestOption

TASK = "m3_embed"
PARTS = ("dense", "sparse", "colbert")
"""BGE-M3's three representations, in the order FlagEmbedding lists its score modes' weights."""

ALL_PARTS = ",".join(PARTS)

# The weights BGE-M3's model card uses with FlagEmbedding's compute_score
# (weights_for_different_modes=[0.4, 0.2, 0.4] for dense, sparse, colbert). FlagEmbedding's own
# default is [1, 1, 1]; either way it divides the weighted sum by the sum of the weights.
DEFAULT_WEIGHTS = {"dense": 0.4, "sparse": 0.2, "colbert": 0.4}


def parse_outputs(value: str) -> tuple[str, ...]:
    """``"sparse, dense"`` -> ``("dense", "sparse")``: the named parts in :data:`PARTS` order.

    The value must have passed :func:`outputs_problem`.
    """
    named = {name.strip() for name in value.split(",")}
    return tuple(part for part in PARTS if part in named)


def outputs_problem(value: str) -> str | None:
    """What is wrong with an ``outputs`` value (for :class:`RequestOption`), or ``None``."""
    names = [name.strip() for name in value.split(",")]
    unknown = next((name for name in names if name not in PARTS), None)
    if unknown is not None:
        return f"must name parts among {', '.join(PARTS)}, comma-separated; {unknown!r} is not one"
    if len(set(names)) != len(names):
        return "names a part twice"
    return None


def positive_problem(value: float) -> str | None:
    """A mode weight must be a positive finite number (leave a part out of ``outputs`` to drop it)."""
    return None if math.isfinite(value) and value > 0 else "must be a positive number"


def weight_name(part: str) -> str:
    """The option that weighs ``part`` in ``score``: ``dense_weight``, ``sparse_weight``, ``colbert_weight``
    (the keyword names of FlagEmbedding's ``compute_score``)."""
    return f"{part}_weight"


def score_weights(options: Mapping[str, Any]) -> dict[str, float]:
    """Each part's weight from a request's resolved options, defaults where absent."""
    return {part: float(options.get(weight_name(part), DEFAULT_WEIGHTS[part])) for part in PARTS}


OUTPUTS = RequestOption(
    name="outputs", type=str, tasks={TASK}, default=ALL_PARTS, check=outputs_problem,
    help="The BGE-M3 parts to compute, comma-separated among dense, sparse, colbert; score combines these parts.",
)

WEIGHTS = [
    RequestOption(
        name=weight_name(part), type=float, tasks={TASK}, default=DEFAULT_WEIGHTS[part], check=positive_problem,
        help=f"Weight of the {part} score when score combines the parts (weighted mean, as FlagEmbedding's "
             "compute_score); ignored by /pooling and encode.",
    )
    for part in PARTS
]
