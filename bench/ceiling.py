"""The compute ceiling: what this CPU's matrix multiplies allow, in tokens per second.

A transformer's work per token is almost all linear layers: ``2 * in * out`` FLOPs each, for
every projection of every layer (read from the model's ``config.json``), plus attention,
``4 * L * hidden`` per token and layer for a sequence of ``L`` tokens (scores and weighted sum;
half that for a causal model). ``torch.nn.functional.linear`` is timed on the model's own layer
shapes with a step's worth of rows, in bf16 and fp32 on all cores (best round); GFLOP/s divided
by FLOPs per token is the ceiling that no system's tokens/s can pass.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

ROWS = 2048  # tokens per step, poolrunner's CPU default for max_num_batched_tokens


def layer_shapes(model: str) -> tuple[list[tuple[int, int]], int, int, bool]:
    """``(in, out)`` of each linear layer in one block, the number of blocks, hidden size and
    whether attention is causal. For a text-image model (CLIP) the vision tower's: a position is
    an image patch (its patch embedding, under 3% of ViT-B/32's FLOPs, is left out)."""
    config = json.loads((Path(model) / "config.json").read_text())
    config = config.get("vision_config", config)
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads) * config.get("head_dim", hidden // heads)
    causal = config.get("is_decoder", False) or config.get("model_type") in {"llama", "qwen2", "qwen3", "gpt2"}
    if causal:  # gated MLP: gate and up, then down
        shapes = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden),
                  (hidden, inner), (hidden, inner), (inner, hidden)]
    else:
        shapes = [(hidden, hidden)] * 4 + [(hidden, inner), (inner, hidden)]
    return shapes, config["num_hidden_layers"], hidden, causal


def flops_per_token(model: str, lengths: list[int]) -> float:
    """Average FLOPs per useful token for sequences of these lengths."""
    shapes, layers, hidden, causal = layer_shapes(model)
    linear = 2 * sum(i * o for i, o in shapes)
    mean_context = sum(n * n for n in lengths) / sum(lengths)  # a token attends to its sequence
    attention = 4 * hidden * mean_context * (0.5 if causal else 1.0)
    return layers * (linear + attention)


def linear_gflops(model: str, dtype: torch.dtype, seconds: float = 2.0) -> float:
    """GFLOP/s of ``F.linear`` over one block's shapes, ``ROWS`` rows each, on all cores: the best
    round of those that fit in ``seconds``, since a ceiling is what the cores reach when they are
    not taken by something else."""
    shapes, _, _, _ = layer_shapes(model)
    cases = [(torch.randn(ROWS, i, dtype=dtype), torch.randn(o, i, dtype=dtype)) for i, o in shapes]
    flops = sum(2 * ROWS * i * o for i, o in shapes)
    best = float("inf")
    with torch.inference_mode():
        for x, w in cases:  # warm-up: oneDNN builds its kernels per shape
            torch.nn.functional.linear(x, w)
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            for x, w in cases:
                torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - start)
    return flops / best / 1e9
