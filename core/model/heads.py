"""Classification heads as each family's transformers class applies them.

transformers' ``*ForSequenceClassification`` and ``*ForTokenClassification`` classes run the
backbone on padded batches, pick the row(s) their head reads and apply their own head modules.
poolrunner runs the backbone on packed tokens, so it does the rest itself: this module says, per
architecture, which row a sequence head reads and which of the model's own modules it calls,
written from each class's ``forward``. An architecture that is not listed is refused at load
(never guessed from attribute names), so a new head layout cannot be run half-applied.

Where vLLM differs (it pools decoder classifiers at the last token, whatever its id), poolrunner
follows transformers, which trained the weights: a decoder head reads the rightmost token that is
not the pad id, so with pad == EOS and a tokenizer that appends EOS it reads the token before it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from attrs import field, frozen
from torch import nn
from transformers.modeling_layers import GenericForSequenceClassification, GenericForTokenClassification

from poolrunner.core.errors import ModelLoadError
from poolrunner.core.model.token_logits import token_logit_head
from poolrunner.core.plugin_api.batch import PoolingMetadata
from poolrunner.core.types import ModelConfig

Head = Callable[[torch.Tensor], torch.Tensor]


def _first_token_head(module: nn.Module) -> Head:
    # Heads written for [batch, seq, hidden] that read features[:, 0] (RoBERTa, ELECTRA, MPNet, poolers).
    return lambda pooled: module(pooled.unsqueeze(1))


def _pooled_then_classifier(pooler: nn.Module, classifier: nn.Module) -> tuple[str, Head]:
    head = _first_token_head(pooler)
    return "first", lambda pooled: classifier(head(pooled))


def _bert(model: nn.Module) -> tuple[str, Head]:  # BERT, Ernie: pooler (dense + tanh on CLS) -> classifier
    return _pooled_then_classifier(model.base_model.pooler, model.classifier)


def _classification_head(model: nn.Module) -> tuple[str, Head]:  # RoBERTa, XLM-R, ELECTRA, MPNet
    return "first", _first_token_head(model.classifier)


def _distilbert(model: nn.Module) -> tuple[str, Head]:  # pre_classifier -> ReLU -> classifier
    return "first", lambda pooled: model.classifier(torch.relu(model.pre_classifier(pooled)))


def _deberta_v2(model: nn.Module) -> tuple[str, Head]:  # ContextPooler (dense + activation) -> classifier
    return _pooled_then_classifier(model.pooler, model.classifier)


def _modernbert(model: nn.Module) -> tuple[str, Head]:  # classifier_pooling -> head (dense, act, norm) -> classifier
    reads = {"cls": "first", "mean": "mean"}.get(model.config.classifier_pooling)
    if reads is None:
        raise ModelLoadError(f"ModernBERT classifier_pooling {model.config.classifier_pooling!r} is not cls or mean")
    return reads, lambda pooled: model.classifier(model.head(pooled))


def _score_last_non_pad(model: nn.Module) -> tuple[str, Head]:  # decoders: score on the last non-pad token
    return "last_non_pad", model.score


SEQUENCE_HEADS: dict[str, Callable[[nn.Module], tuple[str, Head]]] = {
    "BertForSequenceClassification": _bert,
    "ErnieForSequenceClassification": _bert,
    "RobertaForSequenceClassification": _classification_head,
    "XLMRobertaForSequenceClassification": _classification_head,
    "ElectraForSequenceClassification": _classification_head,
    "MPNetForSequenceClassification": _classification_head,
    "DistilBertForSequenceClassification": _distilbert,
    "DebertaV2ForSequenceClassification": _deberta_v2,
    "ModernBertForSequenceClassification": _modernbert,
    "GPT2ForSequenceClassification": _score_last_non_pad,
}
"""Sequence heads by architecture; subclasses of transformers' ``GenericForSequenceClassification``
(Llama, Mistral, Qwen2, Qwen3, Gemma2, Gemma3, Phi3...) read the last non-pad token too."""

TOKEN_HEADS: dict[str, Callable[[nn.Module], Head]] = {
    **dict.fromkeys(
        ["BertForTokenClassification", "ErnieForTokenClassification", "RobertaForTokenClassification",
         "XLMRobertaForTokenClassification", "ElectraForTokenClassification", "MPNetForTokenClassification",
         "DistilBertForTokenClassification", "DebertaV2ForTokenClassification", "GPT2ForTokenClassification"],
        lambda model: model.classifier,
    ),
    "ModernBertForTokenClassification": lambda model: lambda hidden: model.classifier(model.head(hidden)),
}
"""Per-token heads by architecture; subclasses of ``GenericForTokenClassification`` use ``score``."""


@frozen(eq=False)
class SequenceHead:
    """A family's sequence classification head: which row(s) it reads, then its modules.

    :ivar reads: ``first`` (CLS), ``mean`` (ModernBERT ``classifier_pooling: mean``),
        ``last_non_pad`` (decoders: the rightmost token whose id is not ``pad_token_id``, the
        first token if all are; the last token when the model has no pad id) or ``last`` (the
        last token, whatever its id: an LM's next-token logits, :mod:`~poolrunner.core.model.token_logits`).
    :ivar apply: ``[num_reqs, hidden_size]`` -> ``[num_reqs, num_labels]`` logits.
    """

    reads: str
    apply: Head = field(repr=False)
    pad_token_id: int | None

    def __call__(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> torch.Tensor:
        """``[num_tokens, hidden_size]`` packed hidden states -> ``[num_reqs, num_labels]`` logits."""
        return self.apply(self.pooled(hidden_states, metadata))

    def pooled(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> torch.Tensor:
        """The rows the head reads, ``[num_reqs, hidden_size]`` in the hidden states' dtype."""
        starts, ends = metadata.query_start_loc[:-1], metadata.query_start_loc[1:]
        if self.reads == "first":
            return hidden_states[starts]
        if self.reads == "last":
            return hidden_states[ends - 1]
        if self.reads == "mean":
            owner = _owners(metadata.query_start_loc, hidden_states.shape[0])
            sums = hidden_states.new_zeros(starts.numel(), hidden_states.shape[1]).index_add_(0, owner, hidden_states)
            return sums / (ends - starts).unsqueeze(1)
        return hidden_states[self._last_non_pad(metadata)]

    def _last_non_pad(self, metadata: PoolingMetadata) -> torch.Tensor:
        starts, ends = metadata.query_start_loc[:-1], metadata.query_start_loc[1:]
        if self.pad_token_id is None:
            return ends - 1
        token_ids = metadata.prompt_token_ids
        rows = torch.arange(token_ids.numel(), device=token_ids.device)
        owner = _owners(metadata.query_start_loc, token_ids.numel())
        candidates = torch.where(token_ids != self.pad_token_id, rows, -1)
        last = torch.full_like(starts, -1).scatter_reduce_(0, owner, candidates, reduce="amax")
        return torch.where(last < 0, starts, last)


def _owners(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[num_tokens]``: the request each packed row belongs to."""
    lengths = query_start_loc.diff()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths,
                                   output_size=num_tokens)


def sequence_classifier_head(model: nn.Module, model_config: ModelConfig) -> SequenceHead:
    """The head of a ``*ForSequenceClassification`` model, as its transformers class applies it.

    A causal LM classifying from token logits (``model_config.token_logits``) reads the rows of
    its LM head at the last token.

    :raises ModelLoadError: for an architecture whose head layout poolrunner does not know.
    """
    if model_config.token_logits is not None:
        return SequenceHead("last", token_logit_head(model), None)
    recipe = SEQUENCE_HEADS.get(type(model).__name__)
    if recipe is None and isinstance(model, GenericForSequenceClassification):
        recipe = _score_last_non_pad
    if recipe is None:
        raise _unknown_head(model, model_config, SEQUENCE_HEADS, "GenericForSequenceClassification")
    reads, apply = recipe(model)
    return SequenceHead(reads, apply, model_config.hf_config.get("pad_token_id"))


def token_classifier_head(model: nn.Module, model_config: ModelConfig) -> Head:
    """The per-token head of a ``*ForTokenClassification`` model: ``[num_tokens, hidden_size]``
    -> ``[num_tokens, num_labels]`` logits, as its transformers class applies it.

    :raises ModelLoadError: for an architecture whose head layout poolrunner does not know.
    """
    recipe = TOKEN_HEADS.get(type(model).__name__)
    if recipe is None and isinstance(model, GenericForTokenClassification):
        return model.score
    if recipe is None:
        raise _unknown_head(model, model_config, TOKEN_HEADS, "GenericForTokenClassification")
    return recipe(model)


def _unknown_head(
    model: nn.Module, model_config: ModelConfig, known: dict[str, object], generic: str,
) -> ModelLoadError:
    return ModelLoadError(
        f"model {model_config.name} ({type(model).__name__}) has a classification head poolrunner does not "
        f"know how to apply, so it is refused rather than run without it; supported: {', '.join(sorted(known))} "
        f"and transformers' {generic} decoders (Llama, Mistral, Qwen2, Qwen3, Gemma2, Gemma3, Phi3, ...)"
    )
