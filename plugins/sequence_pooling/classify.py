"""The pooler of the ``classify`` task: the model's head, as its family applies it -> activation.

The head reads the row(s) its transformers class reads (CLS, the last non-pad token, ModernBERT's
``classifier_pooling``), whatever ``pooling_type`` says: that setting is for ``embed``.

Activation, as vLLM's ``classify`` and transformers' text-classification pipeline apply it (see
REFERENCE): one label -> sigmoid; two or more -> softmax; ``problem_type``
``multi_label_classification`` -> independent sigmoids; ``regression`` -> identity.
``use_activation=False`` returns the raw logits. An activation a sentence-transformers
cross-encoder names applies to its pair scores, and the front end applies it to these logits.
"""

from __future__ import annotations

import torch
from torch import nn

from poolrunner.core import (
    ModelConfig,
    Pooler,
    PoolerOutput,
    PoolingMetadata,
    PoolingTask,
    classifier_activation,
    sequence_classifier_head,
)


class ClassifierPooler(Pooler):
    """One score per label and request: ``[num_reqs, num_labels]`` float32."""

    def __init__(self, model_config: ModelConfig, model: nn.Module) -> None:
        super().__init__()
        self.model_config = model_config
        self.head = sequence_classifier_head(model, model_config)
        self.activation = classifier_activation(model_config)
        self.head_dtype = next(model.parameters()).dtype

    accepted_params = frozenset({"use_activation"})

    @property
    def reads_rows(self) -> str:  # type: ignore[override]
        """A head on the CLS row reads only each request's first row, one on the last token its last."""
        return self.head.reads if self.head.reads in ("first", "last") else "all"

    def get_supported_tasks(self) -> frozenset[PoolingTask]:
        return frozenset({"classify"})

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> PoolerOutput:
        logits = self.head(hidden_states.to(self.head_dtype), metadata).float()
        activate = [p.use_activation is not False for p in metadata.pooling_params]
        if all(activate):
            return self.activation(logits)
        if not any(activate):
            return logits
        return [self.activation(row) if on else row for row, on in zip(logits, activate, strict=True)]
