"""Built-in model-state plugin: ``token_type_ids`` of paired inputs for encoder-only models.

A paired input (query, document) of a BERT-family cross-encoder has token types 0 for the
query segment and 1 for the document segment. Following vLLM's Model Runner V2, a request keeps
them compressed to one integer, the position where the 1s start, and each step expands them for
exactly the scheduled slice of the prompt. Requests without types get 0 everywhere, so one
batch mixes both kinds. Models without token types (``type_vocab_size < 2``, the RoBERTa
family, decoders) get nothing from this plugin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from poolrunner.core import InvalidRequestError, ModelConfig, RequestState, hookimpl

if TYPE_CHECKING:  # torch loads with a model, not with `poolrunner plugins`
    import torch

    from poolrunner.core import InputBatch

NAME = "token_type_ids"
_NO_TYPES = 2**63 - 1  # the int64 maximum, a start no position reaches: all type 0


def compress(request_id: str, token_type_ids: tuple[int, ...]) -> int:
    """The index where the 1s start (``len`` when there are none).

    :raises InvalidRequestError: if the pattern is not zeros followed by ones.
    """
    start = next((i for i, t in enumerate(token_type_ids) if t != 0), len(token_type_ids))
    if any(t != 1 for t in token_type_ids[start:]):
        raise InvalidRequestError(
            f"request {request_id!r}: token_type_ids must be zeros followed by ones (query, then "
            f"document), got {list(token_type_ids)!r:.120}"
        )
    return start


@hookimpl
def add_request(state: RequestState, model_config: ModelConfig) -> None:
    types = state.request.token_type_ids
    if types is None:
        return
    start = compress(state.request_id, types)
    if start < len(types) and model_config.type_vocab_size < 2:
        raise InvalidRequestError(
            f"request {state.request_id!r} has token type 1, but model {model_config.name} "
            f"({model_config.architecture}) embeds no token types (type_vocab_size "
            f"{model_config.type_vocab_size})"
        )
    state.plugin_data[NAME] = start


@hookimpl
def prepare_inputs(batch: InputBatch, model_config: ModelConfig) -> dict[str, torch.Tensor] | None:
    starts = [state.plugin_data.get(NAME, _NO_TYPES) for state in batch.requests]
    if model_config.type_vocab_size < 2 or all(start == _NO_TYPES for start in starts):
        return None  # the model's own default (all zeros) applies
    import torch

    per_token = torch.repeat_interleave(
        torch.tensor(starts, dtype=torch.int64), torch.tensor(batch.num_scheduled_tokens)
    ).to(batch.device, non_blocking=True)
    return {"token_type_ids": (batch.positions >= per_token).long()}


@hookimpl
def remove_request(state: RequestState) -> None:
    state.plugin_data.pop(NAME, None)
