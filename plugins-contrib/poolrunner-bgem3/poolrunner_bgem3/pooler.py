"""The ``m3_embed`` pooler: BGE-M3's dense, sparse and ColBERT representations from one forward pass.

The formulas are FlagEmbedding's (``FlagEmbedding/finetune/embedder/encoder_only/m3/modeling.py``,
``_dense_embedding`` / ``_sparse_embedding`` / ``_colbert_embedding``, and the post-processing in
``FlagEmbedding/inference/embedder/encoder_only/m3.py``), for ``h`` the last hidden states:

- dense: ``normalize(h[0])``, the CLS row (``sentence_pooling_method="cls"``, ``normalize_embeddings``);
- sparse: ``relu(sparse_linear(h))``, one weight per token; the CLS, EOS, PAD and UNK tokens
  are dropped, as are weights that are not positive, and each token id keeps its largest weight
  (``_process_token_weights``);
- colbert: ``normalize(colbert_linear(h[1:]))``, every token but the first (``_colbert_embedding``
  slices ``[:, 1:]``; ``_process_colbert_vecs`` keeps ``tokens_num - 1`` rows).

Packed batches hold no padding, so FlagEmbedding's attention-mask products are implicit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from poolrunner.core import ModelConfig, Pooler, PoolingMetadata, PoolingParams, PoolingTask

from .heads import load_heads, unused_token_ids
from .options import ALL_PARTS, TASK, parse_outputs


def lexical_weights(token_ids: torch.Tensor, weights: torch.Tensor,
                    unused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's token weights aggregated per token id by max.

    :param token_ids: ``[num_tokens]`` int64 prompt ids.
    :param weights: ``[num_tokens]`` float32 ``relu(sparse_linear(h))``.
    :param unused: ``[k]`` int64 ids that never get a weight (CLS, EOS, PAD, UNK).
    :returns: ``(token_ids int64 [m], weights float32 [m])``, distinct ids with positive weights,
        by descending weight (ties by ascending id).
    """
    keep = (weights > 0) & ~torch.isin(token_ids, unused)
    ids, slot = torch.unique(token_ids[keep], return_inverse=True)  # ascending ids
    best = torch.zeros(len(ids), dtype=weights.dtype, device=weights.device)
    best = best.scatter_reduce(0, slot, weights[keep], reduce="amax", include_self=False)
    best, order = torch.sort(best, descending=True, stable=True)
    return ids[order], best


class M3Pooler(Pooler):
    """``m3_embed``: the parts a request names in its ``outputs`` option, as named outputs.

    Output per request, keys in this order and only those asked for:
    ``{"dense": float32 [hidden_size], "token_ids": int64 [m], "weights": float32 [m],
    "colbert": float32 [num_tokens - 1, colbert_dim]}``. ``token_ids`` / ``weights`` are the
    sparse part, shaped as poolrunner-splade's output.
    """

    def __init__(self, sparse_linear: nn.Linear, colbert_linear: nn.Linear, unused_ids: tuple[int, ...]) -> None:
        super().__init__()
        self.sparse_linear = sparse_linear
        self.colbert_linear = colbert_linear
        self.register_buffer("unused_ids", torch.tensor(unused_ids, dtype=torch.int64), persistent=False)

    @classmethod
    def from_model_config(cls, model_config: ModelConfig) -> M3Pooler:
        sparse_linear, colbert_linear = load_heads(model_config)
        return cls(sparse_linear, colbert_linear, unused_token_ids(model_config.path))

    def get_supported_tasks(self) -> frozenset[PoolingTask]:
        return frozenset({TASK})

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> list[dict[str, torch.Tensor]]:
        hidden = hidden_states.float()
        wanted = [_parts(params) for params in metadata.pooling_params]
        needed = set().union(*wanted)
        lengths = metadata.prompt_lens.tolist()
        # Each head runs once over the packed step, and only when some request needs it.
        dense = F.normalize(hidden[metadata.query_start_loc[:-1]], dim=-1) if "dense" in needed else None
        sparse = torch.relu(self.sparse_linear(hidden)).squeeze(-1) if "sparse" in needed else None
        colbert = F.normalize(self.colbert_linear(hidden), dim=-1) if "colbert" in needed else None
        rows = {
            "ids": torch.split(metadata.prompt_token_ids, lengths),
            "sparse": torch.split(sparse, lengths) if sparse is not None else None,
            "colbert": torch.split(colbert, lengths) if colbert is not None else None,
        }
        return [self._request_output(i, parts, dense, rows) for i, parts in enumerate(wanted)]

    def _request_output(self, i: int, parts: tuple[str, ...], dense: torch.Tensor | None,
                        rows: dict[str, tuple[torch.Tensor, ...] | None]) -> dict[str, torch.Tensor]:
        """Request ``i``'s named outputs, from the step's per-request rows."""
        output: dict[str, torch.Tensor] = {}
        if "dense" in parts:
            output["dense"] = dense[i]
        if "sparse" in parts:
            output["token_ids"], output["weights"] = lexical_weights(rows["ids"][i], rows["sparse"][i],
                                                                     self.unused_ids)
        if "colbert" in parts:
            output["colbert"] = rows["colbert"][i][1:]  # the first (CLS) token has no ColBERT vector
        return output


def _parts(params: PoolingParams) -> tuple[str, ...]:
    """The parts a request asks for (its ``outputs`` option; all when unset)."""
    return parse_outputs((params.extra_kwargs or {}).get("outputs") or ALL_PARTS)
