"""Matryoshka ``dimensions`` mechanics on MiniLM (not Matryoshka-trained: mechanics only).

``dimensions=d`` must give ``normalize(full_unnormalized[:d])`` (slice first, then normalize);
the reference is transformers' masked mean of the last hidden state (MiniLM's pooling).
"""

from __future__ import annotations

import numpy as np
import pytest

import poolrunner
from poolrunner import InvalidRequestError, PoolingParams, PoolingRequest
from poolrunner.core.testing.steps import record_steps
from tests.helpers import MIN_COSINE, cosine_rows, normalized, run_requests


@pytest.fixture(scope="module")
def matryoshka_runtime():
    rt = poolrunner.Runtime(is_matryoshka=True, dtype="float32")
    assert rt.model_config.is_matryoshka and rt.model_config.matryoshka_dimensions is None
    return rt


@pytest.fixture(scope="module")
def listed_runtime():
    rt = poolrunner.Runtime(matryoshka_dimensions=[64, 128, 384], dtype="float32")
    assert rt.model_config.is_matryoshka
    assert rt.model_config.matryoshka_dimensions == (64, 128, 384)
    return rt


@pytest.fixture(scope="module")
def texts(lee_docs) -> list[str]:
    return [lee_docs[1], "A short one.", lee_docs[42], "Medium length text about the weather today."]


@pytest.fixture(scope="module")
def token_ids(hf_tokenizer, texts) -> list[list[int]]:
    return [list(row) for row in hf_tokenizer(texts)["input_ids"]]


@pytest.fixture(scope="module")
def full(hf_mean, token_ids) -> np.ndarray:
    """Unnormalized pooled vectors ``[n, 384]`` from transformers."""
    return hf_mean(token_ids)


def test_reference_is_sentence_transformers_before_normalize(full, st_model, texts):
    # The transformers mean reference agrees with sentence-transformers' full pipeline.
    assert cosine_rows(full, st_model.encode(texts)).min() >= MIN_COSINE


@pytest.mark.parametrize("d", [1, 32, 64, 200, 384])
def test_dimensions_slice_then_normalize(matryoshka_runtime, texts, full, d):
    vectors = matryoshka_runtime.embed(texts, dimensions=d)
    assert vectors.shape == (len(texts), d)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(vectors, normalized(full[:, :d]), atol=1e-4 if d > 1 else 1e-6)
    if d < 384:  # normalizing before slicing would give a norm below 1
        assert np.linalg.norm(normalized(full)[:, :d], axis=1).max() < 0.999


@pytest.mark.parametrize("d", [64, 384])
def test_dimensions_without_normalize_is_the_raw_slice(listed_runtime, texts, full, d):
    vectors = listed_runtime.embed(texts, dimensions=d, normalize=False)
    assert vectors.shape == (len(texts), d)
    np.testing.assert_allclose(vectors, full[:, :d], rtol=1e-4, atol=1e-5)


def test_listed_dimensions_normalized(listed_runtime, texts, full):
    for d in (64, 128, 384):
        vectors = listed_runtime.embed(texts, dimensions=d)
        assert cosine_rows(vectors, full[:, :d]).min() >= MIN_COSINE
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_one_step_mixes_dimensions_and_normalize(matryoshka_runtime, token_ids, full):
    settings = [(64, None), (None, None), (128, False), (64, True), (None, False), (384, None)]
    ids = [token_ids[i % len(token_ids)] for i in range(len(settings))]
    requests = [
        PoolingRequest(
            request_id=f"mix-{i}", prompt_token_ids=ids[i],
            params=PoolingParams(task="embed", dimensions=d, normalize=norm),
        )
        for i, (d, norm) in enumerate(settings)
    ]
    with record_steps(matryoshka_runtime) as log:
        results = run_requests(matryoshka_runtime, requests)
    steps = [step.request_ids for step in log.steps]
    assert len(steps) == 1 and sorted(steps[0]) == sorted(results)  # all in one step
    for i, (d, norm) in enumerate(settings):
        vector = results[f"mix-{i}"].numpy()
        reference = full[i % len(token_ids)][: d or 384]
        assert vector.shape == ((d or 384),)
        if norm is False:
            np.testing.assert_allclose(vector, reference, rtol=1e-4, atol=1e-5)
        else:
            np.testing.assert_allclose(vector, normalized(reference), atol=1e-4)
    assert not log.in_flight


# An empty call is refused too: the value is wrong whatever the inputs (sentence-transformers'
# encode([]) answers nothing to check).
SOME_INPUTS = pytest.mark.parametrize("texts", [["hello"], []], ids=["one text", "no texts"])


@SOME_INPUTS
def test_dimensions_on_a_non_matryoshka_model(runtime, assert_serves, texts):
    assert not runtime.model_config.is_matryoshka
    with pytest.raises(InvalidRequestError, match=r"does not support Matryoshka dimensions \(got dimensions=64\)"
                       r".*is_matryoshka=True"):
        runtime.embed(texts, dimensions=64)
    assert_serves(runtime)


@pytest.mark.parametrize("d", [0, -3])
def test_dimensions_not_positive(matryoshka_runtime, assert_serves, d):
    with pytest.raises(ValueError, match=rf"^dimensions must be a positive integer, got {d}$"):
        matryoshka_runtime.embed(["hello"], dimensions=d)
    assert_serves(matryoshka_runtime)


@SOME_INPUTS
def test_dimensions_above_the_embedding_size(matryoshka_runtime, assert_serves, texts):
    with pytest.raises(InvalidRequestError, match=r"dimensions=385 is out of range for model .*: 1\.\.384$"):
        matryoshka_runtime.embed(texts, dimensions=385)
    assert_serves(matryoshka_runtime)


@SOME_INPUTS
def test_dimensions_not_in_the_declared_list(listed_runtime, assert_serves, texts):
    with pytest.raises(InvalidRequestError,
                       match=r"dimensions=100 is not one of the Matryoshka dimensions of model .*: \[64, 128, 384\]"):
        listed_runtime.embed(texts, dimensions=100)
    assert_serves(listed_runtime)


def test_bad_dimensions_in_a_batch_rejects_the_batch_and_keeps_serving(matryoshka_runtime, token_ids,
                                                                       full, assert_serves):
    good = PoolingRequest(request_id="ok-0", prompt_token_ids=token_ids[0],
                          params=PoolingParams(task="embed", dimensions=64))
    bad = PoolingRequest(request_id="bad-1", prompt_token_ids=token_ids[1],
                         params=PoolingParams(task="embed", dimensions=999))
    with pytest.raises(InvalidRequestError, match="dimensions=999 is out of range"):
        run_requests(matryoshka_runtime, [good, bad])
    assert_serves(matryoshka_runtime)
    # The same id is free again and computes correctly.
    results = run_requests(matryoshka_runtime, [good])
    np.testing.assert_allclose(results["ok-0"].numpy(), normalized(full[0, :64]), atol=1e-4)
