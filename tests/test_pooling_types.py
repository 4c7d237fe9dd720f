"""CLS and LAST pooling against transformers' hidden states over padded batches.

References come from ``AutoModel(...).last_hidden_state`` of a right-padded batch: CLS is row 0,
LAST is the last row the attention mask marks as real. The decoder case is a seeded random
``LlamaModel`` whose pad id equals its eos id, and whose inputs end with eos: finding LAST from
the pad id would pick the wrong row.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

import poolrunner
from tests.helpers import MIN_COSINE, cosine_rows


@pytest.fixture(scope="module")
def texts(lee_docs) -> list[str]:
    return ["Hi.", lee_docs[0], "Two words here", lee_docs[5][:200], lee_docs[12], "A medium sized sentence here."]


@pytest.fixture(scope="module")
def hf_states(hf_tokenizer, hf_hidden, texts):
    ids = [list(row) for row in hf_tokenizer(texts)["input_ids"]]
    assert len({len(row) for row in ids}) == len(ids)  # every length differs: real padding
    states, mask = hf_hidden(ids)
    return states.double().numpy(), mask.numpy()


@pytest.mark.parametrize("pooling_type", ["CLS", "LAST"])
def test_minilm_pooling_matches_transformers(pooling_type, texts, hf_states):
    states, mask = hf_states
    rt = poolrunner.Runtime(pooling_type=pooling_type, normalize=False, dtype="float32")
    assert rt.model_config.pooling_type == pooling_type
    rows = np.zeros(len(texts), dtype=int) if pooling_type == "CLS" else mask.sum(1) - 1
    reference = states[np.arange(len(texts)), rows]
    vectors = rt.embed(texts)
    assert vectors.shape == (len(texts), 384)
    assert cosine_rows(vectors, reference).min() >= MIN_COSINE
    # normalize=False: the raw hidden state, magnitude included.
    np.testing.assert_allclose(vectors, reference, rtol=1e-4, atol=1e-4)
    assert not np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3)
    # The per-request switch turns normalization back on.
    normed = rt.embed(texts, normalize=True)
    np.testing.assert_allclose(normed, reference / np.linalg.norm(reference, axis=1, keepdims=True), atol=1e-5)


def test_cls_and_last_differ_from_mean(hf_states, texts, runtime):
    # Guards the test itself: the three poolings give different vectors on this model.
    states, mask = hf_states
    mean = runtime.embed(texts)
    cls = states[:, 0]
    last = states[np.arange(len(texts)), mask.sum(1) - 1]
    assert cosine_rows(mean, cls).max() < 0.99
    assert cosine_rows(cls, last).max() < 0.99


# --------------------------------------------------------------------------- decoder


@pytest.fixture(scope="module")
def llama_runtime(llama_folder):
    return poolrunner.Runtime(llama_folder, dtype="float32")


@pytest.fixture(scope="module")
def llama_texts() -> list[str]:
    rng = random.Random(7)
    return [" ".join(f"w{rng.randrange(997)}" for _ in range(n)) for n in (3, 17, 1, 40, 9, 25)]


def test_decoder_defaults(llama_runtime):
    config = llama_runtime.model_config
    assert config.architecture == "LlamaModel"
    assert config.is_causal
    assert config.pooling_type == "LAST"
    assert config.normalize is True
    assert config.max_model_len == 256


def test_decoder_last_pooling_matches_transformers(llama_runtime, llama_texts, llama_reference):
    tokenizer = llama_runtime.inputs.tokenizer
    ids = [list(row) for row in tokenizer(llama_texts)["input_ids"]]
    assert all(row[-1] == tokenizer.pad_token_id == tokenizer.eos_token_id for row in ids)
    reference = llama_reference(ids)
    vectors = llama_runtime.embed(llama_texts)
    cosines = cosine_rows(vectors, reference)
    assert cosines.min() >= MIN_COSINE, cosines
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    # The guard: the last row differs from the first pad-id position's neighbour (row -2).
    second_last = [row[:-1] for row in ids if len(row) > 2]
    assert cosine_rows(llama_reference(second_last), reference[[len(r) > 2 for r in ids]]).max() < 0.99


def test_decoder_token_id_inputs(llama_runtime, llama_reference):
    rng = random.Random(11)
    # Ids include the pad/eos id (2) in the middle and at the end.
    inputs = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 33, 2, 12)]
    inputs[1][10] = 2
    inputs[3][-1] = 2
    inputs.append([2, 2, 2, 2])
    vectors = llama_runtime.embed(inputs)
    assert cosine_rows(vectors, llama_reference(inputs)).min() >= MIN_COSINE


def test_decoder_equal_length_batch(llama_runtime, llama_reference):
    # No padding at all: the causal structure must still be applied.
    rng = random.Random(3)
    inputs = [[rng.randrange(3, 1000) for _ in range(16)] for _ in range(5)]
    vectors = llama_runtime.embed(inputs)
    reference = llama_reference(inputs)
    assert cosine_rows(vectors, reference).min() >= MIN_COSINE
    # Causality: a prefix's LAST vector equals the full input's hidden state at that position.
    prefix = [row[:9] for row in inputs]
    assert cosine_rows(llama_runtime.embed(prefix), llama_reference(prefix)).min() >= MIN_COSINE


def test_decoder_raw_values_and_small_steps(llama_folder, llama_texts, llama_reference):
    rt = poolrunner.Runtime(llama_folder, normalize=False, max_num_batched_tokens=32, max_num_seqs=2, dtype="float32")
    tokenizer = rt.inputs.tokenizer
    ids = [list(row) for row in tokenizer(llama_texts)["input_ids"]]
    assert max(len(row) for row in ids) > 32  # one input is over the budget: it runs alone
    vectors = rt.embed(llama_texts)
    reference = llama_reference(ids)
    assert cosine_rows(vectors, reference).min() >= MIN_COSINE
    np.testing.assert_allclose(vectors, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sums_over_long_requests_round_once_to_float32(dtype):
    """MEAN, MEAN_SQRT_LEN and WEIGHTEDMEAN over requests of up to 3,000 tokens are within float32
    rounding of the float64 truth (summed token by token in float32 they were 4.8e-6 off at 1,500
    tokens; sentence-transformers' own reduction is at about 7e-8)."""
    import torch

    from poolrunner.plugins.sequence_pooling.methods import POOLING_METHODS

    lengths = [1500, 7, 3000, 1]
    torch.manual_seed(0)
    hidden = (torch.randn(sum(lengths), 64) + 0.5).to(getattr(torch, dtype))
    starts = torch.tensor([0, *np.cumsum(lengths)])
    rows = [hidden[a:b].double() for a, b in zip(starts[:-1], starts[1:], strict=True)]
    truths = {
        "MEAN": [r.mean(0) for r in rows],
        "MEAN_SQRT_LEN": [r.sum(0) / len(r) ** 0.5 for r in rows],
        "WEIGHTEDMEAN": [(r * torch.arange(1, len(r) + 1, dtype=torch.float64)[:, None]).sum(0)
                         / (len(r) * (len(r) + 1) / 2) for r in rows],
    }
    for name, truth in truths.items():
        got = POOLING_METHODS[name](hidden, starts)
        assert got.dtype == torch.float32
        for vector, expected in zip(got, truth, strict=True):
            # float32's rounding of the result: half an ulp, 6e-8 relative
            np.testing.assert_allclose(vector.double().numpy(), expected.numpy(), rtol=6e-8, atol=0)
