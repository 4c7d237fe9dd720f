"""Matryoshka ``dimensions``: which sizes a model accepts (vLLM's rules)."""

from __future__ import annotations

from poolrunner.core.errors import DimensionsNotSupportedError, InvalidRequestError
from poolrunner.core.types import ModelConfig


def check_dimensions(model_config: ModelConfig, dimensions: int | None, size: int) -> None:
    """Accept ``dimensions`` only for Matryoshka models, within ``1..size`` and the declared list.

    :param size: The full output width (``embedding_size`` for sentences, ``hidden_size`` per token).
    :raises InvalidRequestError: naming the model, the value and what is allowed.
    """
    if dimensions is None:
        return
    name = model_config.name
    if not model_config.is_matryoshka:
        raise DimensionsNotSupportedError(
            f"model {name} does not support Matryoshka dimensions (got dimensions={dimensions}): it answers all "
            f"{size} dimensions; its config declares neither is_matryoshka nor matryoshka_dimensions; load it "
            f"with is_matryoshka=True (--is-matryoshka on the command line and the server) to allow 1..{size}",
            param="dimensions",
        )
    if not 1 <= dimensions <= size:
        raise InvalidRequestError(f"dimensions={dimensions} is out of range for model {name}: 1..{size}",
                                  param="dimensions")
    allowed = model_config.matryoshka_dimensions
    if allowed and dimensions not in allowed:
        raise InvalidRequestError(
            f"dimensions={dimensions} is not one of the Matryoshka dimensions of model {name}: {list(allowed)}",
            param="dimensions",
        )
