"""How classification logits become scores: the rules of vLLM, TEI and sentence-transformers.

Classification (:func:`classifier_activation`, vLLM's ``classify`` and transformers'
text-classification pipeline): one label -> sigmoid (softmax over one logit would always be
1.0); two or more -> softmax (``torch.softmax`` subtracts the max, so logits like ``[-100, 1]``
or ``[1000, -1000]`` stay finite); ``problem_type`` ``multi_label_classification`` ->
independent sigmoids; ``regression`` -> identity.

Scoring pairs (:func:`score_activation`, vLLM's ``score`` and sentence-transformers'
``CrossEncoder.predict``): the activation a cross-encoder's folder names wins (``Identity`` for
the ms-marco cross-encoders: raw logits), but only a class under ``torch.nn`` is ever used;
without one, a sigmoid of the one logit, ``problem_type`` aside.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from poolrunner.core.errors import ModelLoadError
from poolrunner.core.types import ModelConfig

Activation = Callable[[torch.Tensor], torch.Tensor]


def classifier_activation(model_config: ModelConfig) -> Activation:
    """The classification activation over the last dimension (labels) of ``[..., num_labels]``
    logits, by ``problem_type`` and the label count; a cross-encoder's named activation is not
    read here (vLLM's ``classify`` does not read it either: it scores pairs, :func:`score_activation`)."""
    if model_config.problem_type == "regression":
        return lambda logits: logits
    if model_config.problem_type == "multi_label_classification" or len(model_config.labels) == 1:
        return torch.sigmoid  # softmax over one logit is always 1.0
    return lambda logits: torch.softmax(logits, dim=-1)  # subtracts the max: stable for any logits


def score_activation(model_config: ModelConfig) -> Activation:
    """A cross-encoder's pair-score activation over the labels' dimension, as
    ``CrossEncoder.predict`` applies it: the ``torch.nn`` class its folder names
    (:attr:`~poolrunner.core.types.ModelConfig.classifier_activation`), else sigmoid for one label
    and identity for more (sentence-transformers' default, whatever ``problem_type`` says: a
    1-label reranker trained as ``regression`` still scores through a sigmoid; vLLM's ``score``
    too).

    :raises ModelLoadError: for a name that is not a ``torch.nn`` module, or one that cannot be
        built without arguments.
    """
    name = model_config.classifier_activation
    if name is None:
        return torch.sigmoid if len(model_config.labels) == 1 else (lambda logits: logits)
    activation = getattr(nn, name, None)
    if not (isinstance(activation, type) and issubclass(activation, nn.Module)) or activation is nn.Module:
        raise ModelLoadError(f"model {model_config.name}: activation {name!r} is not a torch.nn module")
    try:
        # Softmax and its kin default to an implicit (deprecated, warning) dim: use the labels.
        return activation(dim=-1) if activation in (nn.Softmax, nn.LogSoftmax, nn.Softmin) else activation()
    except (TypeError, NotImplementedError) as exc:
        raise ModelLoadError(f"model {model_config.name}: activation {name!r} cannot be built without arguments: "
                             f"{exc}") from exc


def label_count_activation(logits: torch.Tensor) -> torch.Tensor:
    """TEI's and infinity's scores of ``[..., num_labels]`` logits: a sigmoid of one logit, a
    softmax over several, whatever activation or ``problem_type`` the folder names (TEI's
    ``Infer::predict``, infinity's ``BatchHandler.rerank``); same shape and dtype."""
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
