"""The model of a page-retrieval family (ColPali, ColQwen2): one vector per prompt token.

The runner gives a step as right-padded rows, one request per row (the padded path: the model
keeps transformers' own attention, as its reference does). A row is a query (the processor's
``process_queries`` tokens) or a page (``process_images`` tokens, image placeholders included)
whose pixels the ``pixel_values`` plugin spreads over its positions (``pixel_rows``, marked by
``image_rows``; a ColQwen2 page's ``image_grid_thw`` in ``image_grid_thw_rows``). All pages of a step run in one
forward of the family's own class, pixels batched as its processor batches them, and all
queries in another; each row's output is the class's ``embeddings`` (``embedding_proj_layer``,
L2-normalized, zero where the attention mask is 0), exactly as
``ColPaliForRetrieval(**processor.process_images(...))`` gives them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel


class PageRetrievalModel(nn.Module):
    """``model`` (a ``ColPaliForRetrieval`` or ``ColQwen2ForRetrieval``) as the runner's backbone.

    :ivar config: The family's config; its attention is transformers' own, so the runner pads.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model
        self.config = model.config
        vision = model.config.vlm_config.vision_config
        # Qwen2-VL's patches are given flat by the processor; ColPali's pages are whole images.
        self.dynamic = model.config.model_type == "colqwen2"
        if self.dynamic:
            self.patch_size = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        else:
            self.image_shape = (vision.num_channels, vision.image_size, vision.image_size)

    @property
    def base_model(self) -> PageRetrievalModel:
        return self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pixel_rows: torch.Tensor | None = None,
                image_rows: torch.Tensor | None = None, image_grid_thw_rows: torch.Tensor | None = None,
                **_: object) -> tuple[torch.Tensor]:
        """``[rows, length, embedding_dim]``: each row's ``embeddings``.

        :param input_ids: ``[rows, length]`` int64, right-padded (``attention_mask`` 0 there).
        :param pixel_rows: ``[rows, length, width]`` float: a page's pixel values, flattened and
            cut into ``ceil(numel / positions)`` values per position, left-aligned.
        :param image_rows: ``[rows, length]`` bool, true on every position of a page.
        :param image_grid_thw_rows: ``[rows, length, 3]`` int64, a ColQwen2 page's
            ``image_grid_thw`` on each of its positions (an image kwarg of the plugin).
        """
        rows, length = input_ids.shape
        dtype = self.model.embedding_proj_layer.weight.dtype
        out = torch.zeros(rows, length, self.config.embedding_dim, dtype=dtype, device=input_ids.device)
        flags = image_rows[:, 0].tolist() if image_rows is not None else [False] * rows
        for page in (False, True):
            members = [row for row, flag in enumerate(flags) if flag is page]
            if not members:
                continue
            index = torch.tensor(members, device=input_ids.device)
            mask = attention_mask.index_select(0, index)
            inputs = {"input_ids": input_ids.index_select(0, index), "attention_mask": mask}
            if page:
                assert pixel_rows is not None
                inputs.update(self._pixels(pixel_rows.index_select(0, index), mask.sum(1).tolist(),
                                           None if image_grid_thw_rows is None
                                           else image_grid_thw_rows.index_select(0, index)))
            if not self.dynamic:  # ColPaliProcessor's own token types: all 0 without a suffix
                inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
            out[index] = self.model(**inputs).embeddings.to(dtype)
        return (out,)

    def _pixels(self, rows: torch.Tensor, positions: list[int], grid: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The pages' pixel values as their processor batches them: ColPali ``[pages, 3, H, W]``;
        ColQwen2 ``[pages, max_patches, patch_dim]`` zero-padded, with ``image_grid_thw``."""
        dtype = self.model.embedding_proj_layer.weight.dtype
        if not self.dynamic:
            size = self.image_shape[0] * self.image_shape[1] * self.image_shape[2]
            pages = [_unspread(rows[i], count, size).view(self.image_shape) for i, count in enumerate(positions)]
            return {"pixel_values": torch.stack(pages).to(dtype)}
        assert grid is not None
        grids = grid[:, 0]
        patches = [t * h * w for t, h, w in grids.tolist()]
        pages = [_unspread(rows[i], count, patches[i] * self.patch_size).view(patches[i], self.patch_size)
                 for i, count in enumerate(positions)]
        padded = torch.stack([F.pad(page, (0, 0, 0, max(patches) - page.shape[0])) for page in pages])
        return {"pixel_values": padded.to(dtype), "image_grid_thw": grids}


def _unspread(rows: torch.Tensor, positions: int, size: int) -> torch.Tensor:
    """The ``size`` values one image's ``positions`` rows hold (``ceil(size / positions)`` each)."""
    width = -(-size // positions)
    return rows[:positions, :width].reshape(-1)[:size]
