"""CLIP (issue 28): texts and images embedded through the family's own towers.

The reference is transformers' ``CLIPModel`` of the same seeded tiny folder
(:func:`~poolrunner.core.testing.tiny_models.tiny_clip_folder`), fp32, eval, each input alone:
``get_text_features`` of the tokenized text and ``get_image_features`` of the folder's own
``CLIPImageProcessor`` output, L2-normalized (CLIP's ``text_embeds`` / ``image_embeds``).
poolrunner must give it (cosine >= 0.9999, max abs <= 1e-4) for texts, for images of every kind
of input (PIL, bytes, path, data URL), mixed in one call and batched in any step layout. The
images are real photographs and scans shipped by scikit-image. Hostile images get one exact
:class:`InvalidRequestError` naming the input, and the runtime serves the next call.

Every parity test prints its measured deviation (``pytest -s``).
"""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest

from tests.helpers import assert_parity, image_features

ATOL = 1e-4
TEXTS = ["w1 w2 w3", "w5 w900 w7 w8 w9 w10 w11 w12 w13", "w4", "w17 w17 w17 w300"]
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "page", "text")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from poolrunner.core.testing.tiny_models import tiny_clip_folder

    return tiny_clip_folder(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="module")
def runtime(folder):
    from poolrunner import Runtime

    return Runtime(str(folder), dtype="float32", load_entrypoints=False)


@pytest.fixture(scope="module")
def reference(folder):
    import transformers

    model = transformers.CLIPModel.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    processor = transformers.CLIPImageProcessor.from_pretrained(folder)
    return model, tokenizer, processor


@pytest.fixture(scope="module")
def photos():
    """scikit-image's bundled photographs and scans (RGB and grayscale) as PIL images."""
    import skimage.data
    from PIL import Image

    return [Image.fromarray(getattr(skimage.data, name)()) for name in PHOTOS]


def text_features(reference, text: str) -> np.ndarray:
    import torch

    model, tokenizer, _ = reference
    with torch.inference_mode():
        features = model.get_text_features(**tokenizer(text, return_tensors="pt")).pooler_output
    return torch.nn.functional.normalize(features, dim=-1)[0].numpy()


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_loads_as_clip(runtime):
    config = runtime.model_config
    assert (config.architecture, config.hidden_size, config.embedding_size) == ("CLIPModel", 16, 16)
    assert config.image_positions == 17  # (32 / 8) ** 2 patches + the class position
    assert (config.max_model_len, runtime.task, runtime.frontend.tasks) == (77, "embed", frozenset({"embed"}))


def test_texts_equal_get_text_features(runtime, reference):
    assert_parity(runtime.embed(TEXTS), np.stack([text_features(reference, t) for t in TEXTS]), "clip/texts")
    assert_parity(runtime.embed(TEXTS[1]), text_features(reference, TEXTS[1]), "clip/one-text")


def test_photos_equal_get_image_features(runtime, reference, photos):
    want = np.stack([image_features(reference, photo) for photo in photos])
    assert_parity(runtime.embed(photos), want, "clip/photos")
    assert_parity(runtime.embed(photos[0]), want[0], "clip/one-photo")


def test_pixel_values_equal_the_processor(runtime, reference, photos):
    """The pixels poolrunner gives the vision tower are the folder's processor's, exactly."""
    processor = reference[2]
    for index, photo in enumerate(photos):
        want = processor(images=photo, return_tensors="pt")["pixel_values"][0].numpy()
        np.testing.assert_array_equal(runtime.frontend.images.pixels(photo, index).numpy(), want)


def test_every_kind_of_image_input(runtime, reference, photos, tmp_path):
    from poolrunner.core import ImageURL

    photo = photos[1]
    encoded = png(photo)
    (tmp_path / "chelsea.png").write_bytes(encoded)
    url = "data:image/png;base64," + base64.b64encode(encoded).decode()
    inputs = [photo, encoded, bytearray(encoded), tmp_path / "chelsea.png", url, ImageURL(url)]
    assert_parity(runtime.embed(inputs), np.stack([image_features(reference, photo)] * len(inputs)), "clip/kinds")


def test_texts_and_images_mixed_in_one_call(runtime, reference, photos):
    inputs = [TEXTS[0], photos[0], photos[4], TEXTS[1], TEXTS[2], photos[2]]
    want = np.stack([text_features(reference, item) if isinstance(item, str) else image_features(reference, item)
                     for item in inputs])
    assert_parity(runtime.embed(inputs), want, "clip/mixed")


def test_step_layouts_do_not_change_results(folder, runtime, photos):
    """Budgets that put each image alone, or images and texts together, in a step."""
    from poolrunner import Runtime
    from poolrunner.core.testing.steps import record_steps

    inputs = [photos[0], TEXTS[0], photos[1], TEXTS[1], photos[2]]
    want = runtime.embed(inputs)
    for budget in (17, 40):
        budgeted = Runtime(str(folder), dtype="float32", load_entrypoints=False, max_num_batched_tokens=budget)
        with record_steps(budgeted) as log:
            got = budgeted.embed(inputs)
        assert_parity(got, want, f"clip/budget{budget}")
        assert max(sum(step.num_scheduled_tokens) for step in log.steps) <= budget  # an image counts 17
        assert not log.in_flight


def test_score_is_the_cosine_of_clip_features(runtime, reference, photos):
    """``score(text, images)``: the cosine of the normalized features, i.e. CLIP's
    ``logits_per_text`` divided by ``logit_scale.exp()`` (same order, no scale applied)."""
    import torch

    model, tokenizer, processor = reference
    scores = runtime.score(TEXTS[0], photos[:3])
    with torch.inference_mode():
        logits = model(**tokenizer([TEXTS[0]], return_tensors="pt"),
                       pixel_values=processor(images=photos[:3], return_tensors="pt")["pixel_values"]).logits_per_text
        want = (logits / model.logit_scale.exp())[0].numpy()
    np.testing.assert_allclose(scores, want, atol=ATOL)
    assert scores.shape == (3,) and scores.dtype == np.float32
    reverse = runtime.score([photos[0], photos[1]], [TEXTS[0], TEXTS[1]])  # N:N, images as queries
    np.testing.assert_allclose(reverse, [runtime.score(TEXTS[0], [photos[0]])[0],
                                         runtime.score(TEXTS[1], [photos[1]])[0]], atol=1e-6)


def test_other_modes_give_their_image_result(runtime, reference):
    """Palette, CMYK, 16-bit, transparent and animated images: converted to RGB (first frame) as
    CLIP's processor converts them, a transparent one laid over white."""
    from PIL import Image

    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8))
    frames = [rgb, Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8))]
    animated = io.BytesIO()
    frames[0].save(animated, format="GIF", save_all=True, append_images=frames[1:])
    half = rgb.convert("RGBA")
    half.putalpha(Image.fromarray(rng.integers(0, 256, (40, 30), dtype=np.uint8)))
    see_through = rgb.convert("P")
    see_through.info["transparency"] = 0  # palette entry 0 is transparent
    cases = {"palette": rgb.convert("P"), "cmyk": rgb.convert("CMYK"), "opaque rgba": rgb.convert("RGBA"),
             "rgba": half, "grey and alpha": half.convert("LA"), "palette with transparency": see_through,
             "16-bit": Image.fromarray(rng.integers(0, 65536, (40, 30), dtype=np.uint16)),
             "animated": Image.open(io.BytesIO(animated.getvalue()))}
    for name, image in cases.items():
        image.seek(0)
        want = image_features(reference, image)  # the processor converts it itself
        assert_parity(runtime.embed(image), want, f"clip/{name}")
    assert not np.allclose(runtime.embed(half), image_features(reference, half.convert("RGB")), atol=1e-3)


def _huge_png(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` and whose data is a few bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + data


def hostile_inputs(photo) -> dict[str, tuple[object, str]]:
    from PIL import Image

    encoded = png(photo)
    return {
        "truncated": (encoded[: len(encoded) // 2],
                      "input 1: the image data is truncated or corrupt (image file is truncated)"),
        "not-an-image": (b"%PDF-1.7 hello", "input 1 is not an image PIL can read (14 bytes: UnidentifiedImageError)"),
        "empty-bytes": (b"", "input 1: the image is empty (0 bytes)"),
        "zero-size": (Image.new("RGB", (0, 0)), "input 1: the image is 0x0 pixels; it has no pixels"),
        "over-the-limit": (_huge_png(10_000, 5_000), "input 1: the image is 10000x5000 = 50000000 pixels, more than "
                                                      "the limit of 40000000 (decompression bomb refused)"),
        "bomb": (_huge_png(100_000, 100_000), "input 1: the image declares more than 40000000 pixels "
                                              "(decompression bomb refused)"),
        "bad-base64": ("data:image/png;base64,!!!", "input 1: the data URL's payload is not valid base64"),
        "header-only-gif": (b"GIF89a\x01\x00\x01\x00",
                            "input 1 is not an image PIL can read (10 bytes: UnidentifiedImageError)"),
    }


@pytest.mark.parametrize("case", ["truncated", "not-an-image", "empty-bytes", "zero-size", "over-the-limit", "bomb",
                                  "bad-base64", "header-only-gif"])
def test_hostile_image_is_refused_naming_it(case, runtime, reference, photos):
    from poolrunner import InvalidRequestError

    item, message = hostile_inputs(photos[1])[case]
    with pytest.raises(InvalidRequestError) as info:
        runtime.embed([TEXTS[0], item, photos[1]])
    assert str(info.value) == message
    assert_parity(runtime.embed([photos[1]]), image_features(reference, photos[1])[None], f"clip/after-{case}")


def test_remote_urls_are_refused_and_never_fetched(runtime):
    from poolrunner import InvalidRequestError
    from poolrunner.core import ImageURL

    with pytest.raises(InvalidRequestError) as info:
        runtime.embed(["w1", ImageURL("https://example.com/cat.png")])
    assert str(info.value) == ("input 1: remote image URLs are refused ('https://example.com/cat.png'); poolrunner "
                               "downloads nothing unless the operator allows the host (--allowed-media-domains): "
                               "pass the image's bytes or a data: URL")
    # A plain string is text, whatever it spells.
    assert runtime.embed("https://example.com/cat.png").shape == (16,)


def test_missing_image_file_is_named(runtime, tmp_path):
    from poolrunner import InvalidRequestError

    with pytest.raises(InvalidRequestError) as info:
        runtime.embed([tmp_path / "absent.png"])
    assert str(info.value) == f"input 0: cannot read image file {tmp_path / 'absent.png'}: No such file or directory"


def test_text_models_refuse_images(photos):
    """A text-only model names the image input; its data: URL strings stay text."""
    from poolrunner import InvalidRequestError, Runtime

    runtime = Runtime(dtype="float32", load_entrypoints=False)  # all-MiniLM-L6-v2
    with pytest.raises(InvalidRequestError) as info:
        runtime.embed(["a cat", photos[0]])
    assert str(info.value) == ("input 1 is an image, but BertModel has no vision tower (images are served for "
                               "CLIPModel, SiglipModel, Siglip2Model, ColPaliForRetrieval, ColQwen2ForRetrieval)")
    assert runtime.embed("data:image/png;base64,AAAA").shape == (384,)


def test_other_composite_configs_are_refused_naming_what_is_served(tmp_path):
    import transformers

    from poolrunner import ModelLoadError, Runtime

    config = transformers.BlipConfig(architectures=["BlipModel"])
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        Runtime(str(tmp_path), load_entrypoints=False)
    assert str(info.value) == (
        f"{tmp_path}: BlipModel (model_type 'blip') is a composite model whose config holds text_config, "
        "vision_config; of the composite families poolrunner serves only CLIPModel ('clip'), SiglipModel ('siglip'), "
        "Siglip2Model ('siglip2'), ColPaliForRetrieval ('colpali'), ColQwen2ForRetrieval ('colqwen2'); other "
        "multimodal models (vision-language, audio, other heads of these families) are refused until it implements "
        "them")


def test_data_urls_over_http_equal_the_python_api(runtime, photos):
    """``/v1/embeddings`` ``input`` strings that are data URLs are images for a CLIP server (the
    existing body -> request path); a hostile one is a 400 naming it, and the next is answered."""
    import httpx

    from poolrunner.core.testing.server import ServerThread

    url = "data:image/png;base64," + base64.b64encode(png(photos[0])).decode()
    with ServerThread(runtime) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        answer = client.post("/v1/embeddings", json={"input": [TEXTS[0], url]})
        assert answer.status_code == 200, answer.text
        got = np.array([item["embedding"] for item in answer.json()["data"]], dtype=np.float32)
        assert_parity(got, runtime.embed([TEXTS[0], photos[0]]), "clip/http")
        refused = client.post("/v1/embeddings", json={"input": ["w1", "data:image/png;base64,iVBORw0KGgo="]})
        assert refused.status_code == 400 and "input 1" in refused.json()["error"]["message"], refused.text
        assert client.post("/v1/embeddings", json={"input": url}).status_code == 200
