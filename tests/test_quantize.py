"""``precision`` int8 / uint8 / binary / ubinary against sentence-transformers'
``quantize_embeddings`` and ``SentenceTransformer.encode(precision=...)``."""

from __future__ import annotations

import numpy as np
import pytest
from sentence_transformers.util import quantize_embeddings

import poolrunner
from poolrunner import InvalidRequestError
from poolrunner.core.frontend.requests import EncodeRequest
from tests.test_cli import parse_jsonl, run_cli

TEXTS = ["A cat sat on the mat.", "Paris is the capital of France.", "The stock market fell sharply.",
         "A man is playing a guitar.", "Rain is expected tomorrow."]
PRECISIONS = ["int8", "uint8", "binary", "ubinary"]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_quantized_embeddings_equal_sentence_transformers(runtime, st_model, precision):
    floats = runtime.embed(TEXTS)
    got = runtime.embed(TEXTS, precision=precision)
    expected = quantize_embeddings(floats, precision=precision)  # the same floats: the codes must be identical
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
    # End to end against sentence-transformers' own vectors, which differ from these by float32
    # rounding (oneDNN and MKL sum in different orders): a code moves by one step at most, and
    # only for a float on a bucket edge.
    reference = st_model.encode(TEXTS, precision=precision)
    assert np.mean(got == reference) >= 0.98 and np.abs(got.astype(int) - reference.astype(int)).max() <= 1


@pytest.mark.parametrize("precision", ["int8", "uint8"])
def test_ranges_make_the_codes_independent_of_the_batch(runtime, precision):
    floats = runtime.embed(TEXTS)
    ranges = np.vstack([floats.min(axis=0), floats.max(axis=0)])
    alone = runtime.embed(TEXTS[0], precision=precision, ranges=ranges)
    np.testing.assert_array_equal(alone, quantize_embeddings(floats[:1], precision=precision, ranges=ranges)[0])
    np.testing.assert_array_equal(runtime.embed(TEXTS, precision=precision, ranges=ranges)[0], alone)


@pytest.fixture(scope="module")
def matryoshka_runtime():
    return poolrunner.Runtime(is_matryoshka=True, dtype="float32")


def test_dimensions_apply_before_quantizing(matryoshka_runtime):
    floats = matryoshka_runtime.embed(TEXTS, dimensions=64)
    packed = matryoshka_runtime.embed(TEXTS, dimensions=64, precision="ubinary")
    assert packed.shape == (5, 8)
    np.testing.assert_array_equal(packed, quantize_embeddings(floats, precision="ubinary"))


@pytest.mark.parametrize(("options", "message"), [
    ({"precision": "int4"}, "precision must be one of ['float32', 'int8', 'uint8', 'binary', 'ubinary'], got 'int4'"),
    ({"precision": "int8"}, "int8 needs ranges, or at least two embeddings in the call to calibrate them on; got 1"),
    ({"precision": "uint8", "ranges": np.zeros((2, 3))},
     "ranges must have shape [2, 384] (minima, maxima per dimension), got [2, 3]"),
    # sentence-transformers computes codes from such ranges anyway (NaN -> all one bucket): refused
    ({"precision": "int8", "ranges": [[float("nan")] * 384, [1.0] * 384]},
     "ranges[0][0] is nan: ranges must be finite numbers within float32's range (magnitude at most 3.403e+38)"),
    ({"precision": "uint8", "ranges": [[0.0] * 384, [1.0] * 383 + [float("-inf")]]},
     "ranges[1][383] is -inf: ranges must be finite numbers within float32's range (magnitude at most 3.403e+38)"),
    ({"precision": "int8", "ranges": [[-1e39] * 384, [1.0] * 384]},
     "ranges[0][0] is -1e+39: ranges must be finite numbers within float32's range (magnitude at most 3.403e+38)"),
    ({"precision": "int8", "ranges": [[0.0, 0.5, *[0.0] * 382], [1.0, 0.25, *[1.0] * 382]]},
     "ranges: dimension 1's minimum 0.5 is above its maximum 0.25"),
])
def test_bad_precision_options_are_refused(runtime, options, message):
    with pytest.raises(InvalidRequestError) as caught:
        runtime.embed([TEXTS[0]], **options)
    assert str(caught.value) == message
    assert runtime.embed(TEXTS[:2], precision="int8").dtype == np.int8  # still serves


def test_ranges_of_another_width_are_refused_by_the_plan_before_any_work(matryoshka_runtime):
    """The width is the request's ``dimensions`` (else the model's): checked when the plan is made."""
    request = EncodeRequest.of(inputs=TEXTS, dimensions=64, precision="int8", ranges=np.zeros((2, 384)))
    with pytest.raises(InvalidRequestError) as caught:
        matryoshka_runtime.frontend.plan(request)
    assert str(caught.value) == "ranges must have shape [2, 64] (minima, maxima per dimension), got [2, 384]"
    assert caught.value.param == "ranges"
    ranges = np.stack([-np.ones(64), np.ones(64)])
    codes = matryoshka_runtime.embed(TEXTS, dimensions=64, precision="int8", ranges=ranges)
    floats = matryoshka_runtime.embed(TEXTS, dimensions=64)
    np.testing.assert_array_equal(codes, quantize_embeddings(floats, precision="int8", ranges=ranges))


def test_empty_input_keeps_the_precision_shape(runtime):
    assert runtime.embed([], precision="binary").shape == (0, 48)
    assert runtime.embed([], precision="int8").dtype == np.int8


def test_the_command_line_keeps_the_dtype(capsys, tmp_path, runtime):
    floats = runtime.embed(TEXTS)
    out = tmp_path / "codes.npy"
    code, _, err = run_cli(capsys, "embed", "--precision", "ubinary", "--output", str(out), *TEXTS)
    assert code == 0, err
    np.testing.assert_array_equal(np.load(out), quantize_embeddings(floats, precision="ubinary"))
    code, printed, err = run_cli(capsys, "embed", "--precision", "int8", *TEXTS)
    assert code == 0, err
    np.testing.assert_array_equal(parse_jsonl(printed), quantize_embeddings(floats, precision="int8"))
