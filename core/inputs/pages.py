"""A page-retrieval model's inputs (ColPali, ColQwen2), through the folder's own processor.

Pages are images prepared exactly as the processor's ``process_images`` prepares them (its
prompt of image tokens and text, its pixel values, ColQwen2's ``image_grid_thw``) and queries as
its ``process_queries`` does (the query prefix, the query-augmentation tokens, the trailing
newline), one input at a time, so nothing depends on what else is in the request. Images are
decoded within the limits of :mod:`poolrunner.core.inputs.images` first; every failure is an
:class:`InvalidRequestError` naming the input.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from attrs import frozen

from poolrunner.core.errors import InvalidRequestError, ModelLoadError
from poolrunner.core.inputs.images import ImageInputs, ImageLimits


@frozen(eq=False)
class Prepared:
    """One input as the processor prepared it.

    :ivar prompt_token_ids: Its ``input_ids``, special tokens and image placeholders included.
    :ivar pixel_values: A page's pixel values for one image (ColPali ``[3, H, W]``, ColQwen2
        ``[num_patches, patch_dim]``) float32; ``None`` for a query.
    :ivar image_kwargs: A ColQwen2 page's ``image_grid_thw``, ``[1, 3]`` int64 (the pixel_values
        plugin gives it on each of the page's positions); ``None`` otherwise.
    """

    prompt_token_ids: tuple[int, ...]
    pixel_values: Any = None
    image_kwargs: dict[str, Any] | None = None


class PageInputs(ImageInputs):
    """Queries and pages of one page-retrieval model.

    :param processor: The folder's ``ColPaliProcessor`` or ``ColQwen2Processor``.
    :param limits: The runtime's :class:`ImageLimits`.
    """

    def __init__(self, processor: Any, limits: ImageLimits = ImageLimits()) -> None:  # noqa: B008 (frozen)
        super().__init__(processor.image_processor, (), limits)
        self.page_processor = processor
        # The processor's tokenizer sets its padding on the shared backend per call.
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # a pickled copy (Ray) makes its own lock
        return {**super().__getstate__(), "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: Path, vision_config: Any = None, limits: ImageLimits = ImageLimits(),  # noqa: B008
             *, shape: tuple[int, ...] | None = None) -> PageInputs:
        """The folder's own processor (``AutoProcessor``, never downloaded).

        :raises ModelLoadError: when the folder has no processor transformers reads, or it has
            no ``process_images`` / ``process_queries``.
        """
        from transformers import AutoProcessor

        try:
            processor = AutoProcessor.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        except Exception as exc:  # OSError, ValueError: no processor_config.json, a class of its own code
            raise ModelLoadError(f"cannot load the processor of {path}: {' '.join(str(exc).split())}") from exc
        if not all(hasattr(processor, name) for name in ("process_images", "process_queries")):
            raise ModelLoadError(f"{path}: the processor is a {type(processor).__name__}, which has no "
                                 "process_images / process_queries (ColPaliProcessor, ColQwen2Processor)")
        return cls(processor, limits)

    def page(self, item: Any, index: int) -> Prepared:
        """``item``, an image, as ``process_images([item])`` prepares it.

        :raises InvalidRequestError: naming ``input {index}``, as :meth:`ImageInputs.open`, or
            when the processor refuses the image.
        """
        image = self.open(item, index)
        try:
            with self._lock:
                batch = self.page_processor.process_images([image])
        except Exception as exc:  # the processor's own refusals (an image it cannot resize...)
            raise InvalidRequestError(f"input {index}: the image processor refused the image: {exc}") from None
        grid = batch.get("image_grid_thw")
        pixels = batch["pixel_values"][0].float()
        if grid is not None:  # one page: nothing padded
            pixels = pixels[: int(grid[0].prod())]
        return Prepared(tuple(batch["input_ids"][0].tolist()), pixels.contiguous(),
                        None if grid is None else {"image_grid_thw": grid[:1].clone()})

    def query(self, text: str) -> Prepared:
        """``text`` as ``process_queries([text])`` prepares it."""
        with self._lock:
            ids = self.page_processor.process_queries([text])["input_ids"][0]
        return Prepared(tuple(ids.tolist()))
