"""Images over HTTP (issue 28): every client shape gives transformers' CLIP features, hostile
images are 4xx naming the input and the connection keeps serving, remote URLs are fetched only
from allowed hosts, and the limits hold.

Shapes: vLLM's ``messages`` with an ``image_url`` part (``/v1/embeddings``, ``/pooling``),
``input`` data URLs, infinity's ``modality: "image"`` (``/embeddings``), and Cohere's v2 embed
(``images``, ``inputs``) through Cohere's own SDK. The reference is transformers' ``CLIPModel`` of
the seeded tiny folder (``get_image_features`` / ``get_text_features``, normalized); remote
URLs come from a local HTTP server (no internet).
"""

from __future__ import annotations

import base64
import http.server
import io
import struct
import threading
import time
import zlib

import numpy as np
import pytest

from tests.helpers import assert_parity

TEXT = "w5 w900 w7 w8"
MAX_IMAGES = 4
MAX_BYTES = 1_500_000


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from poolrunner.core.testing.tiny_models import tiny_clip_folder

    return tiny_clip_folder(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="module")
def photos():
    import skimage.data
    from PIL import Image

    return [Image.fromarray(getattr(skimage.data, name)()) for name in ("astronaut", "chelsea", "coffee")]


@pytest.fixture(scope="module")
def reference(folder):
    import torch
    import transformers

    model = transformers.CLIPModel.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    processor = transformers.CLIPImageProcessor.from_pretrained(folder)

    def features(item) -> np.ndarray:
        with torch.inference_mode():
            if isinstance(item, str):
                out = model.get_text_features(**tokenizer(item, return_tensors="pt")).pooler_output
            else:
                out = model.get_image_features(**processor(images=item, return_tensors="pt")).pooler_output
        return torch.nn.functional.normalize(out, dim=-1)[0].numpy()

    return features


class _Files(http.server.BaseHTTPRequestHandler):
    """The local image host: ``files`` by path; ``/slow`` stalls; ``/endless`` streams without a
    length; ``/trickle`` sends a byte every 0.5 s (each read within the timeout, the whole body
    not); ``/redirect`` sends the client to another host."""

    files: dict[str, bytes] = {}
    requested: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.requested.append(self.path)
        if self.path == "/slow":
            time.sleep(3)
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_port}/chelsea.png")
            self.end_headers()
            return
        if self.path == "/trickle":
            self.send_response(200)
            self.end_headers()
            for _ in range(8):
                self.wfile.write(b"\0")
                self.wfile.flush()
                time.sleep(0.5)
            return
        if self.path == "/endless":
            self.send_response(200)
            self.end_headers()  # no Content-Length: the body runs until the connection closes
            for _ in range(40):
                self.wfile.write(b"\0" * 65536)
            return
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _Host(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # the client hangs up on /slow and /endless on purpose


@pytest.fixture(scope="module")
def image_host(photos):
    _Files.files = {"/chelsea.png": png(photos[1]), "/big.png": b"\x89PNG" + b"\0" * (MAX_BYTES + 10)}
    host = _Host(("127.0.0.1", 0), _Files)
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{host.server_port}"
    host.shutdown()
    host.server_close()


@pytest.fixture(scope="module")
def runtime(folder):
    from poolrunner import Runtime

    return Runtime(str(folder), dtype="float32", load_entrypoints=False, allowed_media_domains=["127.0.0.1"],
                   media_fetch_timeout=1.0, max_images_per_request=MAX_IMAGES, max_image_bytes=MAX_BYTES)


@pytest.fixture(scope="module")
def client(runtime):
    import httpx

    from poolrunner.core.server.settings import ServerSettings
    from poolrunner.core.testing.server import ServerThread

    with ServerThread(runtime, ServerSettings(served_model_name="clip", max_request_bytes=8_000_000)) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        yield http


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def jpeg(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def vectors(answer) -> np.ndarray:
    assert answer.status_code == 200, answer.text
    body = answer.json()
    return np.array([item.get("embedding", item.get("data")) for item in body["data"]], dtype=np.float32)


def chat(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


# ---- every shape gives CLIP's features ----


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
def test_vllm_messages_embed_one_image_or_one_text(client, reference, photos, path):
    """vLLM's chat form for CLIP: an image-only prompt is the image's features, a text-only one
    the text's (with CLIP's special tokens, as ``input`` would give)."""
    image = vectors(client.post(path, json={"messages": chat(image_part(data_url(png(photos[0]))))}))
    assert_parity(image, reference(photos[0]), f"messages-image{path}")
    text = vectors(client.post(path, json={"messages": chat({"type": "text", "text": TEXT})}))
    assert_parity(text, reference(TEXT), f"messages-text{path}")
    both = client.post(path, json={"messages": chat({"type": "text", "text": TEXT}, image_part(data_url(b"x")))})
    assert both.status_code == 400 and "embeds a text or an image, not both" in both.json()["error"]["message"]


def test_infinity_modality_image(client, reference, photos):
    """infinity's body: ``modality: "image"`` and data URLs as ``input``; base64 answers float32 bytes."""
    urls = [data_url(png(photos[0])), data_url(jpeg(photos[2]), "image/jpeg")]
    answer = client.post("/embeddings", json={"model": "clip", "input": urls, "modality": "image"})
    assert answer.json()["object"] == "list"
    from PIL import Image

    decoded_jpeg = Image.open(io.BytesIO(jpeg(photos[2])))  # lossy: the reference sees what the server decodes
    assert_parity(vectors(answer), np.stack([reference(photos[0]), reference(decoded_jpeg)]), "infinity")
    encoded = client.post("/embeddings", json={"input": urls[0], "modality": "image", "encoding_format": "base64"})
    got = np.frombuffer(base64.b64decode(encoded.json()["data"][0]["embedding"]), dtype=np.float32)
    assert_parity(got, reference(photos[0]), "infinity-base64")
    audio = client.post("/embeddings", json={"input": urls[0], "modality": "audio"})
    assert audio.status_code == 400 and "modality 'audio' is not served" in audio.json()["error"]["message"]


def test_cohere_v2_embed_with_cohere_sdk(client, reference, photos):
    """Cohere's own client: ``images``, ``inputs`` (text or image content), ``embedding_types``;
    int8 / binary are sentence-transformers' ``quantize_embeddings`` of the float vectors."""
    import cohere
    import httpx
    from sentence_transformers.util.quantization import quantize_embeddings

    with httpx.Client(timeout=60) as transport:
        sdk = cohere.ClientV2(api_key="unused", base_url=str(client.base_url), httpx_client=transport)
        _check_cohere(sdk, reference, photos, quantize_embeddings)


def _check_cohere(sdk, reference, photos, quantize_embeddings) -> None:
    urls = [data_url(png(photo)) for photo in photos[:2]]
    answer = sdk.embed(model="clip", input_type="image", images=urls, embedding_types=["float", "int8", "ubinary"])
    want = np.stack([reference(photo) for photo in photos[:2]])
    assert_parity(answer.embeddings.float_, want, "cohere-images")
    floats = np.array(answer.embeddings.float_, dtype=np.float32)
    np.testing.assert_array_equal(answer.embeddings.int8, quantize_embeddings(floats, precision="int8"))
    np.testing.assert_array_equal(answer.embeddings.ubinary, quantize_embeddings(floats, precision="ubinary"))
    assert answer.meta.billed_units.images == 2
    mixed = sdk.embed(model="clip", input_type="search_document", embedding_types=["float"], inputs=[
        {"content": [{"type": "text", "text": TEXT}]}, {"content": [image_part(urls[1])]}])
    assert_parity(mixed.embeddings.float_, np.stack([reference(TEXT), reference(photos[1])]), "cohere-inputs")


# ---- hostile images: a 4xx naming the input, then the connection serves ----


def _png_declaring(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16))
            + chunk(b"IEND", b""))


def hostile(photo) -> dict[str, tuple[str, str]]:
    """Each case: its data URL and a fragment of the message (after the input's name)."""
    good_png, good_jpeg = png(photo), jpeg(photo)
    return {
        "truncated-png": (data_url(good_png[: len(good_png) // 2]), "the image data is truncated or corrupt"),
        "truncated-jpeg": (data_url(good_jpeg[: len(good_jpeg) // 3], "image/jpeg"),
                           "the image data is truncated or corrupt"),
        "huge-dimensions": (data_url(_png_declaring(10_000, 5_000)), "10000x5000 = 50000000 pixels, more than the "
                                                                     "limit of 40000000"),
        "bomb": (data_url(_png_declaring(100_000, 100_000)), "declares more than 40000000 pixels (decompression "
                                                             "bomb refused)"),
        "wrong-mime": (data_url(good_png, "text/plain"), "an image URL must be data:image/<type>;base64,<data>"),
        "non-image": (data_url(b"%PDF-1.7 not an image"), "is not an image PIL can read"),
        "zero-size": (data_url(_png_declaring(0, 0)), "is not an image PIL can read"),
        "bad-base64": ("data:image/png;base64,iVBOR@@", "the data URL's payload is not valid base64"),
        "empty": ("data:image/png;base64,", "the image is empty (0 bytes)"),
        "over-the-byte-limit": (data_url(b"\x89PNG" + b"\0" * (MAX_BYTES + 1)), f"more than the limit of {MAX_BYTES}"),
    }


SHAPES = {
    # name: (path, body of a good and a hostile URL, how the error names the hostile one)
    "vllm-input": ("/v1/embeddings", lambda good, bad: {"input": [good, bad]}, "input 1"),
    "vllm-messages": ("/v1/embeddings", lambda good, bad: {"messages": chat(image_part(bad))}, "input 0"),
    "vllm-pooling-messages": ("/pooling", lambda good, bad: {"messages": chat(image_part(bad))}, "input 0"),
    "infinity": ("/embeddings", lambda good, bad: {"input": [good, bad], "modality": "image"}, "input 1"),
    "cohere-images": ("/v2/embed", lambda good, bad: {"input_type": "image", "images": [good, bad]}, "images[1]"),
    "cohere-inputs": ("/v2/embed", lambda good, bad: {"input_type": "image", "inputs": [
        {"content": [image_part(good)]}, {"content": [image_part(bad)]}]}, "inputs[1]"),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_hostile_images_are_400_naming_the_input(client, photos, shape):
    path, body, name = SHAPES[shape]
    good = data_url(png(photos[1]))
    for case, (bad, fragment) in hostile(photos[1]).items():
        if shape == "vllm-input" and case == "wrong-mime":  # a str that is not data:image/ is text in input
            fragment = "characters, more than the limit of"
        answer = client.post(path, json=body(good, bad))
        assert answer.status_code == 400, (case, answer.text)
        message = answer.json()["error"]["message"]
        assert message.startswith(name) and fragment in message, (case, message)
        after = client.post(path, json=body(good, good) if shape != "vllm-messages" else {
            "messages": chat(image_part(good))})
        assert after.status_code == 200, (case, after.text)


@pytest.mark.parametrize("mode", ["animated-gif", "cmyk-jpeg", "palette-png", "16-bit-png", "png-named-jpeg"])
def test_other_image_modes_give_their_rgb_first_frame(client, reference, mode):
    """A defined result: the first frame in RGB, as CLIP's processor converts it; a data URL whose
    image subtype is not its bytes' format is read by its bytes (as PIL and browsers read it)."""
    from PIL import Image

    rng = np.random.default_rng(1)
    rgb = Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    if mode == "animated-gif":
        rgb.save(buffer, format="GIF", save_all=True, append_images=[Image.new("RGB", (30, 40), "red")])
    elif mode == "cmyk-jpeg":
        rgb.convert("CMYK").save(buffer, format="JPEG")
    elif mode == "palette-png":
        rgb.convert("P").save(buffer, format="PNG")
    elif mode == "16-bit-png":
        Image.fromarray(rng.integers(0, 65536, (40, 30), dtype=np.uint16)).save(buffer, format="PNG")
    else:
        rgb.save(buffer, format="PNG")
    decoded = Image.open(io.BytesIO(buffer.getvalue()))
    decoded.seek(0)
    mime = "image/jpeg" if mode == "png-named-jpeg" else "image/png"
    got = vectors(client.post("/v1/embeddings", json={"input": [data_url(buffer.getvalue(), mime)]}))
    assert_parity(got, reference(decoded.convert("RGB")), mode)


# ---- remote URLs and limits ----


def test_allowed_host_is_fetched_others_never(client, reference, photos, image_host):
    url = f"{image_host}/chelsea.png"
    for path, body in [("/embeddings", {"input": [url], "modality": "image"}),
                       ("/v1/embeddings", {"messages": chat(image_part(url))}),
                       ("/v2/embed", {"input_type": "image", "images": [url]})]:
        answer = client.post(path, json=body)
        assert answer.status_code == 200, answer.text
        got = answer.json()["embeddings"]["float"] if path == "/v2/embed" else vectors(answer)
        assert_parity(got, reference(photos[1]), f"fetched{path}")
    port = image_host.rsplit(":", 1)[1]
    _Files.requested.clear()
    refused = {
        f"http://localhost:{port}/chelsea.png": "the image URL's host 'localhost' is not among the allowed media "
                                                "domains (127.0.0.1)",
        f"{image_host}/redirect": "the image URL's host 'localhost' is not among the allowed media domains",
        f"{image_host}/missing.png": "answered HTTP 404",
        f"{image_host}/slow": "took longer than the 1 s timeout",
        f"{image_host}/trickle": "took longer than the 1 s timeout",
        f"{image_host}/big.png": f"has {MAX_BYTES + 14} bytes, more than the limit of {MAX_BYTES}",
        f"{image_host}/endless": f"sent more than the limit of {MAX_BYTES} bytes",
    }
    for url, fragment in refused.items():
        answer = client.post("/embeddings", json={"input": [url], "modality": "image"})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["message"].startswith("input 0") and fragment in answer.text, answer.text
        assert client.post("/v1/embeddings", json={"input": TEXT}).status_code == 200
    assert "/chelsea.png" not in _Files.requested  # the host that is not allowed was never asked (localhost)


def test_remote_urls_are_refused_without_an_allow_list():
    from poolrunner import InvalidRequestError
    from poolrunner.core.inputs.images import ImageLimits
    from poolrunner.core.inputs.media_fetch import fetch

    with pytest.raises(InvalidRequestError) as info:
        fetch("http://127.0.0.1:9/cat.png", ImageLimits(), "input 3")
    assert str(info.value) == ("input 3: remote image URLs are refused ('http://127.0.0.1:9/cat.png'); poolrunner "
                               "downloads nothing unless the operator allows the host (--allowed-media-domains): "
                               "pass the image's bytes or a data: URL")


def test_images_per_request_limit_on_every_surface(client, runtime, photos):
    from poolrunner import InvalidRequestError

    message = f"the request has {MAX_IMAGES + 1} images, more than the limit of {MAX_IMAGES} per request " \
              "(max_images_per_request)"
    urls = [data_url(png(photos[0]))] * (MAX_IMAGES + 1)
    for path, body in [("/embeddings", {"input": urls, "modality": "image"}),
                       ("/v2/embed", {"input_type": "image", "images": urls})]:
        answer = client.post(path, json=body)
        assert answer.status_code == 400 and answer.json()["error"]["message"] == message, answer.text
    with pytest.raises(InvalidRequestError, match=r"more than the limit of 4 per request"):
        runtime.embed([photos[0]] * (MAX_IMAGES + 1))
    with pytest.raises(InvalidRequestError, match=r"more than the limit of 4 per request"):
        runtime.rerank(TEXT, [photos[0]] * MAX_IMAGES + [photos[1]])


# ---- rerank with images (Python API) ----


def test_rerank_orders_by_clips_own_similarity(folder, runtime, photos):
    """``rerank(text, images)`` and ``rerank(image, texts)`` in the order of CLIP's
    ``logits_per_text`` / ``logits_per_image`` (transformers), scores their cosines."""
    import torch
    import transformers

    model = transformers.CLIPModel.from_pretrained(folder).eval()
    processor = transformers.CLIPProcessor.from_pretrained(folder)
    texts = ["w1 w2 w3", TEXT, "w4", "w17 w17 w300"]
    with torch.inference_mode():
        out = model(**processor(text=texts, images=photos, return_tensors="pt", padding=True))
        scale = model.logit_scale.exp()
    for row, text in enumerate(texts[:2]):
        ranked = runtime.rerank(text, photos)
        want = (out.logits_per_text[row] / scale).numpy()
        assert [r.index for r in ranked] == list(np.argsort(-want, kind="stable"))
        np.testing.assert_allclose([r.score for r in ranked], np.sort(want)[::-1], atol=1e-4)
    ranked = runtime.rerank(photos[1], texts, top_n=2)
    want = (out.logits_per_image[1] / scale).numpy()
    assert [r.index for r in ranked] == list(np.argsort(-want, kind="stable"))[:2]


def test_image_settings_are_checked_naming_them():
    from poolrunner.core.config import RuntimeConfig

    cases = {
        "media_fetch_timeout": (0, "media_fetch_timeout must be a positive number of seconds, got 0"),
        "allowed_media_domains": (["https://a.example"], "allowed_media_domains holds host names "
                                                         "(images.example.com), got 'https://a.example'"),
        "max_images_per_request": (0, "max_images_per_request must be a positive integer, got 0"),
    }
    for name, (value, message) in cases.items():
        with pytest.raises(ValueError) as info:
            RuntimeConfig(**{name: value})
        assert str(info.value) == message
    assert RuntimeConfig(allowed_media_domains="Images.Example.com").image_limits().allowed_media_domains == (
        "images.example.com",)
