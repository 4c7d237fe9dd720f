"""Image inputs: what counts as one, decoding it within limits, and the model's own preprocessing.

An image input is a ``PIL.Image.Image``, raw bytes (``bytes``, ``bytearray``, ``memoryview``), a
path (``os.PathLike``: ``pathlib.Path``; a ``str`` is always text), an :class:`ImageURL`, or,
for a model with a vision tower, a ``str`` that is a ``data:image/...`` URL. Remote ``http(s)``
URLs are refused, nothing downloaded, unless the operator lists their host in
:attr:`ImageLimits.allowed_media_domains` (vLLM's ``--allowed-media-domains``); then
:mod:`poolrunner.core.inputs.media_fetch` fetches them within the byte limit and a timeout.
Encoded images are checked before their pixels are decoded (:attr:`ImageLimits.max_bytes`, and
the size the header declares against :attr:`ImageLimits.max_pixels`: a decompression bomb never
decodes); the MIME type a data URL names is not trusted, the bytes decide the format (as PIL and
browsers read them); a multi-frame image gives its first frame, and every mode
(palette, CMYK, 16-bit, alpha) is converted to RGB, as CLIP's processor does. The pixels are the
folder's own image processor's (``AutoImageProcessor``, never downloaded), its PIL backend
whatever else is installed. Every failure is an :class:`InvalidRequestError` naming the input.

A request's images are decoded and preprocessed on a small thread pool per model
(:meth:`ImageInputs.pixels_of`): PIL's decoders and resampling and numpy's arithmetic release the
GIL, so the images of one request use the cores together, and however many requests carry
images at once, preprocessing never takes more than :data:`PREPROCESS_THREADS` threads from the
towers and the other requests (the server plans each request on a worker thread of its own).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import sys
import threading
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from attrs import field, frozen

from poolrunner.core.errors import InvalidRequestError, ModelLoadError
from poolrunner.core.validators import positive_int

MAX_IMAGE_BYTES = 32 * 1024 * 1024
"""Default of :attr:`ImageLimits.max_bytes`: the most bytes one encoded image may have."""
MAX_IMAGE_PIXELS = 40_000_000
"""Default of :attr:`ImageLimits.max_pixels`: the most pixels (width x height, as the header
declares) one image may have."""
MAX_IMAGES_PER_REQUEST = 256
"""Default of :attr:`ImageLimits.max_images`: the most images one request may carry."""
MEDIA_FETCH_TIMEOUT = 5.0
"""Default of :attr:`ImageLimits.fetch_timeout`, seconds (vLLM's ``VLLM_IMAGE_FETCH_TIMEOUT``)."""
DATA_URL_PREFIX = "data:image/"
PREPROCESS_THREADS = min(4, os.cpu_count() or 1)
"""Threads that decode and preprocess images, per model: the cores, at most 4 (beyond that a
request's images gain little, and the towers lose cores)."""


def host_names(value: Any) -> tuple[str, ...]:
    """Host names, lower-cased, each once; a single string is one host."""
    names = (value,) if isinstance(value, str) else tuple(value or ())
    return tuple(dict.fromkeys(str(name).strip().lower() for name in names))


def check_host_names(_instance: object, attribute: Any, value: tuple[str, ...]) -> None:
    """:raises ValueError: for an entry that is not a bare host name (a URL, a port, a wildcard)."""
    for name in value:
        if not name or "/" in name or ":" in name or "*" in name:
            raise ValueError(f"{attribute.name} holds host names (images.example.com), got {name!r}")


def positive_seconds(_instance: object, attribute: Any, value: Any) -> None:
    """:raises ValueError: unless ``value`` is a number above 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{attribute.name} must be a positive number of seconds, got {value!r}")


@frozen(kw_only=True)
class ImageLimits:
    """What one image, and one request, may hold; the same on every surface (the runtime's
    settings of the same names, ``RuntimeConfig.max_image_bytes``...).

    :ivar max_bytes: Most bytes of one encoded image (file, bytes, data URL payload, download).
    :ivar max_pixels: Most pixels of one image, width x height as its header declares, checked
        before any pixel is decoded.
    :ivar max_images: Most images in one request (every input, query and document counted).
    :ivar allowed_media_domains: Hosts whose ``http(s)`` image URLs are fetched (exact host
        names, as vLLM's ``--allowed-media-domains``); empty: every remote URL is refused.
    :ivar fetch_timeout: Seconds one download may take, connecting and reading.
    :raises ValueError: for a limit that is not positive, or a domain that is not a host name.
    """

    max_bytes: int = field(default=MAX_IMAGE_BYTES, validator=positive_int)
    max_pixels: int = field(default=MAX_IMAGE_PIXELS, validator=positive_int)
    max_images: int = field(default=MAX_IMAGES_PER_REQUEST, validator=positive_int)
    allowed_media_domains: tuple[str, ...] = field(default=(), converter=host_names, validator=check_host_names)
    fetch_timeout: float = field(default=MEDIA_FETCH_TIMEOUT, validator=positive_seconds)


@frozen
class ImageURL:
    """An image given by URL: a ``data:image/<type>;base64,...`` URL is decoded; an ``http(s)``
    URL is refused (poolrunner downloads nothing)."""

    url: str


def is_image(item: object, *, data_urls: bool = False) -> bool:
    """Whether ``item`` is an image input; ``data_urls``: a ``str`` that starts with
    ``data:image/`` is one too (for models with a vision tower only, so text stays text)."""
    if isinstance(item, bytes | bytearray | memoryview | os.PathLike | ImageURL):
        return True
    if data_urls and isinstance(item, str) and item.startswith(DATA_URL_PREFIX):
        return True
    pil = sys.modules.get("PIL.Image")  # a PIL image exists only once PIL is imported
    return pil is not None and isinstance(item, pil.Image)


class ImageInputs:
    """Turns one model's image inputs into its pixel values.

    :param processor: The folder's image processor (``AutoImageProcessor``).
    :param shape: ``(channels, height, width)`` the vision tower takes.
    :param limits: The runtime's :class:`ImageLimits`.
    """

    def __init__(self, processor: Any, shape: tuple[int, ...], limits: ImageLimits = ImageLimits(),  # noqa: B008 (frozen)
                 *, threads: int = PREPROCESS_THREADS) -> None:
        self.processor = processor
        self.shape = shape
        self.limits = limits
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # a pickled copy starts its own pool
        return {**self.__dict__, "_pool": None, "_pool_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _pool_lock=threading.Lock())

    @property
    def max_pixels(self) -> int:
        return self.limits.max_pixels

    @property
    def max_bytes(self) -> int:
        return self.limits.max_bytes

    def check_count(self, count: int) -> None:
        """:raises InvalidRequestError: for more than :attr:`ImageLimits.max_images` images."""
        if count > self.limits.max_images:
            raise InvalidRequestError(f"the request has {count} images, more than the limit of "
                                      f"{self.limits.max_images} per request (max_images_per_request)")

    @classmethod
    def load(cls, path: Path, vision_config: Any, limits: ImageLimits = ImageLimits(),  # noqa: B008 (frozen)
             *, shape: tuple[int, ...] | None = None) -> ImageInputs:
        """The folder's image processor, checked to give the vision tower's input shape.

        :param shape: One image's ``pixel_values`` shape, when it is not
            ``[num_channels, image_size, image_size]`` (SigLIP2: ``[max_num_patches, channels * patch ** 2]``).
        :raises ModelLoadError: when the folder has no image processor transformers reads, or
            its output is not ``shape``.
        """
        from PIL import Image

        processor = load_image_processor(path)
        shape = shape or (vision_config.num_channels, vision_config.image_size, vision_config.image_size)
        inputs = cls(processor, shape, limits)
        got = tuple(inputs.pixels(Image.new("RGB", (7, 5)), 0).shape)
        if got != shape:
            raise ModelLoadError(f"{path}: the image processor gives pixel values of shape {list(got)}, but the "
                                 f"vision tower takes {list(shape)}")
        return inputs

    def pixels_of(self, items: Mapping[int, Any]) -> dict[int, Any]:
        """:meth:`pixels` of each ``{index: item}``, on the model's preprocessing threads.

        :raises InvalidRequestError: :meth:`pixels`' error for the lowest failing index (as one
            image after another would); the images not yet started are not preprocessed.
        """
        return {index: features["pixel_values"] for index, features in self.features_of(items).items()}

    def features_of(self, items: Mapping[int, Any]) -> dict[int, dict[str, Any]]:
        """:meth:`features` of each ``{index: item}``, on the model's preprocessing threads.

        :raises InvalidRequestError: :meth:`features`' error for the lowest failing index (as one
            image after another would); the images not yet started are not preprocessed.
        """
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="poolrunner-images")
        futures: dict[int, Future[Any]] = {index: self._pool.submit(self.features, item, index)
                                           for index, item in items.items()}
        try:
            return {index: future.result() for index, future in futures.items()}
        finally:
            for future in futures.values():
                future.cancel()

    def pixels(self, item: Any, index: int) -> Any:
        """``item``'s pixel values, ``[channels, height, width]`` float32 (a torch tensor; SigLIP2:
        ``[max_num_patches, channels * patch ** 2]``).

        :raises InvalidRequestError: naming ``input {index}``: unreadable, truncated, empty or
            over a limit; a remote URL whose host is not allowed, or whose download failed.
        """
        return self.features(item, index)["pixel_values"]

    def features(self, item: Any, index: int) -> dict[str, Any]:
        """Every output of the image processor for ``item``, one image's (the batch dimension
        dropped): ``pixel_values`` float32, and whatever else the family's processor gives
        (SigLIP2: ``pixel_attention_mask`` ``[max_num_patches]``, ``spatial_shapes`` ``[2]``).

        :raises InvalidRequestError: as :meth:`pixels`.
        """
        image = self.open(item, index)
        try:
            outputs = self.processor(images=image, return_tensors="pt")
        except Exception as exc:  # the processor's own refusals (an image it cannot resize...)
            raise InvalidRequestError(f"input {index}: the image processor refused the image: {exc}") from None
        features = {name: value[0] for name, value in outputs.items()}
        features["pixel_values"] = features["pixel_values"].float()
        return features

    def open(self, item: Any, index: int) -> Any:
        """``item`` decoded: an RGB ``PIL.Image.Image``, its pixels loaded.

        :raises InvalidRequestError: as :meth:`pixels`.
        """
        from PIL import Image

        if isinstance(item, Image.Image):
            self._check_size(item, index)
            return self._rgb(item, index)
        data = self._encoded(item, index)
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            try:
                image = Image.open(io.BytesIO(data))  # reads the header only
            except (Image.DecompressionBombError, Image.DecompressionBombWarning):
                raise InvalidRequestError(f"input {index}: the image declares more than "
                                          f"{self.max_pixels} pixels (decompression bomb refused)") from None
            except Exception as exc:  # UnidentifiedImageError, a malformed header
                raise InvalidRequestError(f"input {index} is not an image PIL can read ({len(data)} bytes: "
                                          f"{type(exc).__name__})") from None
        self._check_size(image, index)
        return self._rgb(image, index)

    def _encoded(self, item: Any, index: int) -> bytes:
        """The encoded image of bytes, a path or a data URL, within :attr:`max_bytes`."""
        if isinstance(item, bytes | bytearray | memoryview):
            data = bytes(item)
        elif isinstance(item, os.PathLike):
            path = Path(item)
            try:
                size = path.stat().st_size
                if size > self.max_bytes:
                    raise InvalidRequestError(f"input {index}: {path} has {size} bytes, more than the "
                                              f"limit of {self.max_bytes}")
                data = path.read_bytes()
            except OSError as exc:
                raise InvalidRequestError(f"input {index}: cannot read image file {path}: {exc.strerror}") from None
        else:
            data = self._url(item.url if isinstance(item, ImageURL) else item, index)
        if len(data) > self.max_bytes:
            raise InvalidRequestError(f"input {index}: the image has {len(data)} bytes, more than the limit of "
                                      f"{self.max_bytes}")
        if not data:
            raise InvalidRequestError(f"input {index}: the image is empty (0 bytes)")
        return data

    def _url(self, url: str, index: int) -> bytes:
        """A data URL's payload, or an allowed remote URL's download."""
        if not url.startswith(("http://", "https://")):
            return _data_url(url, index)
        from poolrunner.core.inputs.media_fetch import fetch

        return fetch(url, self.limits, f"input {index}")

    def _check_size(self, image: Any, index: int) -> None:
        width, height = image.size
        if width < 1 or height < 1:
            raise InvalidRequestError(f"input {index}: the image is {width}x{height} pixels; it has no pixels")
        if width * height > self.max_pixels:
            raise InvalidRequestError(f"input {index}: the image is {width}x{height} = {width * height} pixels, "
                                      f"more than the limit of {self.max_pixels} (decompression bomb refused)")

    @staticmethod
    def _rgb(image: Any, index: int) -> Any:
        """The first frame, decoded, in RGB; a transparent image laid over white first, as
        transformers' ``convert_to_rgb`` (every image processor's ``do_convert_rgb``) and vLLM
        convert it (dropping the alpha band would keep the colour of fully transparent pixels).

        :raises InvalidRequestError: for truncated or corrupt pixel data."""
        from PIL import Image

        try:
            image.seek(0)
            image.load()
            if image.mode == "RGB":
                return image
            if "A" in image.getbands() or image.info.get("transparency") is not None:
                white = Image.new("RGBA", image.size, (255, 255, 255, 255))
                return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
            return image.convert("RGB")
        except Exception as exc:  # OSError "image file is truncated", a decoder error
            raise InvalidRequestError(f"input {index}: the image data is truncated or corrupt "
                                      f"({' '.join(str(exc).split()) or type(exc).__name__})") from None


def load_image_processor(path: Path) -> Any:
    """The folder's own image processor (``AutoImageProcessor``, never downloaded, no folder code),
    its PIL backend.

    :raises ModelLoadError: when the folder has none transformers reads.
    """
    from transformers import AutoImageProcessor

    try:
        # The PIL backend, also where torchvision is installed (transformers then picks the
        # torchvision one): its resize is torch's antialiased bicubic, up to 2 levels of 255
        # away from PIL's on scikit-image's photographs, so the pixels would depend on what
        # else is installed. The slow (PIL) processor is the one every install has.
        return AutoImageProcessor.from_pretrained(path, local_files_only=True, trust_remote_code=False,
                                                  backend="pil")
    except Exception as exc:  # OSError, ValueError: no preprocessor_config.json, a class of its own code
        raise ModelLoadError(f"cannot load the image processor of {path}: {' '.join(str(exc).split())}") from exc


def _data_url(url: str, index: int) -> bytes:
    """The payload of a ``data:image/...;base64,`` URL.

    :raises InvalidRequestError: for another scheme or media type, or bad base64.
    """
    head, comma, payload = url.partition(",")
    if not head.startswith(DATA_URL_PREFIX) or not head.endswith(";base64") or not comma:
        raise InvalidRequestError(f"input {index}: an image URL must be data:image/<type>;base64,<data>, "
                                  f"got {url[:40]!r}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"input {index}: the data URL's payload is not valid base64") from None
