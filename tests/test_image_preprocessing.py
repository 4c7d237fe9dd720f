"""Image preprocessing on the model's threads (``ImageInputs.pixels_of``) gives the folder's own
processor's pixels, exactly, on every real photograph scikit-image ships.

The reference is transformers' ``CLIPImageProcessorPil`` loaded from the same folder, each image
alone, decoded by PIL and converted to RGB: here with openai/clip-vit-base-patch32's own
``preprocessor_config.json`` values (shortest edge 224, bicubic, centre crop 224, CLIP's mean and
std), so the resize that costs the time is the real one. Every comparison is bit-exact
(``assert_array_equal``), not within a tolerance.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

# openai/clip-vit-base-patch32's preprocessor_config.json
OPENAI_CLIP = {"size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224}, "resample": 3,
               "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder holding only CLIP ViT-B/32's image processor (what ``ImageInputs.load`` reads)."""
    from transformers import CLIPImageProcessorPil

    path = tmp_path_factory.mktemp("clip-processor")
    CLIPImageProcessorPil(**OPENAI_CLIP).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def inputs(folder):
    from transformers import CLIPVisionConfig

    from poolrunner.core.inputs.images import ImageInputs

    return ImageInputs.load(folder, CLIPVisionConfig(image_size=224, num_channels=3))


@pytest.fixture(scope="module")
def photos() -> list[Path]:
    """scikit-image's PNG and JPEG photographs and scans: RGB, grayscale and RGBA, 102 to 1411
    pixels a side."""
    import skimage

    data = Path(skimage.__file__).parent / "data"
    files = sorted(path for path in data.iterdir() if path.suffix in (".png", ".jpg"))
    assert len(files) >= 20
    return files


@pytest.fixture(scope="module")
def want(folder, photos) -> list[np.ndarray]:
    from PIL import Image
    from transformers import CLIPImageProcessorPil

    processor = CLIPImageProcessorPil.from_pretrained(folder)
    return [processor(images=Image.open(path).convert("RGB"), return_tensors="np")["pixel_values"][0]
            for path in photos]


def test_the_processor_is_the_pil_backend(inputs):
    """Not the torchvision backend transformers would pick where torchvision is installed."""
    assert type(inputs.processor).__name__ == "CLIPImageProcessorPil"


def test_pixels_of_every_photo_equal_the_processor(inputs, photos, want):
    got = inputs.pixels_of({i: path for i, path in enumerate(photos)})
    assert list(got) == list(range(len(photos)))
    for i, expected in enumerate(want):
        assert got[i].dtype.is_floating_point and tuple(got[i].shape) == (3, 224, 224)
        np.testing.assert_array_equal(got[i].numpy(), expected, err_msg=photos[i].name)


def test_pixels_of_bytes_and_concurrent_requests_equal_the_processor(inputs, photos, want):
    """Four requests at once (as the server's worker threads plan them) share the pool."""
    results: dict[int, dict] = {}

    def request(number: int) -> None:
        chosen = range(number, len(photos), 4)
        results[number] = inputs.pixels_of({i: photos[i].read_bytes() for i in chosen})

    threads = [threading.Thread(target=request, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(i for got in results.values() for i in got) == list(range(len(photos)))
    for got in results.values():
        for i, pixels in got.items():
            np.testing.assert_array_equal(pixels.numpy(), want[i], err_msg=photos[i].name)


def test_the_lowest_failing_image_is_named_and_the_next_call_served(inputs, photos, want):
    from poolrunner import InvalidRequestError

    items = {0: photos[0], 1: b"%PDF-1.7 hello", 2: photos[1], 3: b""}
    with pytest.raises(InvalidRequestError) as info:
        inputs.pixels_of(items)
    assert str(info.value) == "input 1 is not an image PIL can read (14 bytes: UnidentifiedImageError)"
    np.testing.assert_array_equal(inputs.pixels_of({0: photos[0]})[0].numpy(), want[0])


def test_torch_antialiased_bicubic_is_not_pil_bicubic(photos):
    """Why the PIL backend is pinned: the torchvision backend resizes tensors with torch's
    antialiased bicubic, which differs from PIL's bicubic by whole levels on these photos, far
    beyond 1e-6 after normalization (a level is 1 / 255 / std, about 0.015)."""
    import torch
    from PIL import Image

    worst = 0
    for path in photos[:8]:
        image = Image.open(path).convert("RGB")
        width, height = image.size
        size = (224, round(height * 224 / width)) if width < height else (round(width * 224 / height), 224)
        pil = np.asarray(image.resize(size, Image.BICUBIC, reducing_gap=None)).astype(int)
        tensor = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None]
        resized = torch.nn.functional.interpolate(tensor, size=(size[1], size[0]), mode="bicubic", antialias=True)
        worst = max(worst, int(np.abs(resized[0].permute(1, 2, 0).numpy().astype(int) - pil).max()))
    print(f"torch antialiased bicubic vs PIL bicubic: up to {worst} levels")
    assert worst >= 1


def test_a_pickled_copy_starts_its_own_pool(inputs, photos, want):
    """A runtime shipped to another process (Ray) pickles its image inputs without the pool."""
    import pickle

    inputs.pixels_of({0: photos[0]})  # the pool exists
    copy = pickle.loads(pickle.dumps(inputs))
    np.testing.assert_array_equal(copy.pixels_of({2: photos[2]})[2].numpy(), want[2])
