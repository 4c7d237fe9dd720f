"""The throughput path: step shapes rounded to buckets on the CPU, and ``dtype="auto"``.

Results are checked against sentence-transformers in float32 (an independent reference); the
shapes the model sees are recorded with a forward pre-hook on its embeddings.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import poolrunner
from poolrunner.core import memory, precision
from poolrunner.core.engine.buckets import bucket_num_tokens
from tests.helpers import MIN_COSINE, cosine_rows


@pytest.mark.parametrize("num_tokens", [*range(1, 300), 1000, 2000, 2047, 2048, 2049, 8191, 16384])
def test_a_bucket_holds_the_step_and_wastes_at_most_a_32nd(num_tokens):
    bucket = bucket_num_tokens(num_tokens)
    assert num_tokens <= bucket < num_tokens * 33 / 32 + 8
    assert bucket % 8 == 0


def test_steps_near_the_cpu_budget_share_a_few_shapes():
    # Encoder steps end wherever the next prompt does not fit: anywhere in the last ~10%.
    assert len({bucket_num_tokens(n) for n in range(1843, 2049)}) <= 8
    assert len({bucket_num_tokens(n) for n in range(1, 65)}) == 8


def _recorded_shapes(runtime) -> list[int]:
    shapes: list[int] = []
    embeddings = runtime._engine.runner.backbone.embeddings
    embeddings.register_forward_pre_hook(lambda _module, args, kwargs: shapes.append(kwargs["input_ids"].shape[1]),
                                         with_kwargs=True)
    return shapes


def test_cpu_steps_run_padded_to_a_bucket_and_match_sentence_transformers(model_path, st_model, lee_docs):
    runtime = poolrunner.Runtime(model_path, dtype="float32", load_entrypoints=False, max_num_batched_tokens=512)
    shapes = _recorded_shapes(runtime)
    texts = lee_docs[:40] + ["Hi", "a b c d e"]
    vectors = runtime.embed(texts, truncate_prompt_tokens=-1)
    real = [len(ids) for ids in runtime.inputs.encode(texts, truncate_prompt_tokens=-1)]
    assert sum(shapes) > sum(real) and all(shape == bucket_num_tokens(shape) for shape in shapes)
    reference = st_model.encode(texts, convert_to_numpy=True)
    np.testing.assert_allclose(vectors, reference, atol=2e-6)


def test_a_lone_short_request_reuses_one_shape(model_path):
    runtime = poolrunner.Runtime(model_path, dtype="float32", load_entrypoints=False)
    shapes = _recorded_shapes(runtime)
    for text in ["Hi", "Hello there", "How are you?", "What time is it now?"]:  # 3 to 8 tokens
        runtime.embed(text)
    assert shapes == [8, 8, 8, 8]


def _vocabulary_words(tokenizer, count: int, seed: int) -> list[str]:
    """``count`` whole words of the vocabulary, drawn at random (not the probe's own choice)."""
    words = sorted(token for token in tokenizer.get_vocab() if token.isalpha() and len(token) >= 2)
    return random.Random(seed).sample(words, count)


def test_auto_dtype_holds_the_bar_where_bf16_is_worst(model_path, st_model, lee_docs):
    """Whatever ``auto`` picks keeps cosine >= 0.9999 to sentence-transformers on the inputs
    bf16 handles worst (single words, which miss it in bf16 for this model) and on documents."""
    runtime = poolrunner.Runtime(model_path, load_entrypoints=False)
    if not precision.native_bf16(torch.device("cpu")):
        assert runtime.dtype == torch.float32
    texts = [*_vocabulary_words(runtime.inputs.tokenizer, 300, seed=7), *lee_docs[:40]]
    cosines = cosine_rows(runtime.embed(texts), st_model.encode(texts, convert_to_numpy=True))
    assert cosines.min() >= MIN_COSINE


def test_auto_dtype_takes_bf16_where_it_holds_the_bar(model_path, monkeypatch):
    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    monkeypatch.setattr(precision, "MAX_RELATIVE_ERROR", 0.05)  # a bar every bf16 model here holds
    events, choose = [], precision.choose_cpu_precision

    def chosen(*args):
        result = choose(*args)
        events.append("chosen")
        return result

    monkeypatch.setattr(precision, "choose_cpu_precision", chosen)
    monkeypatch.setattr(memory, "release_memory", lambda: events.append("released") or True)
    assert poolrunner.Runtime(model_path, load_entrypoints=False).dtype == torch.bfloat16
    assert events[-2:] == ["chosen", "released"]  # the probe's freed engines go back to the system


def test_the_probe_has_single_words_and_a_long_input(model_path):
    runtime = poolrunner.Runtime(model_path, dtype="float32", load_entrypoints=False)
    texts = precision.probe_texts(runtime.inputs.tokenizer, runtime.model_config.max_model_len)
    words = texts[len(precision.PROBE_TEXTS):-1]
    assert len(words) == precision.NUM_PROBE_WORDS and all(" " not in word and word.isalpha() for word in words)
    assert texts == precision.probe_texts(runtime.inputs.tokenizer, runtime.model_config.max_model_len)  # stable
    [long_ids] = runtime.inputs.encode(texts[-1:], truncate_prompt_tokens=-1)
    assert len(long_ids) == runtime.model_config.max_model_len  # fills the model (256 <= LONG_PROBE_TOKENS)


def test_auto_dtype_falls_back_to_float32_when_bf16_misses_the_bar(model_path, st_model, monkeypatch):
    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    monkeypatch.setattr(precision, "MAX_RELATIVE_ERROR", 1e-7)  # no bf16 model is this close
    runtime = poolrunner.Runtime(model_path, load_entrypoints=False)
    assert runtime.dtype == torch.float32
    texts = ["The bar decides the precision.", "Nothing else does."]
    np.testing.assert_allclose(runtime.embed(texts), st_model.encode(texts, convert_to_numpy=True), atol=2e-6)


def test_auto_dtype_stays_float32_without_native_bf16(model_path, monkeypatch):
    monkeypatch.setattr(precision, "native_bf16", lambda device: False)
    assert poolrunner.Runtime(model_path, load_entrypoints=False).dtype == torch.float32


def test_the_probe_error_is_relative_per_output():
    reference = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([1.0])}
    output = {"a": torch.tensor([3.0, 4.05], dtype=torch.float64), "b": torch.tensor([1.0])}
    assert precision._relative_error(reference, output) == pytest.approx(0.05 / 5)
    assert precision._relative_error(torch.zeros(2), torch.zeros(2)) == 0.0
    # Outputs that cannot be compared element by element refuse bf16 (SPLADE's non-zero entries).
    assert precision._relative_error(torch.ones(14), torch.ones(15)) == float("inf")
    assert precision._relative_error(torch.tensor([3, 5]), torch.tensor([3, 6])) == float("inf")
    assert precision._relative_error(torch.tensor([3, 5]), torch.tensor([3, 5])) == 0.0
