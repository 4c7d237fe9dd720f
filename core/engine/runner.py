"""Runs one step: packed inputs -> model forward -> pooling -> output handle."""

from __future__ import annotations

import torch
from torch import nn

from poolrunner.core.engine.batch import InputBatch
from poolrunner.core.hooks import Hooks
from poolrunner.core.model.attention import LAYOUT_KWARG, PackedLayout
from poolrunner.core.model.metadata import position_offset
from poolrunner.core.output import OutputHandle
from poolrunner.core.pooler import Pooler
from poolrunner.core.types import ModelConfig, PoolingMetadata


class ModelRunner:
    """Owns the model and the pooler and calls the step hooks around each forward pass."""

    def __init__(self, model: nn.Module, pooler: Pooler, hooks: Hooks, model_config: ModelConfig) -> None:
        self.backbone = model.base_model  # hidden states; heads belong to poolers
        self.pooler = pooler
        self.hooks = hooks
        self.model_config = model_config
        # transformers derives RoBERTa-family positions from the ids (starting after the padding
        # index) only when none are passed; packed position ids must carry the same offset.
        self.position_offset = position_offset(model_config.model_type, model_config.hf_config.get("pad_token_id"))

    @torch.inference_mode()
    def execute(self, batch: InputBatch) -> OutputHandle:
        """Run ``batch`` and start moving its pooled results to the CPU."""
        hidden_states = self.forward(batch)
        metadata = PoolingMetadata(
            request_ids=tuple(state.request_id for state in batch.requests),
            pooling_params=tuple(state.request.params for state in batch.requests),
            prompt_lens=torch.tensor([state.num_tokens for state in batch.requests], dtype=torch.int64),
            query_start_loc=batch.query_start_loc,
            prompt_token_ids=batch.input_ids,
        )
        output = self.hooks.pool(pooler=self.pooler, hidden_states=hidden_states, metadata=metadata)
        return self.hooks.process_output(output=output, batch=batch)

    def forward(self, batch: InputBatch) -> torch.Tensor:
        """The backbone's last hidden states, ``[num_tokens, hidden_size]``."""
        extra = self.hooks.prepare_inputs(batch=batch, model_config=self.model_config)
        layout = PackedLayout.build(batch.num_scheduled_tokens, batch.device, causal=self.model_config.is_causal)
        outputs = self.backbone(
            input_ids=batch.input_ids.unsqueeze(0),
            position_ids=(batch.positions + self.position_offset).unsqueeze(0),
            use_cache=False,
            **{LAYOUT_KWARG: layout},
            **{key: value.unsqueeze(0) for key, value in extra.items()},
        )
        return outputs[0][0]
