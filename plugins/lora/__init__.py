"""Built-in plugin: LoRA adapters per request (PEFT folders), mixed with the base model in one step.

``load_adapter`` reads a PEFT LoRA folder (:mod:`.folder`: ``adapter_config.json`` checked,
``adapter_model.safetensors`` read with safetensors) and binds it to the model's modules
(:mod:`.layers`); a request runs with adapter ``params.lora_id``. ``add_request`` keeps that
number, ``prepare_inputs`` gives a step with adapted requests the model input ``lora_ids``
(``[num_tokens]`` int64, 0 for the base model), which travels with the tokens wherever the runner
packs, sorts or pads them, and ``pool`` (a wrapper) tells the adapters' heads which pooled rows
are whose. Steps without adapted requests get nothing: the base model runs as it always does.
Each answer equals ``PeftModel.from_pretrained(base, folder)``'s with that adapter active.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from poolrunner.core import ModelConfig, RequestState, hookimpl

if TYPE_CHECKING:  # torch loads with a model, not with `poolrunner plugins`
    import torch
    from torch import nn

    from poolrunner.core import InputBatch, LoraRequest, PoolingMetadata

NAME = "lora"


@hookimpl
def load_adapter(model: nn.Module, lora: LoraRequest, max_rank: int) -> str:
    from poolrunner.plugins.lora.folder import read_folder
    from poolrunner.plugins.lora.layers import LoraModel

    adapter = LoraModel.of(model).load(lora.lora_id, read_folder(lora.path, max_rank))
    heads = f", heads {sorted(adapter.heads)}" if adapter.heads else ""
    return f"LoRA on {len(adapter.pairs)} layers{heads}"


@hookimpl
def unload_adapter(model: nn.Module, lora_id: int) -> bool:
    from poolrunner.plugins.lora.layers import LoraModel

    return LoraModel.of(model).unload(lora_id)


@hookimpl
def add_request(state: RequestState) -> None:
    if state.request.params.lora_id is not None:
        state.plugin_data[NAME] = state.request.params.lora_id


@hookimpl
def prepare_inputs(batch: InputBatch, model_config: ModelConfig) -> dict[str, torch.Tensor] | None:
    ids = [state.plugin_data.get(NAME, 0) for state in batch.requests]
    if not any(ids):
        return None
    import torch

    from poolrunner.plugins.lora.layers import MODEL_INPUT

    per_token = torch.repeat_interleave(torch.tensor(ids, dtype=torch.int64),
                                        torch.tensor(batch.num_scheduled_tokens, dtype=torch.int64))
    return {MODEL_INPUT: per_token.to(batch.device, non_blocking=True)}


@hookimpl(wrapper=True)
def pool(metadata: PoolingMetadata) -> Generator[None, Any, Any]:
    ids = tuple(params.lora_id or 0 for params in metadata.pooling_params)
    if not any(ids):
        return (yield)
    from poolrunner.plugins.lora.layers import POOLED

    token = POOLED.set((ids, tuple(metadata.prompt_lens.tolist())))
    try:
        return (yield)
    finally:
        POOLED.reset(token)


@hookimpl
def remove_request(state: RequestState) -> None:
    state.plugin_data.pop(NAME, None)
