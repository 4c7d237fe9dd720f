"""The CUDA attention path's own logic, on the CPU: which runs go to the variable-length kernel,
the spans and cumulative lengths it gets, the rows its answer lands in, and the one-time check
that keeps a kernel giving wrong answers off the path.

CI has no GPU, so the kernel itself is stood in for by a per-request float32 SDPA; the kernel is
held to transformers on a GPU by ``bench/gpu_check.py`` (see bench/README.md).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from poolrunner.core.kernels import attention, cpu_kernels, cuda_attention
from poolrunner.core.kernels.attention import MaskRule, PackedLayout

VARLEN_PARAMETERS = frozenset({"scale", "window_size", "enable_gqa"})


def _stand_in(calls: list[tuple[int, tuple[int, int]]]):
    """A CPU ``cuda_attention.attend``: each request of ``cu_seqlens`` in float32 SDPA with the
    window's dense mask; records (requests, window) of each call."""

    def attend(q, k, v, cu_seqlens, max_length, window, scale):
        bounds = cu_seqlens.tolist()
        calls.append((len(bounds) - 1, window))
        assert max_length == max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
        return torch.cat([cuda_attention._reference(q[a:b].float(), k[a:b].float(), v[a:b].float(), window)
                          for a, b in zip(bounds, bounds[1:], strict=False)]).to(q.dtype)

    return attend


def _sliding(_b, _h, q_idx, kv_idx):
    """Mistral's sliding window of 8: a causal window, (7, 0); a request of at most 8 tokens sees causally."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx < 8)


def _every_third(_b, _h, q_idx, kv_idx):
    return (q_idx - kv_idx) % 3 == 0


@pytest.mark.parametrize("function", [_sliding, _every_third])
def test_the_runs_a_window_serves_go_to_the_kernel_in_one_call_each_and_equal_sdpa(function, monkeypatch):
    """Lengths 6, 20, 6, 20, 5: the causal requests (6, 6, 5: not side by side, gathered by index)
    and the windowed ones (20, 20) each in one call; a mask that is no window stays on the per-run
    path. Every request equals float64 SDPA over it alone with the model's dense mask."""
    lengths = [6, 20, 6, 20, 5]
    calls: list[tuple[int, tuple[int, int]]] = []
    monkeypatch.setattr(cuda_attention, "supported", lambda q, k, window: True)
    monkeypatch.setattr(cuda_attention, "attend", _stand_in(calls))
    torch.manual_seed(0)
    tokens = sum(lengths)
    q = torch.randn(tokens, 4, 16)
    k, v = torch.randn(tokens, 2, 16), torch.randn(tokens, 2, 16)
    layout = PackedLayout.build(lengths, native=True)
    output = torch.zeros_like(q)
    rule = MaskRule(function, False)
    rest = attention._attend_varlen(rule, layout, q, k, v, output, None)
    if function is _every_third:
        assert calls == [] and rest == layout.runs
        return
    assert sorted(calls) == sorted([(3, cpu_kernels.CAUSAL), (2, (7, 0))]) and rest == ()
    start = 0
    for length in lengths:
        rows = torch.arange(length)
        mask = function(0, 0, rows[:, None], rows[None])
        alone = [t[start : start + length].transpose(0, 1).double() for t in (q, k, v)]
        expected = F.scaled_dot_product_attention(*alone, attn_mask=mask, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(output[start : start + length].double(), expected, rtol=1e-5, atol=1e-5)
        start += length


def test_the_spans_are_a_slice_for_runs_side_by_side_and_an_index_otherwise():
    layout = PackedLayout.build([6, 6, 20, 5])
    first, second, third = layout.runs  # (0, 2 x 6), (12, 1 x 20), (32, 1 x 5)
    rows, cu_seqlens, longest = layout.varlen_spans((first, second), torch.device("cpu"))
    assert rows == slice(0, 32) and cu_seqlens.tolist() == [0, 6, 12, 32] and longest == 20
    assert cu_seqlens.dtype == torch.int32
    rows, cu_seqlens, longest = layout.varlen_spans((first, third), torch.device("cpu"))
    assert rows.tolist() == [*range(12), *range(32, 37)] and cu_seqlens.tolist() == [0, 6, 12, 17] and longest == 6


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (64, 64), (7, 0)])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_check_passes_a_kernel_with_sdpas_answers_and_fails_one_without_its_window(window, kv_heads, monkeypatch):
    """A kernel that gives SDPA's answer in bfloat16 passes; one that ignores the window (attends
    every key of the request) fails, naming the request and its error."""
    device = torch.device("cpu")
    monkeypatch.setattr(cuda_attention, "attend", _stand_in([]))
    assert cuda_attention._check(device, torch.bfloat16, 4, kv_heads, 32, window) == ""
    if window == (-1, -1):
        return
    def unwindowed(q, k, v, cu_seqlens, longest, _window, scale):
        return _stand_in([])(q, k, v, cu_seqlens, longest, (-1, -1), scale)

    monkeypatch.setattr(cuda_attention, "attend", unwindowed)
    reason = cuda_attention._check(device, torch.bfloat16, 4, kv_heads, 32, window)
    first_wrong = 130 if window == (64, 64) else 5  # a causal window differs from full at any length
    assert reason.startswith(f"a {first_wrong}-token request was off by")
    assert reason.endswith(f"(limit {cuda_attention.CHECK_TOLERANCE})")


def test_a_combination_the_kernel_fails_stays_on_sdpa_with_one_warning(monkeypatch, caplog):
    """A kernel that raises, or a torch whose varlen_attn lacks an argument the combination needs,
    is not used for it; each combination is checked once."""

    def broken(*_args):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.\nmore")

    monkeypatch.setattr(cuda_attention, "attend", broken)
    monkeypatch.setattr(cuda_attention, "_parameters", lambda: VARLEN_PARAMETERS)
    cuda_attention._checked.cache_clear()
    device = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger=cuda_attention.__name__):
        assert not cuda_attention._checked(device, torch.float16, 4, 4, 32, (-1, -1))
        assert not cuda_attention._checked(device, torch.float16, 4, 4, 32, (-1, -1))
    assert caplog.messages == [
        "attention with window (-1, -1) in torch.float16 (4 heads, 4 key heads of 32) stays on SDPA: "
        "it raised RuntimeError: FlashAttention only supports Ampere GPUs or newer."]
    caplog.clear()
    monkeypatch.setattr(cuda_attention, "_parameters", lambda: frozenset({"scale"}))
    with caplog.at_level(logging.WARNING, logger=cuda_attention.__name__):
        assert not cuda_attention._checked(device, torch.float16, 4, 4, 32, (64, 64))
    assert [message.rsplit(": ", 1)[1] for message in caplog.messages] == [
        "this torch's varlen_attn takes no window_size"]
    cuda_attention._checked.cache_clear()


def test_grouped_query_heads_without_enable_gqa_are_left_to_the_check(monkeypatch):
    """torch 2.11's varlen_attn has no enable_gqa, yet its kernel takes fewer key heads: the flag
    is passed only where the signature has it, and the check decides."""
    passed: list[dict] = []

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **options):
        passed.append(options)
        return _stand_in([])(q, k, v, cu_q, max_q, options["window_size"], options["scale"])

    monkeypatch.setattr("torch.nn.attention.varlen.varlen_attn", varlen_attn)
    for parameters, flag in ((frozenset({"scale", "window_size"}), {}),
                             (VARLEN_PARAMETERS, {"enable_gqa": True})):
        monkeypatch.setattr(cuda_attention, "_parameters", lambda parameters=parameters: parameters)
        passed.clear()
        assert cuda_attention._check(torch.device("cpu"), torch.bfloat16, 4, 2, 32, (-1, 0)) == ""
        assert passed == [{"scale": 32 ** -0.5, "window_size": (-1, 0), **flag}]

