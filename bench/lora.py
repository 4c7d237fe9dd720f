"""LoRA adapters' cost: a step mixing 8 adapters against the base model alone and against merged
weights, and the memory per adapter.

    python bench/lora.py [--rounds 3] [--texts 256] [--rank 16] [--dtype float32]

On all-MiniLM-L6-v2 (shipped with poolrunner), 8 PEFT adapters of rank ``--rank`` on every linear
layer (query, key, value, the dense layers; B redrawn, as PEFT starts it at zero). Timed, each
round in turn (interleaved, so load elsewhere hits all alike): the base model on a runtime
without adapters (its usual fast path), the base model on the runtime serving the adapters, the
texts spread over the 8 adapters in one submission (mixed steps), and one adapter merged into
the weights (``merge_and_unload``) on a runtime without adapters. Prints texts/s medians and the
ratios. Needs ``peft`` (the test extra).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from profiles import PROFILES, load_texts  # noqa: E402

from poolrunner import Runtime  # noqa: E402
from poolrunner.core.frontend.requests import EncodeRequest  # noqa: E402

TARGETS = ["query", "key", "value", "dense"]


def make_adapters(base: str, root: Path, count: int, rank: int) -> dict[str, Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    adapters = {}
    for i in range(count):
        model = get_peft_model(AutoModel.from_pretrained(base), LoraConfig(r=rank, lora_alpha=2 * rank,
                                                                           target_modules=TARGETS))
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
        model.save_pretrained(root / f"a{i}")
        adapters[f"a{i}"] = root / f"a{i}"
    return adapters


def merged_folder(base: str, adapter: Path, folder: Path) -> Path:
    from peft import PeftModel
    from transformers import AutoModel, AutoTokenizer

    PeftModel.from_pretrained(AutoModel.from_pretrained(base), adapter).merge_and_unload().save_pretrained(folder)
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return folder


def texts_per_s(runtime: Runtime, texts: list[str], loras: list[str | None]) -> float:
    """One submission: every text with its adapter, the steps mixing them."""
    requests = [request for text, lora in zip(texts, loras, strict=True)
                for request in runtime.frontend.plan(EncodeRequest.of(inputs=[text], task="embed", lora=lora)).requests]
    with runtime.serving() as serving:
        start = time.perf_counter()
        asyncio.run(serving.run(requests))
        return len(texts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    texts = load_texts(PROFILES["paragraphs"], args.texts)
    plain = Runtime(dtype=args.dtype)
    base = plain.model_config.path
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(base, Path(tmp), args.adapters, args.rank)
        served = Runtime(base, dtype=args.dtype, lora_modules=adapters, max_lora_rank=args.rank)
        merged = Runtime(merged_folder(base, adapters["a0"], Path(tmp) / "merged"), dtype=args.dtype)
        names = list(adapters)
        cases = {
            "base, no adapters served": (plain, [None] * len(texts)),
            "base, adapters served": (served, [None] * len(texts)),
            f"{len(names)} adapters mixed": (served, [names[i % len(names)] for i in range(len(texts))]),
            "1 adapter merged": (merged, [None] * len(texts)),
        }
        for runtime, loras in cases.values():  # warm-up
            texts_per_s(runtime, texts[:32], loras[:32])
        timings: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, (runtime, loras) in cases.items():
                timings[name].append(texts_per_s(runtime, texts, loras))
        saved = load_file(adapters["a0"] / "adapter_model.safetensors")
        per_adapter = sum(tensor.numel() * 4 for tensor in saved.values())
    reference = statistics.median(timings["base, no adapters served"])
    print(f"{len(texts)} paragraphs, rank {args.rank}, dtype {args.dtype}, {args.rounds} rounds (median texts/s)")
    for name, values in timings.items():
        median = statistics.median(values)
        print(f"  {name:28s} {median:8.1f} texts/s   time x{reference / median:.2f} of the base alone")
    print(f"  memory per adapter: {per_adapter / 2**20:.2f} MiB (float32 A and B)")


if __name__ == "__main__":
    main()
