"""The model's own classification head, applied to pooled vectors.

transformers' ``*ForSequenceClassification`` classes run their head on padded batches and pick
the pooled token themselves. poolrunner pools the packed hidden states first (CLS or LAST, as
the family does) and then calls the same head modules on ``[num_reqs, hidden_size]``, so the
weights and their arrangement stay exactly the model's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from poolrunner.core import ModelConfig, ModelLoadError

Head = Callable[[torch.Tensor], torch.Tensor]


def classifier_head(model: nn.Module, model_config: ModelConfig) -> Head:
    """``[num_reqs, hidden_size]`` pooled vectors -> ``[num_reqs, num_labels]`` logits.

    Families: ``score`` linear layers (Llama, Qwen2, Qwen3, GPT-2: LAST pooling); BERT's
    ``pooler`` + ``classifier``; DistilBERT's ``pre_classifier`` + ReLU + ``classifier``; and
    RoBERTa / XLM-RoBERTa heads that read the first position of a sequence.

    :raises ModelLoadError: for a head layout none of these match.
    """
    score = getattr(model, "score", None)
    if isinstance(score, nn.Linear):
        return score
    classifier = getattr(model, "classifier", None)
    if not isinstance(classifier, nn.Module):
        raise ModelLoadError(
            f"model {model_config.name} ({model_config.architecture}) has a classification head "
            "poolrunner does not know how to apply (no `score` or `classifier` module)"
        )
    pre_classifier = getattr(model, "pre_classifier", None)
    if isinstance(pre_classifier, nn.Linear):  # DistilBERT
        return lambda pooled: classifier(torch.relu(pre_classifier(pooled)))
    if isinstance(classifier, nn.Linear):
        pooler = getattr(model.base_model, "pooler", None)
        if pooler is None:
            return classifier
        return lambda pooled: classifier(pooler(pooled.unsqueeze(1)))  # BERT: dense + tanh on CLS
    return lambda pooled: classifier(pooled.unsqueeze(1))  # RoBERTa family: reads features[:, 0]
