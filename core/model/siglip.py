"""SigLIP and SigLIP2 (``SiglipModel``, ``Siglip2Model``) as text-image backbones.

Both differ from CLIP in three ways that change every vector, each taken from transformers and
checked against it (``tests/test_siglip.py``):

- **Text.** The text tower was trained on prompts padded to 64 tokens and pools the *last*
  position (``SiglipTextModel``: ``last_hidden_state[:, -1]`` through ``head``), which is a pad
  for any shorter prompt. So a prompt runs padded to :class:`~poolrunner.core.types.TextPadding`
  ``length`` with the tokenizer's pad id on its padding side (right for SigLIP's tokenizer, left
  for SigLIP2's Gemma tokenizer), exactly as transformers' zero-shot-image-classification
  pipeline tokenizes SigLIP text (``padding="max_length", max_length=64, truncation=True``, the
  model cards' recipe too) and as vLLM pads SigLIP prompts to ``text_config.max_position_embeddings``
  (vllm-project/vllm#51157, 64 for every published checkpoint). The pads are masked exactly when
  the folder's tokenizer returns an ``attention_mask`` (its ``model_input_names``), because the
  pipeline passes the tokenizer's output to the model whole; Google's SigLIP tokenizers return
  none, so their pads attend, as in training and in vLLM. Prompts over ``max_model_len`` (64) are
  refused like every other prompt (the pipeline would truncate them).
- **Images.** SigLIP: ``[3, image_size, image_size]`` pixels, one position per patch (no class
  position); the pooled output is the attention-pooling head's. SigLIP2 (NaFlex): the processor
  gives ``pixel_values`` ``[max_num_patches, channels * patch ** 2]``, ``pixel_attention_mask``
  ``[max_num_patches]`` and ``spatial_shapes`` ``[2]`` per image; an image takes
  ``max_num_patches`` positions (the folder's processor's, 256 by default), one patch each, and
  the mask and shapes travel beside its pixels (the ``pixel_values`` plugin's image kwargs).
- **Scores.** ``logits_per_text = cosine * exp(logit_scale) + logit_bias`` and the probability
  is its sigmoid (``SiglipModel.forward``, the pipeline's ``torch.sigmoid``), so a (text, image)
  pair scores ``sigmoid(cosine * exp(logit_scale) + logit_bias)``.

``get_text_features`` / ``get_image_features`` are transformers' own; the ``embed`` pooler
normalizes them into SigLIP's ``text_embeds`` / ``image_embeds``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from poolrunner.core.errors import ModelLoadError
from poolrunner.core.inputs.images import load_image_processor
from poolrunner.core.model.towers import TextImageModel
from poolrunner.core.types import TextPadding

SIGLIP_FAMILIES = ("siglip", "siglip2")
"""The ``model_type`` of the families whose text tower takes padded prompts (:func:`text_padding`)."""


def text_padding(path: Path, hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> TextPadding:
    """How SigLIP's text tower takes a prompt (see the module docstring).

    :raises ModelLoadError: when the tokenizer has no pad token.
    """
    if tokenizer.pad_token_id is None:
        raise ModelLoadError(f"{path}: the tokenizer has no pad token, but {type(hf_config).__name__}'s text tower "
                             "takes prompts padded to max_length (the last position is pooled)")
    return TextPadding(length=int(hf_config.text_config.max_position_embeddings),
                       pad_token_id=int(tokenizer.pad_token_id), left=tokenizer.padding_side == "left",
                       attention_mask="attention_mask" in tokenizer.model_input_names)


class SiglipTowers(TextImageModel):
    """A ``SiglipModel``: padded text prompts, square images, a sigmoid pair score."""

    @staticmethod
    def embedding_size(hf_config: PretrainedConfig) -> int:
        """The vision tower's hidden size: its attention-pooling head's output, and the text
        head's (``text_config.projection_size``, checked equal at load)."""
        return int(hf_config.vision_config.hidden_size)

    @staticmethod
    def image_positions(hf_config: PretrainedConfig, path: Path | None = None) -> int:
        """One position per patch (SigLIP has no class position)."""
        vision = hf_config.vision_config
        return (vision.image_size // vision.patch_size) ** 2

    def pair_score(self) -> tuple[float, float]:
        return float(self.model.logit_scale.float().item()), float(self.model.logit_bias.float().item())

    def text_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``get_text_features`` of each row padded to :attr:`text_padding`'s length on its side
        (the last position pooled), the pads masked only where the tokenizer masks them."""
        padding = self.text_padding
        assert padding is not None
        rows, width = input_ids.shape
        lengths = attention_mask.sum(1)  # real tokens never pass max_model_len <= padding.length
        columns = torch.arange(padding.length, device=input_ids.device).expand(rows, -1)
        # Right padding keeps each token's column; left padding shifts it by the row's pads.
        source = columns - (padding.length - lengths[:, None]) if padding.left else columns
        real = (source >= 0) & (source < lengths[:, None])
        gathered = input_ids.gather(1, source.clamp(0, width - 1))
        ids = torch.where(real, gathered, torch.full_like(gathered, padding.pad_token_id))
        mask = real.to(attention_mask.dtype) if padding.attention_mask else None
        return self.model.get_text_features(input_ids=ids, attention_mask=mask).pooler_output


class Siglip2Towers(SiglipTowers):
    """A ``Siglip2Model``: SigLIP's text and score; NaFlex images (patches, their mask and grid)."""

    @staticmethod
    def image_positions(hf_config: PretrainedConfig, path: Path | None = None) -> int:
        """The folder's image processor's ``max_num_patches``: one position per patch slot.

        :raises ModelLoadError: when the folder has no image processor with ``max_num_patches``.
        """
        assert path is not None
        processor = load_image_processor(path)
        patches = getattr(processor, "max_num_patches", None)
        if not isinstance(patches, int) or patches < 1:
            raise ModelLoadError(f"{path}: the image processor ({type(processor).__name__}) has no positive "
                                 f"max_num_patches ({patches!r}); Siglip2Model takes NaFlex patches")
        return patches

    @staticmethod
    def pixel_shape(hf_config: PretrainedConfig, positions: int) -> tuple[int, ...]:
        """``[max_num_patches, num_channels * patch_size ** 2]``."""
        vision = hf_config.vision_config
        return (positions, vision.num_channels * vision.patch_size ** 2)

    def image_features(self, pixel_rows: torch.Tensor, **image_kwargs: torch.Tensor) -> torch.Tensor:
        """``get_image_features`` of each image's patches, with its ``pixel_attention_mask`` and
        ``spatial_shapes`` (one batched forward; the mask keeps padded patch slots out).

        :raises KeyError: without those two image kwargs (the processor gives both).
        """
        count = pixel_rows.shape[0]
        patches, width = self.image_shape
        pixel_values = pixel_rows.reshape(count, -1)[:, :patches * width].reshape(count, patches, width)
        mask = image_kwargs["pixel_attention_mask"][:, :patches, 0]
        shapes = image_kwargs["spatial_shapes"][:, 0, :]
        dtype = next(self.model.parameters()).dtype
        return self.model.get_image_features(pixel_values=pixel_values.to(dtype), pixel_attention_mask=mask,
                                             spatial_shapes=shapes).pooler_output


TOWERS: dict[str, type[TextImageModel]] = {"clip": TextImageModel, "siglip": SiglipTowers, "siglip2": Siglip2Towers}
"""The backbone class of each served text-image ``model_type`` (``families.TEXT_IMAGE_FAMILIES``)."""
