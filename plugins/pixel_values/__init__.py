"""Built-in model-state plugin: the pixels of image inputs, for text-image models (CLIP).

An image request (``request.pixel_values``, ``[3, height, width]`` from the model's image
processor) holds one placeholder token per position its vision tower takes
(``model_config.image_positions``), so the scheduler counts an image like a prompt of that many
tokens. ``add_request`` keeps its pixels flattened and cut into one row per position (the last
zero-padded); each step with an image gets them as the model inputs ``pixel_rows``
(``[num_tokens, width]``: images' rows, zeros for text tokens) and ``image_rows``
(``[num_tokens]`` bool), which travel with the tokens wherever the runner packs, sorts or pads
them. An image's other processor outputs (``request.image_kwargs``, SigLIP2's
``pixel_attention_mask`` and ``spatial_shapes``) travel the same way, as ``<name>_rows``
(``[num_tokens, width]``, their own dtype): a tensor with one entry per position gives each
position its entry, any other is repeated on every position of its image. Steps of text alone get
nothing. Text-only models never see an image request: the front
end refuses images for them.

A page-retrieval model (``model_config.images_in_prompt``: ColPali, ColQwen2) takes a page as
its processor's prompt, as many positions as that prompt has tokens, and its processor's pixel
values of any shape; each image's rows are ``ceil(numel / positions)`` wide, left-aligned in the
step's widest (ColQwen2's ``image_grid_thw`` travels as an image kwarg).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from poolrunner.core import InvalidRequestError, ModelConfig, RequestState, hookimpl

if TYPE_CHECKING:  # torch loads with a model, not with `poolrunner plugins`
    import torch

    from poolrunner.core import InputBatch

NAME = "pixel_values"
KWARGS = "pixel_values.image_kwargs"


@hookimpl
def add_request(state: RequestState, model_config: ModelConfig) -> None:
    pixels = state.request.pixel_values
    if pixels is None:
        return
    positions = state.request.num_tokens
    if not model_config.images_in_prompt and (model_config.image_positions is None
                                              or positions != model_config.image_positions):
        raise InvalidRequestError(
            f"request {state.request_id!r} is an image of {positions} positions, but model {model_config.name} "
            f"({model_config.architecture}) takes images of {model_config.image_positions} positions"
        )
    import torch

    flat = pixels.reshape(-1).float()
    width = -(-flat.numel() // positions)
    padded = torch.nn.functional.pad(flat, (0, width * positions - flat.numel()))
    state.plugin_data[NAME] = padded.view(positions, width)
    if state.request.image_kwargs:
        state.plugin_data[KWARGS] = {name: _per_position(torch.as_tensor(value), positions)
                                     for name, value in state.request.image_kwargs.items()}


def _per_position(value: torch.Tensor, positions: int) -> torch.Tensor:
    """``[positions, width]``: one row per position (a tensor of ``positions`` entries), else the
    whole tensor on every position."""
    if value.dim() >= 1 and value.shape[0] == positions:
        return value.reshape(positions, -1)
    return value.reshape(1, -1).expand(positions, -1)


@hookimpl
def prepare_inputs(batch: InputBatch, model_config: ModelConfig) -> dict[str, torch.Tensor] | None:
    if model_config.image_positions is None and not model_config.images_in_prompt:  # a text model's steps
        return None
    rows = [state.plugin_data.get(NAME) for state in batch.requests]
    if all(row is None for row in rows):
        return None
    import torch

    width = max(row.shape[1] for row in rows if row is not None)
    pixel_rows = torch.zeros(batch.num_tokens, width, dtype=torch.float32)
    image_rows = torch.zeros(batch.num_tokens, dtype=torch.bool)
    offsets = batch.query_start_loc_cpu.tolist()
    for i, (state, row) in enumerate(zip(batch.requests, rows, strict=True)):
        if row is not None:  # the positions scheduled this step
            start = state.num_computed_tokens
            pixel_rows[offsets[i]: offsets[i + 1], : row.shape[1]] = row[start: start + batch.num_scheduled_tokens[i]]
            image_rows[offsets[i]: offsets[i + 1]] = True
    inputs = {"pixel_rows": pixel_rows, "image_rows": image_rows, **_kwarg_rows(batch, offsets)}
    return {key: value.to(batch.device, non_blocking=True) for key, value in inputs.items()}


def _kwarg_rows(batch: InputBatch, offsets: list[int]) -> dict[str, torch.Tensor]:
    """``<name>_rows`` ``[num_tokens, width]`` for each image kwarg of the step (zeros elsewhere)."""
    import torch

    rows: dict[str, torch.Tensor] = {}
    for i, state in enumerate(batch.requests):
        for name, value in state.plugin_data.get(KWARGS, {}).items():
            if name not in rows:
                rows[name] = torch.zeros(batch.num_tokens, value.shape[1], dtype=value.dtype)
            start = state.num_computed_tokens
            rows[name][offsets[i]: offsets[i + 1]] = value[start: start + batch.num_scheduled_tokens[i]]
    return {f"{name}_rows": value for name, value in rows.items()}


@hookimpl
def remove_request(state: RequestState) -> None:
    state.plugin_data.pop(NAME, None)
    state.plugin_data.pop(KWARGS, None)
