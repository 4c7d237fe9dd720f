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

A family is a subclass of :class:`TextImageModel` (:mod:`poolrunner.core.model.siglip` holds
SigLIP's and SigLIP2's) overriding :meth:`~TextImageModel.text_features`,
:meth:`~TextImageModel.image_features` and the load-time facts (its embedding size, the positions
and pixel shape of one image, its pair score).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from poolrunner.core.types import TextPadding


class TextImageModel(nn.Module):
    """``model`` (a ``CLIPModel``) as the runner's backbone.

    :param image_positions: The positions one image takes (:meth:`image_positions`).
    :param text_padding: How the text tower takes a prompt, where the family pads it (SigLIP).
    :ivar config: The family's config; its attention is transformers' own, so the runner pads.
    """

    def __init__(self, model: PreTrainedModel, *, image_positions: int, text_padding: TextPadding | None = None,
                 ) -> None:
        super().__init__()
        self.model = model
        self.config = model.config
        self.positions = image_positions
        self.text_padding = text_padding
        self.image_shape = self.pixel_shape(model.config, image_positions)

    # ------------------------------------------------------------------ load-time facts

    @staticmethod
    def embedding_size(hf_config: PretrainedConfig) -> int:
        """The size both towers project to (CLIP: ``projection_dim``)."""
        return int(hf_config.projection_dim)

    @staticmethod
    def image_positions(hf_config: PretrainedConfig, path: Path | None = None) -> int:
        """The vision tower's sequence length: one position per patch, plus CLIP's class embedding."""
        vision = hf_config.vision_config
        return (vision.image_size // vision.patch_size) ** 2 + 1

    @staticmethod
    def pixel_shape(hf_config: PretrainedConfig, positions: int) -> tuple[int, ...]:
        """One image's ``pixel_values`` shape: ``[num_channels, image_size, image_size]``."""
        vision = hf_config.vision_config
        return (vision.num_channels, vision.image_size, vision.image_size)

    def pair_score(self) -> tuple[float, float] | None:
        """``(logit_scale, logit_bias)`` of a family whose (text, image) score is
        ``sigmoid(cosine * exp(logit_scale) + logit_bias)``; ``None``: the score is the cosine
        (CLIP's ``logits_per_text`` without its scale: same order)."""
        return None

    @property
    def base_model(self) -> TextImageModel:
        return self

    # ------------------------------------------------------------------ the step

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pixel_rows: torch.Tensor | None = None,
                image_rows: torch.Tensor | None = None, **image_kwargs: Any) -> tuple[torch.Tensor]:
        """``[rows, length, embedding_size]``: each row's embedding at position 0, zeros after.

        :param input_ids: ``[rows, length]`` int64, right-padded (``attention_mask`` 0 there).
        :param pixel_rows: ``[rows, length, width]`` float: an image row's pixels, flattened in
            ``pixel_values`` order and cut into ``width`` values per position.
        :param image_rows: ``[rows, length]`` bool, true on every position of an image row.
        :param image_kwargs: The image kwargs' rows (``<name>_rows``, ``[rows, length, width]``)
            the ``pixel_values`` plugin gives, for the families whose processor has more outputs.
        """
        rows, length = input_ids.shape
        dtype = next(self.model.parameters()).dtype
        out = torch.zeros(rows, length, self.embedding_size(self.config), dtype=dtype, device=input_ids.device)
        flags = image_rows[:, 0].tolist() if image_rows is not None else [False] * rows
        images = [row for row, flag in enumerate(flags) if flag]
        texts = [row for row, flag in enumerate(flags) if not flag]
        if texts:
            index = torch.tensor(texts, device=input_ids.device)
            features = self.text_features(input_ids.index_select(0, index), attention_mask.index_select(0, index))
            out[index, 0] = features.to(dtype)
        if images:
            assert pixel_rows is not None
            index = torch.tensor(images, device=input_ids.device)
            kwargs = {name.removesuffix("_rows"): value.index_select(0, index) for name, value in image_kwargs.items()
                      if name.endswith("_rows") and isinstance(value, torch.Tensor)}
            out[index, 0] = self.image_features(pixel_rows.index_select(0, index), **kwargs).to(dtype)
        return (out,)

    def text_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[texts, embedding_size]``: ``get_text_features``' pooled output of right-padded rows."""
        # Pads are id 0 (CLIP reads the EOS by id: the first eos_token_id, or the largest id).
        ids = input_ids * attention_mask
        return self.model.get_text_features(input_ids=ids, attention_mask=attention_mask).pooler_output

    def image_features(self, pixel_rows: torch.Tensor, **image_kwargs: torch.Tensor) -> torch.Tensor:
        """``[images, embedding_size]``: ``get_image_features``' pooled output, one batched forward.

        :param pixel_rows: ``[images, length, width]``: each image's ``pixel_values`` spread over
            its positions (the first ``prod(image_shape)`` values, in order, are them).
        """
        count = pixel_rows.shape[0]
        size = 1
        for dim in self.image_shape:
            size *= dim
        pixel_values = pixel_rows.reshape(count, -1)[:, :size].reshape(count, *self.image_shape)
        dtype = next(self.model.parameters()).dtype
        return self.model.get_image_features(pixel_values=pixel_values.to(dtype)).pooler_output
