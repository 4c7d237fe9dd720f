"""A causal LM served as a classifier (and so a reranker) from the logits of a few vocabulary tokens.

LLM rerankers (Qwen3-Reranker, bge-reranker-v2-gemma, mxbai-rerank-v2) are ``*ForCausalLM``
folders: a pair is formatted into a prompt (:mod:`poolrunner.core.inputs.score_template`) and its
relevance is read from the next-token logits at the prompt's last token. vLLM serves them through
``hf_overrides``, and poolrunner takes the same keys with the same meaning (vLLM:
``vllm/model_executor/models/adapters.py``, ``SequenceClassificationConfig`` and
``load_weights_using_from_2_way_softmax`` / ``load_weights_no_post_processing``;
``vllm/model_executor/models/config.py``, ``Qwen3ForSequenceClassificationConfig``):

* ``classifier_from_token``: vocabulary entries (``tokenizer.convert_tokens_to_ids`` of each
  string, so ``"yes"``, not ``" yes"`` or ``"Ġyes"`` unless that is the entry);
* ``method``: ``from_2_way_softmax`` (two tokens ``[negative, positive]``: one label, logit
  ``logit[positive] - logit[negative]``, whose sigmoid is the two-way softmax's positive
  probability) or ``no_post_processing`` (one label per token, its logit; one token gives one
  label, scored by its sigmoid);
* ``is_original_qwen3_reranker: true``: ``method`` ``from_2_way_softmax`` (two tokens needed);
* ``architectures``: routes vLLM to a ``*ForSequenceClassification`` class; here it only names
  the model (its tasks: ``classify``, hence ``score`` and ``rerank``).

Where poolrunner differs: without ``method`` (vLLM then fails an assertion) two tokens mean
``from_2_way_softmax`` and any other count ``no_post_processing``; the LM's final logit
soft-capping (Gemma2, Gemma3) is applied, as the LM's own logits have it (vLLM's converted head
drops it); and the head computes each token's logit in float32 before subtracting (vLLM subtracts
the weight rows), which is the LM's own computation to float32 rounding. Anything else that
cannot be served as the LM computes it is refused at load.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from poolrunner.core.errors import ModelLoadError
from poolrunner.core.types import TokenLogits

FROM_2_WAY_SOFTMAX = "from_2_way_softmax"
NO_POST_PROCESSING = "no_post_processing"
METHODS = (FROM_2_WAY_SOFTMAX, NO_POST_PROCESSING)
HEAD_NAME = "poolrunner_token_logits"
"""The submodule :func:`install_head` adds to the loaded LM."""

_SEQUENCE_SUFFIX = "ForSequenceClassification"
_GENERATE_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
# LM heads whose logits are scaled in the family's forward, which the rows alone would miss.
_SCALED_LOGITS = ("logit_scale", "logits_scaling")


def read_token_logits(
    hf_config: PretrainedConfig, tokenizer: Any, folder_architecture: str, path: Path,
) -> TokenLogits | None:
    """The token-logit classifier ``hf_config`` (``hf_overrides`` applied) asks for, checked
    against the tokenizer, with ``hf_config`` updated to describe it (:func:`configure`).

    :param folder_architecture: ``architectures[0]`` of the folder's own ``config.json``.
    :returns: ``None`` when the config sets none of ``classifier_from_token``, ``method`` and
        ``is_original_qwen3_reranker``.
    :raises ModelLoadError: for settings that cannot be served as the LM computes them: no or
        malformed tokens, an unknown ``method``, a token count the method does not take, a string
        that is not one vocabulary entry, a family without a causal LM class or with scaled
        logits, or a causal LM made a ``*ForSequenceClassification`` without tokens (its head
        would be random).
    """
    tokens = getattr(hf_config, "classifier_from_token", None)
    method = getattr(hf_config, "method", None)
    qwen3 = getattr(hf_config, "is_original_qwen3_reranker", False)
    if tokens is None and method is None and not qwen3:
        _refuse_headless_classifier(hf_config, folder_architecture, path)
        return None
    tokens = _token_strings(tokens, path)
    spec = TokenLogits(tokens=tokens, token_ids=_token_ids(tokens, tokenizer, path),
                       method=_method(method, qwen3, len(tokens)))
    causal_lm_class(hf_config, path)
    _check_plain_logits(hf_config, path)
    configure(hf_config, spec)
    return spec


def configure(hf_config: PretrainedConfig, spec: TokenLogits) -> None:
    """Make ``hf_config`` describe the classifier: ``num_labels`` and ``id2label`` (the positive
    token, or each token), ``method`` resolved, and a ``*ForSequenceClassification`` architecture
    (vLLM's name for the converted model: ``Qwen3ForCausalLM`` -> ``Qwen3ForSequenceClassification``)."""
    hf_config.id2label = dict(enumerate(spec.labels))
    hf_config.label2id = {label: index for index, label in enumerate(spec.labels)}
    hf_config.method = spec.method
    architecture = (hf_config.architectures or [type(hf_config).__name__])[0]
    if not architecture.endswith(_SEQUENCE_SUFFIX):
        family = next((architecture.removesuffix(s) for s in _GENERATE_SUFFIXES if architecture.endswith(s)),
                      architecture)
        hf_config.architectures = [family + _SEQUENCE_SUFFIX]


def causal_lm_class(hf_config: PretrainedConfig, path: Path) -> type:
    """transformers' causal LM class of the config's family (``Qwen3ForCausalLM`` for ``qwen3``).

    :raises ModelLoadError: when transformers has none.
    """
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type)
    model_class = getattr(transformers, name, None) if isinstance(name, str) else None
    if model_class is None:
        raise ModelLoadError(
            f"{path}: classifier_from_token reads rows of a causal LM's head, but transformers has no causal LM "
            f"class for model_type {hf_config.model_type!r}"
        )
    return model_class


def check_lm_head_loaded(path: Path, missing_keys: Iterable[str]) -> None:
    """:raises ModelLoadError: when weights were missing from the folder (the LM head, say): they
    would be random, and so would every score."""
    missing = sorted(missing_keys)
    if missing:
        raise ModelLoadError(
            f"{path}: classifier_from_token reads rows of the causal LM's head, but the weights lack "
            f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; a folder already converted to a "
            "sequence classifier has no LM head: load it without classifier_from_token"
        )


class TokenLogitHead(nn.Module):
    """The LM head's rows of the classifier tokens: ``[num_reqs, hidden_size]`` (any dtype) ->
    ``[num_reqs, num_labels]`` float32 logits (``logit[1] - logit[0]`` for the two-way method).

    :param weight: ``[num_tokens, hidden_size]`` float32 rows of the LM head.
    :param bias: ``[num_tokens]`` float32, or ``None`` (most LM heads have no bias).
    :param softcap: The LM's ``final_logit_softcapping`` (``cap * tanh(logit / cap)``), or ``None``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, two_way: bool,
                 softcap: float | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        self.two_way = two_way
        self.softcap = softcap

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.linear(pooled.float(), self.weight, self.bias)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits[:, 1:] - logits[:, :1] if self.two_way else logits


def install_head(model: nn.Module, spec: TokenLogits) -> None:
    """Add the :class:`TokenLogitHead` of ``spec`` to the loaded LM as :data:`HEAD_NAME`, and drop
    the LM head itself (an untied one holds ``vocab_size x hidden_size`` weights never used again)."""
    output = model.get_output_embeddings()
    ids = torch.tensor(spec.token_ids, dtype=torch.int64, device=output.weight.device)
    with torch.no_grad():
        weight = output.weight.index_select(0, ids).float().clone()
        bias = output.bias.index_select(0, ids).float().clone() if getattr(output, "bias", None) is not None else None
    softcap = getattr(model.config, "final_logit_softcapping", None)
    model.add_module(HEAD_NAME, TokenLogitHead(weight, bias, two_way=spec.method == FROM_2_WAY_SOFTMAX,
                                               softcap=float(softcap) if softcap else None))
    for name, child in list(model.named_children()):
        if child is output:
            setattr(model, name, nn.Identity())


def token_logit_head(model: nn.Module) -> TokenLogitHead:
    """The head :func:`install_head` added.

    :raises ModelLoadError: for a model loaded without it.
    """
    head = getattr(model, HEAD_NAME, None)
    if not isinstance(head, TokenLogitHead):
        raise ModelLoadError(f"{type(model).__name__} was loaded without its token-logit head")
    return head


def _token_strings(tokens: Any, path: Path) -> tuple[str, ...]:
    if not isinstance(tokens, list | tuple) or not tokens or not all(isinstance(t, str) and t for t in tokens):
        raise ModelLoadError(
            f"{path}: classifier_from_token must be a non-empty list of vocabulary tokens (e.g. [\"no\", \"yes\"]), "
            f"got {tokens!r}"
        )
    if len(set(tokens)) != len(tokens):
        raise ModelLoadError(f"{path}: classifier_from_token names a token twice: {list(tokens)!r}")
    return tuple(tokens)


def _method(method: Any, qwen3: Any, count: int) -> str:
    if qwen3 not in (True, False):
        raise ModelLoadError(f"is_original_qwen3_reranker must be true or false, got {qwen3!r}")
    if qwen3 and method not in (None, FROM_2_WAY_SOFTMAX):
        raise ModelLoadError(
            f"is_original_qwen3_reranker means method {FROM_2_WAY_SOFTMAX!r}, not {method!r}; drop one of them"
        )
    if qwen3 or (method is None and count == 2):
        method = FROM_2_WAY_SOFTMAX
    method = NO_POST_PROCESSING if method is None else method
    if method not in METHODS:
        raise ModelLoadError(f"unknown classifier method {method!r}; known: {', '.join(METHODS)}")
    if method == FROM_2_WAY_SOFTMAX and count != 2:
        raise ModelLoadError(
            f"method {FROM_2_WAY_SOFTMAX!r}{' (is_original_qwen3_reranker)' if qwen3 else ''} takes two "
            f"classifier_from_token entries, [negative, positive] (e.g. [\"no\", \"yes\"]), got {count}"
        )
    return method


def _token_ids(tokens: tuple[str, ...], tokenizer: Any, path: Path) -> tuple[int, ...]:
    """Each token's id, as ``convert_tokens_to_ids`` gives it, when it is one vocabulary entry.

    :raises ModelLoadError: naming the string and the tokens it encodes to otherwise.
    """
    vocabulary = tokenizer.get_vocab()
    ids = []
    for token in tokens:
        if token not in vocabulary:
            pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode(token, add_special_tokens=False))
            raise ModelLoadError(
                f"classifier_from_token {token!r} is not one token of the vocabulary of {path} "
                f"(it tokenizes as {pieces!r}); name vocabulary entries exactly"
            )
        ids.append(int(tokenizer.convert_tokens_to_ids(token)))
    return tuple(ids)


def _check_plain_logits(hf_config: PretrainedConfig, path: Path) -> None:
    scaled = [name for name in _SCALED_LOGITS if getattr(hf_config, name, None) not in (None, 1, 1.0)]
    if scaled:
        raise ModelLoadError(
            f"{path}: the {hf_config.model_type} LM scales its logits ({', '.join(scaled)}), which the token-logit "
            "classifier does not apply; refusing rather than scoring differently from the LM"
        )


def _refuse_headless_classifier(hf_config: PretrainedConfig, folder_architecture: str, path: Path) -> None:
    architecture = (hf_config.architectures or [folder_architecture])[0]
    if architecture.endswith(_SEQUENCE_SUFFIX) and folder_architecture.endswith(_GENERATE_SUFFIXES):
        raise ModelLoadError(
            f"{path} is a causal LM ({folder_architecture}); hf_overrides make it {architecture} without "
            "classifier_from_token, so its score head would be random. Name the tokens whose logits score, e.g. "
            '{"classifier_from_token": ["no", "yes"]}'
        )
