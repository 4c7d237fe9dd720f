"""Token-level poolers: ALL (every prompt token) and STEP (only step-tag tokens).

Outputs are ragged: one tensor per request, ``[num_tokens, ...]``, never stacked across
requests. Request ``i`` owns rows ``query_start_loc[i]:query_start_loc[i + 1]`` of the packed
hidden states.
"""

from __future__ import annotations

import itertools
from typing import Self

import torch
import torch.nn.functional as F
from torch import nn

from poolrunner.core import (
    InvalidRequestError,
    ModelConfig,
    ModelLoadError,
    Pooler,
    PoolerOutput,
    PoolingMetadata,
    PoolingParams,
    PoolingTask,
    check_dimensions,
    classifier_activation,
    load_weights,
    token_classifier_head,
)


def split_requests(rows: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
    """``[num_tokens, ...]`` -> one ``[request_tokens, ...]`` view per request."""
    return list(torch.split(rows, metadata.prompt_lens.tolist()))


class TokenEmbedPooler(Pooler):
    """``token_embed``: every token's hidden state, ``[num_tokens, hidden_size]`` float32.

    Per token, in order: Matryoshka slice ``[:dimensions]``, then L2 normalization when the
    request asks for it (``normalize=True``, or vLLM's ``use_activation=True``; an explicit
    ``normalize`` wins). Off by default: raw hidden states, sentence-transformers'
    ``output_value="token_embeddings"`` (vLLM normalizes unless told not to).
    """

    accepted_params = frozenset({"dimensions", "normalize", "use_activation"})

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        self.model_config = model_config

    def get_supported_tasks(self) -> frozenset[PoolingTask]:
        return frozenset({"token_embed"})

    def check_params(self, params: PoolingParams) -> None:
        super().check_params(params)
        check_dimensions(self.model_config, params.dimensions, self.model_config.hidden_size)

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> PoolerOutput:
        outputs = []
        for rows, params in zip(split_requests(hidden_states, metadata), metadata.pooling_params, strict=True):
            rows = rows.float()
            if params.dimensions is not None:
                rows = rows[:, : params.dimensions]
            normalize = params.normalize if params.normalize is not None else params.use_activation
            outputs.append(F.normalize(rows, dim=-1) if normalize else rows)
        return outputs


class TokenClassifierPooler(Pooler):
    """``token_classify``: the model's token head on every token, ``[num_tokens, num_labels]``.

    The activation (softmax, sigmoid...) runs per token, by the rules of
    :func:`poolrunner.core.classifier_activation`. STEP pooling (process-reward models): with
    ``step_tag_id`` only the rows whose prompt token is that id are kept, and with
    ``returned_token_ids`` only those label columns, the activation then running over them
    alone. A request with no step tag gets an empty ``[0, num_columns]`` result.
    """

    accepted_params = frozenset({"use_activation", "step_tag_id", "returned_token_ids"})

    def __init__(self, model_config: ModelConfig, model: nn.Module) -> None:
        super().__init__()
        self.model_config = model_config
        self.head = token_classifier_head(model, model_config)
        self.head_dtype = next(model.parameters()).dtype
        self.activation = classifier_activation(model_config)

    def get_supported_tasks(self) -> frozenset[PoolingTask]:
        return frozenset({"token_classify"})

    def check_params(self, params: PoolingParams) -> None:
        super().check_params(params)
        num_labels = len(self.model_config.labels)
        bad = [i for i in params.returned_token_ids or () if i >= num_labels]
        if bad:
            raise InvalidRequestError(
                f"returned_token_ids {list(bad)} are out of range for model {self.model_config.name}: "
                f"it has {num_labels} labels (0..{num_labels - 1})"
            )

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> PoolerOutput:
        logits = self.head(hidden_states.to(self.head_dtype)).float()
        token_ids = split_requests(metadata.prompt_token_ids, metadata)
        outputs = []
        for rows, ids, params in zip(split_requests(logits, metadata), token_ids, metadata.pooling_params,
                                     strict=True):
            if params.step_tag_id is not None:
                rows = rows[ids == params.step_tag_id]
            if params.returned_token_ids is not None:
                rows = rows[:, list(params.returned_token_ids)]
            outputs.append(rows if params.use_activation is False else self.activation(rows))
        return outputs


class TokenWeights(nn.Module):
    """BGE-M3's token weights: ``sparse_linear(hidden_state)`` per token, from the folder's
    ``sparse_linear.pt`` (a ``Linear(hidden_size, 1)``), with vLLM's ``BgeM3EmbeddingModel`` rule
    for the ends: the first row is dropped when the prompt starts with the config's
    ``bos_token_id``, the last when it ends with its ``eos_token_id`` (so a prompt truncated
    before its EOS keeps its last row)."""

    def __init__(self, sparse_linear: nn.Linear, bos_token_id: object, eos_token_id: object) -> None:
        super().__init__()
        self.sparse_linear = sparse_linear
        self.bos_token_id = bos_token_id  # compared as vLLM does: an int, or never (None, a list)
        self.eos_token_id = eos_token_id

    @classmethod
    def from_model_config(cls, model_config: ModelConfig) -> TokenWeights:
        """:raises ModelLoadError: when the folder has no ``sparse_linear.pt``, or it is not a
        ``Linear(hidden_size, 1)`` state dict."""
        path = model_config.token_weight_head
        if path is None:
            raise ModelLoadError(f"model {model_config.name} has no token-weight head (sparse_linear.pt)")
        state = load_weights(path)
        try:
            linear = nn.Linear(model_config.hidden_size, 1)
            linear.load_state_dict({key: value.float() for key, value in state.items()})
        except (RuntimeError, AttributeError) as exc:
            raise ModelLoadError(f"{path}: expected a Linear({model_config.hidden_size}, 1) state dict: {exc}") from exc
        config = model_config.hf_config
        return cls(linear, config.get("bos_token_id"), config.get("eos_token_id"))

    def forward(self, hidden: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
        """``[num_tokens, hidden_size]`` float32 -> per request its ``[n]`` float32 weights,
        before any activation."""
        weights = split_requests(self.sparse_linear(hidden).squeeze(-1), metadata)
        token_ids = metadata.prompt_token_ids.tolist()  # one copy to the host for the whole step
        stops = list(itertools.accumulate(metadata.prompt_lens.tolist()))
        return [self._inner(rows, token_ids[stop - len(rows):stop]) for rows, stop in zip(weights, stops, strict=True)]

    def _inner(self, rows: torch.Tensor, ids: list[int]) -> torch.Tensor:
        start = 1 if ids and ids[0] == self.bos_token_id else 0
        stop = len(ids) - 1 if len(ids) > start and ids[-1] == self.eos_token_id else len(ids)
        return rows[start:stop]


class TokenWeightsPooler(Pooler):
    """``token_classify`` on a backbone with BGE-M3's ``sparse_linear.pt`` (vLLM's
    ``BgeM3EmbeddingModel``): ``relu(sparse_linear(hidden_state))`` per token but the BOS and
    EOS (:class:`TokenWeights`), ``[n]`` float32; ``use_activation=False`` skips the ReLU."""

    accepted_params = frozenset({"use_activation"})

    def __init__(self, weights: TokenWeights) -> None:
        super().__init__()
        self.weights = weights

    @classmethod
    def from_model_config(cls, model_config: ModelConfig) -> Self:
        return cls(TokenWeights.from_model_config(model_config))

    def get_supported_tasks(self) -> frozenset[PoolingTask]:
        return frozenset({"token_classify"})

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> PoolerOutput:
        rows = self.weights(hidden_states.float(), metadata)
        return [weights if params.use_activation is False else torch.relu(weights)
                for weights, params in zip(rows, metadata.pooling_params, strict=True)]


class EmbedTokenClassifyPooler(TokenWeightsPooler):
    """``embed&token_classify`` (BGE-M3): a dense vector and a weight per token, in one pass,
    as vLLM's ``BgeM3EmbeddingModel`` pairs its ``embed`` and ``token_classify``.

    ``embedding``: the CLS hidden state, L2-normalized (unless ``normalize=False``), ``[hidden]``.
    ``token_weights``: ``relu(sparse_linear(hidden_state))`` per token but the BOS and EOS
    (:class:`TokenWeights`), ``[n]`` float32. ``use_activation=False`` skips both the
    normalization (an explicit ``normalize`` wins) and the ReLU: vLLM 0.32's answer to this task.
    """

    accepted_params = frozenset({"normalize", "use_activation"})

    def get_supported_tasks(self) -> frozenset[PoolingTask]:
        return frozenset({"embed&token_classify"})

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> PoolerOutput:
        hidden = hidden_states.float()
        dense = hidden[metadata.query_start_loc[:-1]]
        outputs = []
        for vector, token_weights, params in zip(dense, self.weights(hidden, metadata), metadata.pooling_params,
                                                 strict=True):
            activate = params.use_activation is not False
            normalize = params.normalize if params.normalize is not None else activate
            outputs.append({"embedding": F.normalize(vector, dim=-1) if normalize else vector,
                            "token_weights": torch.relu(token_weights) if activate else token_weights})
        return outputs
