"""The model of a text-image family (CLIP): its text and vision towers run in one step.

The runner gives a step as right-padded rows, one request per row (the padded path: the towers
keep transformers' own attention). A row is a text (token ids) or an image: its placeholder ids
and, from the ``pixel_values`` plugin, its pixels spread over its positions (``pixel_rows``) and
``image_rows`` marking it. Text rows run through the text tower and image rows through the vision
tower, each tower once per step for all its rows. Each request's first output row is its tower's
embedding exactly as the family computes it (CLIP: ``get_text_features``, the EOS row through
``text_projection``; ``get_image_features``, the class row through ``visual_projection``), so
the ``embed`` pooler's CLS pooling and normalization give CLIP's normalized features; the other
rows are zero.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel


class TextImageModel(nn.Module):
    """``model`` (a ``CLIPModel``) as the runner's backbone.

    :ivar config: The family's config; its attention is transformers' own, so the runner pads.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model
        self.config = model.config
        vision = model.config.vision_config
        self.image_shape = (vision.num_channels, vision.image_size, vision.image_size)

    @property
    def base_model(self) -> TextImageModel:
        return self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pixel_rows: torch.Tensor | None = None,
                image_rows: torch.Tensor | None = None, **_: object) -> tuple[torch.Tensor]:
        """``[rows, length, projection_dim]``: each row's embedding at position 0, zeros after.

        :param input_ids: ``[rows, length]`` int64, right-padded (``attention_mask`` 0 there).
        :param pixel_rows: ``[rows, length, width]`` float: an image row's pixels, flattened in
            ``[channels, height, width]`` order and cut into ``width`` values per position.
        :param image_rows: ``[rows, length]`` bool, true on every position of an image row.
        """
        rows, length = input_ids.shape
        dtype = next(self.model.parameters()).dtype
        out = torch.zeros(rows, length, self.config.projection_dim, dtype=dtype, device=input_ids.device)
        flags = image_rows[:, 0].tolist() if image_rows is not None else [False] * rows
        images = [row for row, flag in enumerate(flags) if flag]
        texts = [row for row, flag in enumerate(flags) if not flag]
        if texts:
            index = torch.tensor(texts, device=input_ids.device)
            # Pads are id 0 (CLIP reads the EOS by id: the first eos_token_id, or the largest id).
            mask = attention_mask.index_select(0, index)
            ids = input_ids.index_select(0, index) * mask
            out[index, 0] = self.model.get_text_features(input_ids=ids, attention_mask=mask).pooler_output.to(dtype)
        if images:
            assert pixel_rows is not None
            index = torch.tensor(images, device=input_ids.device)
            size = self.image_shape[0] * self.image_shape[1] * self.image_shape[2]
            flat = pixel_rows.index_select(0, index).reshape(len(images), -1)[:, :size]
            pixel_values = flat.reshape(len(images), *self.image_shape).to(dtype)
            out[index, 0] = self.model.get_image_features(pixel_values=pixel_values).pooler_output.to(dtype)
        return (out,)

