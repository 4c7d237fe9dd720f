"""How classification logits become scores: the rules of vLLM, TEI and sentence-transformers.

One label -> sigmoid (a cross-encoder's relevance; softmax over one logit would always be 1.0);
two or more -> softmax (``torch.softmax`` subtracts the max, so logits like ``[-100, 1]`` or
``[1000, -1000]`` stay finite); ``problem_type`` ``multi_label_classification`` -> independent
sigmoids; ``regression`` -> identity. An activation named by a sentence-transformers
cross-encoder config wins, but only a class under ``torch.nn`` is ever used.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from poolrunner.core.errors import ModelLoadError
from poolrunner.core.types import ModelConfig

Activation = Callable[[torch.Tensor], torch.Tensor]


def classifier_activation(model_config: ModelConfig) -> Activation:
    """The activation over the last dimension (labels) of ``[..., num_labels]`` logits.

    :raises ModelLoadError: for a configured activation that is not a usable ``torch.nn`` class.
    """
    if model_config.classifier_activation is not None:
        activation = getattr(nn, model_config.classifier_activation, None)
        if not (isinstance(activation, type) and issubclass(activation, nn.Module)) or activation is nn.Module:
            raise ModelLoadError(
                f"model {model_config.name}: activation {model_config.classifier_activation!r} is not a torch.nn module"
            )
        try:
            # Softmax and its kin default to an implicit (deprecated, warning) dim: use the labels.
            return activation(dim=-1) if activation in (nn.Softmax, nn.LogSoftmax, nn.Softmin) else activation()
        except (TypeError, NotImplementedError) as exc:
            raise ModelLoadError(
                f"model {model_config.name}: activation {model_config.classifier_activation!r} cannot be built "
                f"without arguments: {exc}"
            ) from exc
    if model_config.problem_type == "regression":
        return lambda logits: logits
    if model_config.problem_type == "multi_label_classification" or len(model_config.labels) == 1:
        return torch.sigmoid  # softmax over one logit is always 1.0
    return lambda logits: torch.softmax(logits, dim=-1)  # subtracts the max: stable for any logits


def label_count_activation(logits: torch.Tensor) -> torch.Tensor:
    """TEI's and infinity's scores of ``[..., num_labels]`` logits: a sigmoid of one logit, a
    softmax over several, whatever activation or ``problem_type`` the folder names (TEI's
    ``Infer::predict``, infinity's ``BatchHandler.rerank``); same shape and dtype."""
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
