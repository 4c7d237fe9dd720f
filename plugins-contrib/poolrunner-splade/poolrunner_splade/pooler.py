"""The SPLADE pooler: ``max`` over tokens of ``log1p(relu(MLM logits))``.

Matches sentence-transformers' ``SpladePooling`` (``pooling_strategy="max"``,
``activation_function="relu"``, its defaults; ``sum`` and ``log1p_relu`` are read from a
``SpladePooling`` config when the folder has one). Every prompt token counts, the special
tokens ``[CLS]`` and ``[SEP]`` included, as in sentence-transformers, where only padding is
masked out (vLLM's SPLADE pooler drops ``[CLS]``/``[SEP]`` rows by default; the models are
trained and evaluated the sentence-transformers way). Packed batches hold no padding, so the
attention mask is implicit.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from torch import nn

from poolrunner.core import (
    InvalidRequestError,
    ModelConfig,
    ModelLoadError,
    Pooler,
    PoolingMetadata,
    PoolingParams,
    PoolingTask,
    read_modules,
)

_STRATEGIES = ("max", "sum")
SIMILARITIES = ("dot", "cosine")
_ACTIVATIONS = ("relu", "log1p_relu")


def mlm_head(model: nn.Module, model_config: ModelConfig) -> nn.Module:
    """The masked-LM head (hidden states -> vocabulary logits): ``cls`` in the BERT family,
    ``lm_head`` in RoBERTa, XLM-RoBERTa and ModernBERT-style models.

    :raises ModelLoadError: for a masked-LM class with neither.
    """
    for name in ("cls", "lm_head"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Module):
            return head
    raise ModelLoadError(
        f"model {model_config.name} ({model_config.architecture}) has no masked-LM head the splade "
        "plugin knows (an attribute `cls` or `lm_head`)"
    )


def splade_settings(model_config: ModelConfig) -> tuple[str, str]:
    """``(pooling_strategy, activation_function)`` from the folder's ``SpladePooling`` config,
    else sentence-transformers' defaults ``("max", "relu")``.

    :raises ModelLoadError: for a value sentence-transformers does not define.
    """
    folder = Path(model_config.path)
    config: dict[str, str] = {}
    for module in read_modules(folder):
        if module.type.endswith(".SpladePooling"):
            config_file = module.path / "config.json"
            config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    strategy = config.get("pooling_strategy", "max")
    activation = config.get("activation_function", "relu")
    if strategy not in _STRATEGIES or activation not in _ACTIVATIONS:
        raise ModelLoadError(
            f"{folder}: SpladePooling pooling_strategy {strategy!r} / activation_function {activation!r} is not "
            f"supported (pooling_strategy: {list(_STRATEGIES)}, activation_function: {list(_ACTIVATIONS)})"
        )
    return strategy, activation


def encoder_settings(model_config: ModelConfig) -> tuple[str, int | None]:
    """``(similarity_fn_name, max_active_dims)`` of a ``SparseEncoder`` folder's
    ``config_sentence_transformers.json``: ``("dot", None)`` when unset, as sentence-transformers
    reads them (``max_active_dims`` is then the ``top_k`` of a request that gives none).

    :raises ModelLoadError: for a similarity this plugin does not score sparse vectors with
        (``euclidean``, ``manhattan``), or a ``max_active_dims`` that is not a positive integer.
    """
    config_file = Path(model_config.path) / "config_sentence_transformers.json"
    # read once per version of the file: every score request asks for the similarity
    return _encoder_settings(config_file, config_file.stat().st_mtime_ns if config_file.is_file() else None)


@functools.lru_cache(maxsize=32)
def _encoder_settings(config_file: Path, version: int | None) -> tuple[str, int | None]:
    config = json.loads(config_file.read_text(encoding="utf-8")) if version is not None else {}
    similarity = config.get("similarity_fn_name") or "dot"
    if similarity not in SIMILARITIES:
        raise ModelLoadError(f"{config_file}: similarity_fn_name {similarity!r} is not served by the splade plugin, "
                             f"which scores sparse vectors with {list(SIMILARITIES)}")
    dims = config.get("max_active_dims")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise ModelLoadError(f"{config_file}: max_active_dims {dims!r} must be a positive integer or null")
    return similarity, dims


class SpladePooler(Pooler):
    """``sparse_embed``: one weight per vocabulary token, returned as its non-zero entries.

    Output per request: ``{"token_ids": int64 [k], "weights": float32 [k]}``, sorted by
    descending weight (ties by ascending token id), where ``k`` is the number of non-zero
    weights, or at most the request option ``top_k`` when set (the ``k`` largest, as
    sentence-transformers' ``max_active_dims``), else the folder's ``max_active_dims``.
    """

    def __init__(self, head: nn.Module, vocab_size: int, strategy: str = "max", activation: str = "relu",
                 max_active_dims: int | None = None) -> None:
        super().__init__()
        self.head = head
        self.vocab_size = vocab_size
        self.strategy = strategy
        self.activation = activation
        self.max_active_dims = max_active_dims

    @classmethod
    def from_model(cls, model_config: ModelConfig, model: nn.Module) -> SpladePooler:
        strategy, activation = splade_settings(model_config)
        _, max_active_dims = encoder_settings(model_config)
        vocab_size = int(model_config.hf_config.get("vocab_size") or model.get_output_embeddings().out_features)
        return cls(mlm_head(model, model_config), vocab_size, strategy, activation, max_active_dims)

    def get_supported_tasks(self) -> frozenset[PoolingTask]:
        return frozenset({"sparse_embed"})

    def check_params(self, params: PoolingParams) -> None:
        super().check_params(params)
        top_k = _top_k(params)
        if top_k is not None and top_k > self.vocab_size:
            raise InvalidRequestError(
                f"top_k={top_k} exceeds the vocabulary size {self.vocab_size} "
                "(top_k keeps the k largest sparse weights)"
            )

    def weights(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, hidden_size]`` of one request -> ``[vocab_size]`` float32 weights."""
        logits = self.head(hidden_states).float()
        activated = torch.log1p(torch.relu(logits))
        if self.activation == "log1p_relu":
            activated = torch.log1p(activated)
        return activated.amax(dim=0) if self.strategy == "max" else activated.sum(dim=0)

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> list[dict[str, torch.Tensor]]:
        outputs = []
        rows = torch.split(hidden_states, metadata.prompt_lens.tolist())
        for request_rows, params in zip(rows, metadata.pooling_params, strict=True):
            # One request at a time: the logits are [num_tokens, vocab_size].
            dense = self.weights(request_rows)
            ids = torch.nonzero(dense, as_tuple=True)[0]
            weights, order = torch.sort(dense[ids], descending=True, stable=True)
            top_k = _top_k(params)
            keep = order[: self.max_active_dims if top_k is None else top_k]
            outputs.append({"token_ids": ids[keep], "weights": weights[: len(keep)]})
        return outputs


def _top_k(params: PoolingParams) -> int | None:
    """The request's ``top_k`` option (declared in this plugin's ``request_options``), if set."""
    return (params.extra_kwargs or {}).get("top_k")
