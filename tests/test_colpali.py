"""ColPali and ColQwen2 (issue 28): page retrieval with one vector per token, MaxSim scores.

The reference is transformers' own ``ColPaliForRetrieval`` / ``ColQwen2ForRetrieval`` of the
same seeded tiny folder (:func:`~poolrunner.core.testing.tiny_models.tiny_colpali_folder`,
:func:`~poolrunner.core.testing.tiny_models.tiny_colqwen2_folder`), fp32, eval, each input alone
through the folder's own processor, as the families' model cards run them:
``model(**processor.process_images([page])).embeddings[0]`` and
``model(**processor.process_queries([query])).embeddings[0]``; scores are the processor's
``score_retrieval`` of those vectors. poolrunner's ``token_embed`` must give each vector (cosine
>= 0.9999 per vector, max abs <= 1e-4) for pages (scikit-image's real scans and photographs, of
several aspect ratios: ColQwen2 gives each its own number of image tokens) and queries mixed in
one step, and ``score`` / ``rerank`` must give ``score_retrieval``. Hostile images get one exact
:class:`InvalidRequestError` naming the input, and the runtime serves the next call.

Every parity test prints its measured deviation (``pytest -s``).
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from tests.helpers import assert_parity

ATOL = 1e-4
QUERIES = ["w1 w2 w3", "w5 w190 w7 w8 w9 w10 w11", "w4"]
PHOTOS = ("page", "text", "astronaut", "chelsea", "rocket")
FAMILIES = {"colpali": "ColPaliForRetrieval", "colqwen2": "ColQwen2ForRetrieval"}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: hidden-32 models gain nothing from more on busy shared cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def folder(family, tmp_path_factory):
    from poolrunner.core.testing import tiny_models

    return getattr(tiny_models, f"tiny_{family}_folder")(tmp_path_factory.mktemp(family))


@pytest.fixture(scope="module")
def runtime(folder):
    from poolrunner import Runtime

    return Runtime(str(folder), dtype="float32", load_entrypoints=False)


@pytest.fixture(scope="module")
def reference(family, folder):
    import transformers

    model = getattr(transformers, FAMILIES[family]).from_pretrained(folder).eval()
    return model, transformers.AutoProcessor.from_pretrained(folder)


@pytest.fixture(scope="module")
def photos():
    """scikit-image's bundled scans and photographs (grayscale and RGB, several aspect ratios)."""
    import skimage.data
    from PIL import Image

    return [Image.fromarray(getattr(skimage.data, name)()) for name in PHOTOS]


@pytest.fixture(scope="module")
def page_vectors(reference, photos):
    """transformers' ``embeddings`` of each photo as a page."""
    return [embeddings(reference, photo) for photo in photos]


def embeddings(reference, item):
    """transformers' ``embeddings`` of one query (a text) or one page (an image), ``[T, d]``."""
    import torch

    model, processor = reference
    batch = processor.process_queries([item]) if isinstance(item, str) else processor.process_images([item])
    with torch.inference_mode():
        return model(**batch).embeddings[0]


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


def test_loads_as_page_retrieval(family, runtime):
    config = runtime.model_config
    assert (config.architecture, config.hidden_size, config.images_in_prompt) == (FAMILIES[family], 16, True)
    assert (runtime.task, runtime.frontend.tasks, config.image_positions) == ("token_embed", {"token_embed"}, None)


def test_prompts_and_pixels_are_the_processors(runtime, reference, photos):
    """Each page's prompt, pixels (and ColQwen2's grid) are ``process_images``' own; each query's
    prompt is ``process_queries``' (prefix and augmentation tokens)."""
    processor = reference[1]
    for index, photo in enumerate(photos):
        want = processor.process_images([photo])
        got = runtime.frontend.images.page(photo, index)
        assert list(got.prompt_token_ids) == want["input_ids"][0].tolist()
        grid = want.get("image_grid_thw")
        assert (got.image_kwargs is None) is (grid is None)
        if grid is not None:
            assert got.image_kwargs["image_grid_thw"].tolist() == grid.tolist()
        np.testing.assert_array_equal(got.pixel_values.numpy(), want["pixel_values"][0].numpy())
    for query in QUERIES:
        assert list(runtime.frontend.images.query(query).prompt_token_ids) == (
            processor.process_queries([query])["input_ids"][0].tolist())


def test_queries_and_pages_in_one_step_equal_embeddings(family, runtime, reference, photos, page_vectors):
    """One call of queries and pages: one step holds both, and every vector is the model's."""
    from poolrunner.core.testing.steps import record_steps

    inputs = [QUERIES[0], photos[0], photos[1], QUERIES[1], photos[2], QUERIES[2], photos[3], photos[4]]
    with record_steps(runtime) as log:
        got = runtime.encode(inputs, task="token_embed")
    assert len(log.steps) == 1 and len(log.steps[0].request_ids) == len(inputs)
    for index, (item, vectors) in enumerate(zip(inputs, got, strict=True)):
        want = embeddings(reference, item) if isinstance(item, str) else page_vectors[photos.index(item)]
        assert_parity(vectors, want.numpy(), f"{family}/input {index}")
    assert_parity(runtime.encode(QUERIES[1], task="token_embed")[0], embeddings(reference, QUERIES[1]).numpy(),
                 f"{family}/one-query")


def test_a_page_runs_whole_in_one_step(family, folder, runtime, photos):
    """Under a token budget smaller than a page, each page still runs whole, in a step alone."""
    from poolrunner import Runtime
    from poolrunner.core.testing.steps import record_steps

    inputs = [photos[2], QUERIES[0], photos[0]]
    want = runtime.encode(inputs)
    budgeted = Runtime(str(folder), dtype="float32", load_entrypoints=False, max_num_batched_tokens=8)
    with record_steps(budgeted) as log:
        got = budgeted.encode(inputs)
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_parity(a, b, f"{family}/budget8 input {index}")
    assert all(len(log.chunks(request)) == 1 for request in log.admitted)
    assert not log.in_flight


def test_score_and_rerank_equal_score_retrieval(family, runtime, reference, photos, page_vectors):
    """``score(query, pages)`` and ``rerank`` are the processor's ``score_retrieval`` of one
    query and one page (a batch of pages of other lengths would pad with zero vectors, which
    can raise a query token's maximum to 0: a score that depends on the other pages)."""
    processor = reference[1]
    vectors = embeddings(reference, QUERIES[1])
    want = np.array([processor.score_retrieval([vectors], [page])[0, 0].item() for page in page_vectors])
    got = runtime.score(QUERIES[1], photos)
    print(f"deviation {family}/score: max abs {np.abs(got - want).max():.2e}")
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    ranked = runtime.rerank(QUERIES[1], photos, top_n=3)
    assert [result.index for result in ranked] == list(np.argsort(-want, kind="stable")[:3])
    np.testing.assert_allclose([result.score for result in ranked], np.sort(want)[::-1][:3], atol=ATOL, rtol=0)
    pairs = runtime.score([QUERIES[1], QUERIES[1]], photos[:2])  # N:N
    np.testing.assert_allclose(pairs, want[:2], atol=ATOL, rtol=0)


def test_tokenization_options_are_refused(runtime):
    from poolrunner import InvalidRequestError

    with pytest.raises(InvalidRequestError) as info:
        runtime.encode(QUERIES[0], truncate_prompt_tokens=4)
    assert str(info.value) == (
        f"truncate_prompt_tokens: {runtime.model_config.architecture} prepares every input with its own processor "
        "(process_queries, process_images), which takes no tokenization options")


@pytest.mark.parametrize("case", ["truncated", "not-an-image", "bad-base64"])
def test_hostile_image_is_refused_naming_it(case, family, runtime, photos, page_vectors):
    from poolrunner import InvalidRequestError

    encoded = png(photos[3])
    item, message = {
        "truncated": (encoded[: len(encoded) // 2],
                      "input 1: the image data is truncated or corrupt (image file is truncated)"),
        "not-an-image": (b"%PDF-1.7 hello", "input 1 is not an image PIL can read (14 bytes: UnidentifiedImageError)"),
        "bad-base64": ("data:image/png;base64,!!!", "input 1: the data URL's payload is not valid base64"),
    }[case]
    with pytest.raises(InvalidRequestError) as info:
        runtime.encode([QUERIES[0], item, photos[3]])
    assert str(info.value) == message
    assert_parity(runtime.encode([photos[3]])[0], page_vectors[3].numpy(), f"{family}/after-{case}")


def test_http_pooling_score_and_rerank_equal_the_python_api(runtime, photos):
    """``/pooling`` (token vectors), ``/score`` and ``/rerank`` (MaxSim) with data URLs answer
    the Python API's results; a hostile page is a 400 naming it, and the next is answered."""
    import httpx

    from poolrunner.core.testing.server import ServerThread

    urls = [data_url(photo) for photo in photos[:3]]
    with ServerThread(runtime) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        answer = client.post("/pooling", json={"input": [QUERIES[0], urls[0]]})
        assert answer.status_code == 200, answer.text
        for item, want in zip(answer.json()["data"], runtime.encode([QUERIES[0], photos[0]]), strict=True):
            np.testing.assert_allclose(np.array(item["data"], dtype=np.float32), want, atol=1e-6)
        want = runtime.score(QUERIES[1], photos[:3])
        score = client.post("/score", json={"queries": QUERIES[1], "documents": urls})
        assert score.status_code == 200, score.text
        np.testing.assert_allclose([item["score"] for item in score.json()["data"]], want, atol=1e-5)
        rerank = client.post("/rerank", json={"query": QUERIES[1], "documents": urls})
        assert rerank.status_code == 200, rerank.text
        assert [item["index"] for item in rerank.json()["results"]] == list(np.argsort(-want, kind="stable"))
        refused = client.post("/rerank", json={"query": QUERIES[1], "documents": [urls[0], "data:image/png;base64,"
                                                                                  "iVBORw0KGgo="]})
        assert refused.status_code == 400 and "documents[1]" in refused.json()["error"]["message"], refused.text
        assert client.post("/rerank", json={"query": QUERIES[1], "documents": urls}).status_code == 200


def test_a_page_of_extreme_aspect_ratio(family, runtime, reference):
    """1 x 400 pixels: ColPali resizes it like any page (the model's vectors); Qwen2-VL's
    processor refuses it, and the refusal names the input."""
    from PIL import Image

    from poolrunner import InvalidRequestError

    page = Image.new("RGB", (1, 400), (200, 30, 30))
    if family == "colpali":
        assert_parity(runtime.encode(page)[0], embeddings(reference, page).numpy(), f"{family}/1x400")
        return
    with pytest.raises(InvalidRequestError) as info:
        runtime.encode([QUERIES[0], page])
    assert str(info.value) == ("input 1: the image processor refused the image: absolute aspect ratio must be "
                               "smaller than 200, got 400.0")
