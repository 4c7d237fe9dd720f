"""Long ``embed`` inputs in windows (``max_embed_len``, vLLM's chunked processing).

The expected vectors are built here from transformers' hidden states over each window, by the
rule poolrunner documents (:mod:`poolrunner.core.frontend.chunking`): windows are consecutive slices of
``max_model_len`` tokens of the tokenized input (special tokens only where the tokenizer put
them), each window is MEAN-pooled and normalized (when on), the window vectors are averaged
weighted by their token counts, then sliced to ``dimensions`` and normalized (when on).
"""

from __future__ import annotations

import json

import attrs
import httpx
import numpy as np
import pytest
import torch

from poolrunner import Runtime
from poolrunner.core.config import SPEED_ONLY, RuntimeConfig
from poolrunner.core.errors import InvalidRequestError, ModelLoadError, PromptTooLongError
from poolrunner.core.frontend.chunking import WindowedRequest
from tests.helpers import MIN_COSINE, cosine_rows, normalized

MAX_MODEL_LEN = 256  # all-MiniLM-L6-v2
MAX_EMBED_LEN = 1000


@pytest.fixture(scope="module")
def long_runtime() -> Runtime:
    """The default model with windows up to 1000 tokens; Matryoshka allowed for the slice tests."""
    return Runtime(dtype="float32", max_embed_len=MAX_EMBED_LEN, is_matryoshka=True, load_entrypoints=False)


@pytest.fixture(scope="module")
def model_name(long_runtime) -> str:
    return long_runtime.model_config.name


def windows(ids: list[int], size: int = MAX_MODEL_LEN) -> list[list[int]]:
    return [ids[start:start + size] for start in range(0, len(ids), size)]


@pytest.fixture(scope="module")
def reference(hf_tokenizer, hf_mean):
    """``reference(text or ids, normalize=True, dimensions=None)``: the documented combination
    over transformers' per-window MEAN vectors, float64."""

    def combine(item: str | list[int], *, normalize: bool = True, dimensions: int | None = None) -> np.ndarray:
        ids = hf_tokenizer(item)["input_ids"] if isinstance(item, str) else list(item)
        parts = windows(ids)
        means = np.stack([hf_mean([part])[0] for part in parts])
        if normalize:
            means = normalized(means)
        counts = np.array([len(part) for part in parts], dtype=np.float64)
        vector = (means * counts[:, None]).sum(0) / counts.sum()
        if dimensions is not None:
            vector = vector[:dimensions]
        return normalized(vector) if normalize else vector

    return combine


def assert_matches(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape
    assert cosine_rows(actual, expected).min() >= MIN_COSINE
    np.testing.assert_allclose(actual, expected, atol=2e-5, rtol=1e-4)


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("num_tokens", [257, 512, 600, MAX_EMBED_LEN])
def test_long_text_is_the_weighted_mean_of_its_windows(long_runtime, reference, text_with_tokens, num_tokens):
    text = text_with_tokens(num_tokens, seed=num_tokens)
    vector = long_runtime.embed(text)
    assert_matches(vector, reference(text))
    assert abs(np.linalg.norm(vector) - 1) < 1e-5


def test_unnormalized_is_the_mean_over_every_token(long_runtime, reference, text_with_tokens, hf_tokenizer, hf_hidden):
    text = text_with_tokens(700, seed=7)
    vector = long_runtime.embed(text, normalize=False)
    assert_matches(vector, reference(text, normalize=False))
    # Without normalization the token-weighted mean of window means is the mean of all token
    # states of the windowed run: vLLM's aggregation exactly.
    states = torch.cat([hf_hidden([part])[0][0] for part in windows(hf_tokenizer(text)["input_ids"])])
    np.testing.assert_allclose(vector, states.double().mean(0).numpy(), atol=2e-5, rtol=1e-4)


def test_dimensions_slice_after_combining(long_runtime, reference, text_with_tokens):
    text = text_with_tokens(600, seed=3)
    sliced = long_runtime.embed(text, dimensions=128)
    assert_matches(sliced, reference(text, dimensions=128))
    assert abs(np.linalg.norm(sliced) - 1) < 1e-5
    # poolrunner's Matryoshka rule holds for windowed inputs too: normalize(full[:d]).
    full = long_runtime.embed(text)
    np.testing.assert_allclose(sliced, normalized(full[:128]), atol=1e-6)
    unnormalized = long_runtime.embed(text, dimensions=128, normalize=False)
    assert_matches(unnormalized, reference(text, normalize=False, dimensions=128))


def test_token_ids_are_windowed_like_text(long_runtime, hf_tokenizer, text_with_tokens):
    text = text_with_tokens(520, seed=11)
    ids = hf_tokenizer(text)["input_ids"]
    np.testing.assert_array_equal(long_runtime.embed(ids), long_runtime.embed(text))


def test_a_batch_mixes_long_and_short_inputs_in_order(long_runtime, runtime, reference, text_with_tokens):
    texts = [text_with_tokens(600, seed=1), "A cat sat on the mat.", text_with_tokens(300, seed=2),
             text_with_tokens(MAX_MODEL_LEN, seed=4)]
    vectors = long_runtime.embed(texts)
    for index in (0, 2):
        assert_matches(vectors[index], reference(texts[index]))
    # Inputs within max_model_len are today's requests: bit-identical to a runtime without
    # max_embed_len, alone or next to windowed inputs.
    np.testing.assert_array_equal(vectors[[1, 3]], runtime.embed([texts[1], texts[3]]))
    np.testing.assert_array_equal(long_runtime.embed(texts[1:2]), runtime.embed(texts[1:2]))
    # encode (the Ray jobs' call) and serving(): the same path.
    encoded = long_runtime.encode(texts, task="embed")
    np.testing.assert_array_equal(np.stack(encoded), vectors)
    with long_runtime.serving():
        np.testing.assert_allclose(long_runtime.embed(texts), vectors, atol=2e-6)


def test_short_requests_are_plain_and_long_ones_windowed(long_runtime, text_with_tokens):
    params = long_runtime.frontend.params("embed")
    short, at_limit, long = long_runtime.frontend.prepare(
        ["A cat sat.", text_with_tokens(MAX_MODEL_LEN), text_with_tokens(600)], params)
    assert type(short) is type(at_limit) is not WindowedRequest
    assert isinstance(long, WindowedRequest) and long.num_tokens == 600
    assert [part.num_tokens for part in long.windows()] == [256, 256, 88]
    ids = long.prompt_token_ids
    assert [part.prompt_token_ids for part in long.windows()] == [ids[:256], ids[256:512], ids[512:]]


def test_truncation_wins_over_windows(long_runtime, runtime, text_with_tokens):
    text = text_with_tokens(600, seed=5)
    np.testing.assert_array_equal(long_runtime.embed(text, truncate_prompt_tokens=-1),
                                  runtime.embed(text, truncate_prompt_tokens=-1))


def test_bi_encoder_scores_long_documents(long_runtime, text_with_tokens):
    query, document = "a cat", text_with_tokens(600, seed=6)
    expected = float(long_runtime.embed(query) @ long_runtime.embed(document))
    assert abs(float(long_runtime.score(query, document)) - expected) < 1e-5


# --------------------------------------------------------------------------- limits and refusals


def test_over_max_embed_len_is_refused_naming_both_limits(long_runtime, model_name, text_with_tokens, assert_serves):
    text = text_with_tokens(MAX_EMBED_LEN + 1, seed=8)
    with pytest.raises(PromptTooLongError) as caught:
        long_runtime.embed(["A cat sat.", text])
    assert str(caught.value) == (
        f"input 1 has 1001 tokens, more than max_embed_len=1000 (inputs over max_model_len=256 of {model_name} are "
        "embedded in windows of 256 tokens, up to max_embed_len); shorten it or pass truncate_prompt_tokens "
        "(-1 keeps the model maximum)"
    )
    assert_serves(long_runtime)


def test_without_max_embed_len_long_input_stays_an_error(runtime, text_with_tokens, assert_serves):
    with pytest.raises(PromptTooLongError, match="has 600 tokens, more than the maximum of 256"):
        runtime.embed(text_with_tokens(600))
    assert_serves(runtime)


def test_bad_dimensions_on_a_long_input_are_refused(model_path, text_with_tokens, assert_serves):
    plain = Runtime(dtype="float32", max_embed_len=MAX_EMBED_LEN, load_entrypoints=False)
    with pytest.raises(InvalidRequestError, match="does not support Matryoshka dimensions"):
        plain.embed(text_with_tokens(600), dimensions=64)
    assert_serves(plain)


@pytest.mark.parametrize("pooling_type", ["CLS", "LAST", "MAX", "WEIGHTEDMEAN"])
def test_other_pooling_types_are_refused_at_load(model_name, pooling_type):
    with pytest.raises(ModelLoadError) as caught:
        Runtime(max_embed_len=MAX_EMBED_LEN, pooling_type=pooling_type, load_entrypoints=False)
    assert str(caught.value) == (
        f"max_embed_len=1000 needs MEAN pooling, but model {model_name} pools {pooling_type} for embed: the windows "
        "of a long input are combined by a token-weighted mean, which suits MEAN pooling alone (a CLS or LAST "
        "vector lies in one window only); leave max_embed_len unset and truncate long inputs instead"
    )


def test_concatenated_modes_are_refused_at_load(make_minilm_folder):
    """sentence-transformers concatenates MAX before MEAN."""
    folder = make_minilm_folder("mean-max", modules=[("Transformer", ""), ("Pooling", "1_Pooling")],
                                pooling={"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True})
    with pytest.raises(ModelLoadError) as caught:
        Runtime(folder, max_embed_len=MAX_EMBED_LEN, load_entrypoints=False)
    assert str(caught.value).startswith(f"max_embed_len=1000 needs MEAN pooling, but model {folder} pools MAX+MEAN")


def test_a_last_pooling_decoder_is_refused_at_load(llama_folder):
    with pytest.raises(ModelLoadError) as caught:
        Runtime(llama_folder, max_embed_len=4096, load_entrypoints=False)
    assert str(caught.value).startswith(f"max_embed_len=4096 needs MEAN pooling, but model {llama_folder} pools LAST")


def test_a_mean_pooling_decoder_is_windowed(llama_folder):
    """max_embed_len applies to any MEAN model: a causal decoder's windows run as separate
    prompts (chunked prefill stays within one window)."""
    from transformers import LlamaModel

    decoder = Runtime(llama_folder, pooling_type="MEAN", max_model_len=16, max_embed_len=40, dtype="float32",
                      max_num_batched_tokens=8, load_entrypoints=False)
    ids = [(7 * i + 3) % 997 + 3 for i in range(40)]
    model = LlamaModel.from_pretrained(llama_folder, local_files_only=True).eval()
    with torch.inference_mode():
        means = [model(input_ids=torch.tensor([part])).last_hidden_state[0].double().mean(0).numpy()
                 for part in windows(ids, 16)]
    counts = np.array([16, 16, 8], dtype=np.float64)
    expected = (np.stack(means) * counts[:, None]).sum(0) / counts.sum()
    actual = decoder.embed(ids, normalize=False)
    assert cosine_rows(actual, expected)[0] >= MIN_COSINE
    np.testing.assert_allclose(actual, expected, atol=2e-5, rtol=1e-4)


def test_max_embed_len_must_exceed_max_model_len(model_name):
    with pytest.raises(ModelLoadError) as caught:
        Runtime(max_embed_len=MAX_MODEL_LEN, load_entrypoints=False)
    assert str(caught.value) == (
        f"max_embed_len=256 must be greater than max_model_len=256 of model {model_name}: inputs up to "
        "max_model_len already run whole; raise it or leave it unset"
    )


def test_max_embed_len_needs_the_embed_task(model_name):
    with pytest.raises(ModelLoadError) as caught:
        Runtime(task="token_embed", max_embed_len=MAX_EMBED_LEN, load_entrypoints=False)
    assert str(caught.value) == (
        f"max_embed_len=1000 applies to the embed task only, and this runtime serves ['token_embed'] for model "
        f"{model_name}: leave max_embed_len unset"
    )


@pytest.mark.parametrize("value", [0, -5, True, 2.5])
def test_max_embed_len_must_be_a_positive_integer(value):
    with pytest.raises(InvalidRequestError, match=f"max_embed_len must be a positive integer, got {value!r}"):
        RuntimeConfig(max_embed_len=value)


def test_max_embed_len_is_recorded_as_a_results_setting():
    """A Ray job records it (``RuntimeConfig.recorded``): a resumed job with another value is a
    different job, since it changes which inputs get a vector at all."""
    field = attrs.fields_dict(RuntimeConfig)["max_embed_len"]
    assert not field.metadata.get(SPEED_ONLY)
    assert RuntimeConfig(max_embed_len=4096).recorded() == {"max_embed_len": 4096}
    assert "max_embed_len" not in RuntimeConfig().recorded()
    assert RuntimeConfig.from_options("m", max_embed_len=4096).max_embed_len == 4096


# --------------------------------------------------------------------------- other surfaces


def test_http_usage_counts_every_window_token(long_runtime, reference, text_with_tokens, poolrunner_step_recorder):
    log = poolrunner_step_recorder(long_runtime)
    from poolrunner.core.testing.server import ServerThread

    texts = [text_with_tokens(600, seed=9), "A cat sat on the mat."]
    short_tokens = len(long_runtime.inputs.encode([texts[1]])[0])
    with ServerThread(long_runtime) as server:
        answer = httpx.post(f"{server.url}/v1/embeddings", json={"input": texts}, timeout=60)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == 600 + short_tokens
        vectors = np.array([item["embedding"] for item in body["data"]], dtype=np.float32)
        np.testing.assert_allclose(vectors, long_runtime.embed(texts), atol=2e-6)
        assert_matches(vectors[0], reference(texts[0]))

        tei = httpx.post(f"{server.url}/embed", json={"inputs": texts[0], "truncate": False}, timeout=60)
        assert tei.status_code == 200, tei.text
        np.testing.assert_allclose(np.array(tei.json()[0], dtype=np.float32), vectors[0], atol=2e-6)

        too_long = httpx.post(f"{server.url}/v1/embeddings", json={"input": text_with_tokens(1001)}, timeout=60)
        assert too_long.status_code == 400
        assert too_long.json()["error"]["message"].startswith(
            "input 0 has 1001 tokens, more than max_embed_len=1000 (inputs over max_model_len=256")
        again = httpx.post(f"{server.url}/v1/embeddings", json={"input": texts[1]}, timeout=60)
        assert again.status_code == 200
    assert not log.in_flight


def test_cli_max_embed_len(capsys, long_runtime, text_with_tokens):
    from poolrunner.core.cli.main import main

    text = text_with_tokens(600, seed=10)
    code = main(["embed", "--dtype", "float32", "--no-entrypoints", "--max-embed-len", "1000", text])
    out, err = capsys.readouterr()
    assert code == 0, err
    vector = np.array(json.loads(out.splitlines()[0])["embedding"], dtype=np.float32)
    np.testing.assert_allclose(vector, long_runtime.embed(text), atol=2e-6)

    code = main(["embed", "--dtype", "float32", "--no-entrypoints", text])
    out, err = capsys.readouterr()
    assert code == 2 and "has 600 tokens, more than the maximum of 256" in err
