"""The GPU check, prepared to run in one call the first session a CUDA machine is lent.

    python bench/gpu_check.py [--out DIR] [--texts 2048] [--budget-s 420]

No real weights travel to the device machine (the working tree it receives is capped at 64 MiB),
so the check builds seeded folders of real shapes there: a BERT-base-shaped encoder (12 layers,
768 wide) and a Qwen3-0.6B-shaped decoder (28 layers, 1024 wide, GQA 16/8), with the tiny
word-level tokenizers of :mod:`poolrunner.core.testing.tiny_models` (texts are words ``w0 ..
w994``). Parity and speed are the same as with real weights: same shapes, same FLOPs.

1. **Parity on CUDA** against transformers run on the same GPU: the encoder's MEAN embeddings,
   the decoder's LAST-token embeddings, in float32 (max abs, min cosine) and bfloat16 (min
   cosine against transformers' float32).
2. **Throughput** in texts/s and tokens/s of ``Runtime.embed`` against sentence-transformers on
   the same folder and GPU (bfloat16 both, batch 64 for sentence-transformers as its users set
   it), at 128 and 512 tokens per text; and vLLM's GPU pooling runner where ``vllm`` imports
   (it is not in the device image; carry its wheels to compare).
3. **Async output overlap**: ``async_scheduling`` on against off (the next step is launched
   before the previous step's results are copied to the host).

Prints one table per part and writes ``gpu_check.json`` to ``--out`` (``$OUT`` on the device
machine). Set-up there (packages present in its image; nothing is fetched):
``python3 -m pip install -q --no-deps --no-build-isolation -e . && python3 bench/gpu_check.py --out $OUT``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DEVICE = "cuda"  # --device cpu smoke-tests the script on a machine without a GPU

# The shapes that set FLOPs and numerics, from bert-base-uncased's and Qwen3-0.6B's config.json.
ENCODER = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
           "max_position_embeddings": 512, "type_vocab_size": 2, "pad_token_id": 0}
DECODER = {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
           "head_dim": 128, "intermediate_size": 3072, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
           "rope_theta": 1_000_000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
           "pad_token_id": 2}


def build_folders(root: Path, layers: int | None = None) -> dict[str, Path]:
    """Seeded BERT-base- and Qwen3-0.6B-shaped folders under ``root``, saved in float32;
    ``layers`` cuts both to that many layers (a smoke test of the script)."""
    import transformers

    from poolrunner.core.testing.tiny_models import VOCAB_SIZE, tiny_tokenizer

    folders = {}
    shapes = {"num_hidden_layers": layers} if layers else {}
    for name, family, config in (
        ("bert-base", "bert", transformers.BertConfig(vocab_size=VOCAB_SIZE, **{**ENCODER, **shapes})),
        ("qwen3-0.6b", "qwen3", transformers.Qwen3Config(vocab_size=VOCAB_SIZE, **{**DECODER, **shapes})),
    ):
        torch.manual_seed(0)
        model = (transformers.BertModel if family == "bert" else transformers.Qwen3Model)(config)
        folder = root / name
        model.save_pretrained(folder)
        tiny_tokenizer(family).save_pretrained(folder)
        folders[name] = folder
    return folders


def make_texts(count: int, words: int, seed: int = 0) -> list[str]:
    """``count`` texts of ``words`` random words each (one token per word with the tiny tokenizers)."""
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(995)}" for _ in range(words)) for _ in range(count)]


def reference_embeddings(folder: Path, texts: list[str], pooling: str) -> torch.Tensor:
    """transformers in float32 on CUDA, pooled as sentence-transformers' Pooling(mean) or
    Pooling(lasttoken) does, then L2-normalized: ``[num_texts, hidden_size]`` float32 on the CPU."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).to(DEVICE).eval()
    rows = []
    with torch.inference_mode():
        for start in range(0, len(texts), 32):
            batch = tokenizer(texts[start:start + 32], return_tensors="pt", padding=True).to(DEVICE)
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            if pooling == "MEAN":
                pooled = (hidden * mask).sum(1) / mask.sum(1)
            else:  # right padding: the last real token of each row
                last = batch["attention_mask"].sum(1) - 1
                pooled = hidden[torch.arange(hidden.shape[0], device=DEVICE), last]
            rows.append(torch.nn.functional.normalize(pooled, dim=-1).cpu())
    del model
    release()
    return torch.cat(rows)


def parity(folders: dict[str, Path]) -> list[dict[str, Any]]:
    from poolrunner import Runtime

    rows = []
    texts = make_texts(64, 40, seed=1) + make_texts(64, 300, seed=2)
    for name, pooling in (("bert-base", "MEAN"), ("qwen3-0.6b", "LAST")):
        reference = reference_embeddings(folders[name], texts, pooling)
        for dtype in ("float32", "bfloat16"):
            runtime = Runtime(folders[name], device=DEVICE, dtype=dtype, pooling_type=pooling, normalize=True)
            ours = torch.from_numpy(runtime.embed(texts))
            cosine = torch.nn.functional.cosine_similarity(ours, reference, dim=-1)
            rows.append({"model": name, "dtype": dtype, "max_abs": float((ours - reference).abs().max()),
                         "min_cosine": float(cosine.min())})
            del runtime
            release()
    return rows


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def release() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def timed(embed: Callable[[list[str]], object], texts: list[str], repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``embed(texts)`` after one warm-up, the GPU synchronized."""
    embed(texts)
    seconds = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        embed(texts)
        synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def systems(folder: Path, pooling: str) -> dict[str, Callable[[], Callable[[list[str]], object]]]:
    """Name -> a loader returning an ``embed(texts)``; each loaded only when timed."""

    def poolrunner(async_scheduling: bool | None = None) -> Callable[[list[str]], object]:
        from poolrunner import Runtime

        runtime = Runtime(folder, device=DEVICE, dtype="bfloat16", pooling_type=pooling, normalize=True,
                          async_scheduling=async_scheduling)
        return runtime.embed

    def sentence_transformers() -> Callable[[list[str]], object]:
        from sentence_transformers import SentenceTransformer, models

        word = models.Transformer(str(folder))
        mode = "mean" if pooling == "MEAN" else "lasttoken"
        width = json.loads((folder / "config.json").read_text())["hidden_size"]
        model = SentenceTransformer(modules=[word, models.Pooling(width, mode),
                                             models.Normalize()], device=DEVICE).to(torch.bfloat16)
        return lambda texts: model.encode(texts, batch_size=64, convert_to_numpy=True)

    found = {"poolrunner": poolrunner, "poolrunner (async off)": lambda: poolrunner(False),
             "sentence-transformers": sentence_transformers}
    try:
        import vllm

        def vllm_runner() -> Callable[[list[str]], object]:
            llm = vllm.LLM(model=str(folder), runner="pooling", dtype="bfloat16", enforce_eager=False,
                           override_pooler_config={"pooling_type": pooling, "normalize": True})
            return lambda texts: llm.embed(texts, use_tqdm=False)

        found["vllm"] = vllm_runner
    except ImportError:
        pass
    return found


def throughput(folders: dict[str, Path], count: int, deadline: float) -> list[dict[str, Any]]:
    rows = []
    for name, pooling in (("bert-base", "MEAN"), ("qwen3-0.6b", "LAST")):
        for words in (126, 510):
            texts = make_texts(count, words, seed=words)
            for system, load in systems(folders[name], pooling).items():
                if time.monotonic() > deadline:
                    rows.append({"model": name, "tokens": words + 2, "system": system, "skipped": "time budget"})
                    continue
                try:
                    seconds = timed(load(), texts, repeats=3)
                except Exception as error:  # a peer that cannot run this folder is reported, not fatal
                    rows.append({"model": name, "tokens": words + 2, "system": system, "error": repr(error)[:300]})
                    continue
                finally:
                    release()
                rows.append({"model": name, "tokens": words + 2, "system": system, "texts_per_s": count / seconds,
                             "tokens_per_s": count * (words + 2) / seconds})
    return rows


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n## {title}")
    keys = list(dict.fromkeys(key for row in rows for key in row))
    print(" | ".join(keys))
    for row in rows:
        cells = (f"{row[key]:.6g}" if isinstance(row.get(key), float) else str(row.get(key, "")) for key in keys)
        print(" | ".join(cells))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--texts", type=int, default=2048, help="texts per throughput run")
    parser.add_argument("--budget-s", type=float, default=420, help="stop starting throughput runs after this")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the script itself")
    parser.add_argument("--layers", type=int, help="cut both models to this many layers (smoke test)")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device; this check runs on a GPU machine (see bench/README.md)")
    deadline = time.monotonic() + args.budget_s
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    report: dict[str, Any] = {"gpu": name, "torch": torch.__version__}
    print(f"# {report['gpu']}, torch {report['torch']}")
    with tempfile.TemporaryDirectory() as root:
        folders = build_folders(Path(root), args.layers)
        report["parity"] = parity(folders)
        print_table(f"parity vs transformers float32 on {DEVICE}", report["parity"])
        report["throughput"] = throughput(folders, args.texts, deadline)
        print_table("throughput, bfloat16", report["throughput"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
