"""Requests of equal length attend in one call, on views of the packed tensors.

The runner packs a step's requests by length; the layout makes each stretch of adjacent
requests of equal length one run, attended without gathering or padding. Every request must
still get exactly what it gets alone: checked against per-request attention in float64, and end
to end against transformers run on each text unpadded.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from poolrunner.core.kernels import attention
from poolrunner.core.kernels.attention import LAYOUT_KWARG, KVCache, MaskRule, PackedLayout, packed_attention

HEADS, DIM = 3, 8
LENGTHS = [4, 7, 7, 2, 7, 4, 4]  # unsorted, with equal lengths adjacent and apart
BUCKET_ROWS = 3  # rows past the requests' tokens, as a bucketed CPU step has


def _bidirectional(_b, _h, q_idx, kv_idx):
    return q_idx >= 0


def _causal(_b, _h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _packed(num_tokens: int) -> tuple[torch.Tensor, ...]:
    """q, k, v as a linear layer leaves them: ``[1, heads, tokens, dim]`` views of ``[1, tokens, heads, dim]``."""
    torch.manual_seed(0)
    return tuple(torch.randn(1, num_tokens, HEADS, DIM, dtype=torch.float64).transpose(1, 2) for _ in range(3))


def test_adjacent_requests_of_equal_length_form_one_run():
    layout = PackedLayout.build(LENGTHS)
    assert [(run.start, run.count, run.length) for run in layout.runs] == [
        (0, 1, 4), (4, 2, 7), (18, 1, 2), (20, 1, 7), (27, 2, 4),
    ]
    # A prefill chunk attends on its own and splits the run it sits in.
    chunked = PackedLayout.build([5, 5, 5], caches=[None, (KVCache(), True), None])
    assert [(run.start, run.count) for run in chunked.runs] == [(0, 1), (10, 1)]
    assert [(span.start, span.end) for span in chunked.cached] == [(5, 10)]


@pytest.mark.parametrize("rule", [_bidirectional, _causal], ids=["bidirectional", "causal"])
def test_each_request_gets_what_it_gets_alone(rule):
    num_tokens = sum(LENGTHS)
    q, k, v = _packed(num_tokens + BUCKET_ROWS)
    layout = PackedLayout.build(LENGTHS)
    with torch.inference_mode():
        out, _ = packed_attention(torch.nn.Identity(), q, k, v, MaskRule(rule, False), **{LAYOUT_KWARG: layout})
    assert out.shape == (1, num_tokens + BUCKET_ROWS, HEADS, DIM)
    start = 0
    for length in LENGTHS:
        alone = [t[:, :, start : start + length] for t in (q, k, v)]
        expected = F.scaled_dot_product_attention(*alone, is_causal=rule is _causal).transpose(1, 2)
        torch.testing.assert_close(out[:, start : start + length], expected, rtol=1e-12, atol=1e-12)
        start += length
    assert not out[:, num_tokens:].any()  # the bucket's rows belong to no request


def test_a_run_is_attended_in_one_call_on_views_of_the_packed_tensors(monkeypatch):
    q, k, v = _packed(sum(LENGTHS))
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(query, key, value, **kwargs):
        calls.append((tuple(query.shape), query.untyped_storage().data_ptr()))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    layout = PackedLayout.build(LENGTHS)
    with torch.inference_mode():
        packed_attention(torch.nn.Identity(), q, k, v, MaskRule(_bidirectional, False), **{LAYOUT_KWARG: layout})
    assert [shape for shape, _ in calls] == [(run.count, HEADS, run.length, DIM) for run in layout.runs]
    assert {storage for _, storage in calls} == {q.untyped_storage().data_ptr()}  # no copy of the queries


def test_a_step_packed_by_length_returns_each_request_its_own_vector(runtime, hf_tokenizer, hf_mean, text_with_tokens):
    """Mixed lengths in no order, equal lengths apart: the runner sorts the step and puts the
    rows back; each vector equals transformers' on its own text, unpadded."""
    texts = [text_with_tokens(n, seed) for seed, n in enumerate([30, 9, 30, 52, 9, 17, 30, 5])]
    vectors = runtime.embed(texts)
    for text, vector in zip(texts, vectors, strict=True):
        expected = hf_mean([hf_tokenizer(text)["input_ids"]])[0]
        np.testing.assert_allclose(vector, expected / np.linalg.norm(expected), rtol=0, atol=2e-6)


def test_a_length_s_window_is_read_once_across_steps_for_the_same_mask_function(monkeypatch):
    """transformers hands over a new rule every forward; a length whose window was read under the
    same function (same code and captured values: ModernBERT's window overlay of 8 built anew) is
    not read again. A window of 16, or a function capturing a tensor (a padding mask), never
    shares another's entries."""
    from transformers.masking_utils import (
        and_masks,
        bidirectional_mask_function,
        padding_mask_function,
        sliding_window_bidirectional_overlay,
    )

    reads: list[int] = []
    rows = MaskRule.rows
    monkeypatch.setattr(MaskRule, "rows", lambda self, *args: reads.append(args[1]) or rows(self, *args))
    monkeypatch.setattr(attention, "_known_windows", {})

    def local(width: int) -> MaskRule:
        return MaskRule(and_masks(sliding_window_bidirectional_overlay(width), bidirectional_mask_function), False)

    cpu = torch.device("cpu")
    assert [local(8).window(length, cpu) for length in (5, 40)] == [(-1, -1), (8, 8)] and reads == [5, 40]
    assert [local(8).window(length, cpu) for length in (5, 40)] == [(-1, -1), (8, 8)] and reads == [5, 40]
    assert local(16).window(40, cpu) == (16, 16) and reads == [5, 40, 40]
    padded = MaskRule(padding_mask_function(torch.ones(1, 40, dtype=torch.bool)), False)
    assert padded.key is None
    assert [padded.window(40, cpu), MaskRule(padded.mask_function, False).window(40, cpu)] == [(-1, -1), (-1, -1)]
    assert reads == [5, 40, 40, 40, 40]


@pytest.mark.parametrize("family", ["roberta", "xlm-roberta"])
def test_a_pad_token_inside_a_roberta_prompt_keeps_the_positions_transformers_gives(family, make_decoder_folder,
                                                                                    task_runtime, token_reference):
    """The RoBERTa families number positions from the ids (a pad id takes the padding index and
    the tokens after it count on without it); written in a text or sent as ids, beside prompts
    without one, each vector equals transformers' on the prompt alone."""
    folder = make_decoder_folder(family, "model")  # the kit's folders: any family
    runtime, reference = task_runtime(folder), token_reference(folder)
    pad = reference.tokenizer.pad_token
    texts = [f"w1 {pad} w2 w3", "w4 w5 w6", f"{pad} w7 {pad}{pad} w8"]
    ids = reference.token_ids(texts)
    assert all(reference.config.pad_token_id in row for row in ids[::2])
    for got, row in zip(runtime.encode(texts, task="token_embed"), ids, strict=True):
        np.testing.assert_allclose(got, reference.alone(row), atol=2e-5)
    got = runtime.encode([ids[0], ids[2][:4]], task="token_embed")
    np.testing.assert_allclose(got[0], reference.alone(ids[0]), atol=2e-5)
    np.testing.assert_allclose(got[1], reference.alone(ids[2][:4]), atol=2e-5)
