"""The GPU check, sized to one 10-minute device call (first run on an H200, 4 December 2026:
bench/README.md, "GPU check").

    python bench/gpu_check.py [--out DIR] [--texts 2048] [--budget-s 420]

No real weights travel to the device machine (the working tree it receives is capped at 64 MiB),
so the check builds seeded folders of real shapes there: a BERT-base-shaped encoder (12 layers,
768 wide) and a Qwen3-0.6B-shaped decoder (28 layers, 1024 wide, GQA 16/8), with the tiny
word-level tokenizers of :mod:`poolrunner.core.testing.tiny_models` (texts are words ``w0 ..
w994``). Parity and speed are the same as with real weights: same shapes, same FLOPs.

1. **Parity on CUDA** against transformers run on the same GPU: the encoder's MEAN embeddings,
   the decoder's LAST-token embeddings of 128 texts of 3 to 300 words, in float32 (max abs, min
   cosine), bfloat16 and float16 (min cosine against transformers' float32; beside it,
   transformers' own in that dtype, the yardstick).
2. **Throughput** in texts/s and words/s (one token a word) of ``Runtime.embed`` against sentence-transformers on
   the same folder and GPU (bfloat16 both, batch 64 for sentence-transformers as its users set
   it), on texts of mixed lengths (8 to 512 tokens) and at 512 and 128 tokens per text, with the
   peak GPU memory each allocated; and vLLM's GPU pooling runner where ``vllm`` imports (it is
   not in the device image; carry its wheels to compare).
3. **Async output overlap**: ``async_scheduling`` on against off (the next step is launched
   before the previous step's results are copied to the host); and **variable-length
   attention** (``compile="auto"``: :mod:`poolrunner.core.kernels.cuda_attention`) against one
   SDPA call per run of equal lengths (``compile="off"``).
4. **A profile** (torch.profiler) of one bfloat16 embed call of the mixed lengths on the encoder,
   when time is left.

Prints one table per part and writes ``gpu_check.json`` to ``--out`` (``$OUT`` on the device
machine). The device image has torch, transformers and sentence-transformers but not
importlib-metadata; nothing can be fetched there, so poolrunner and that one package travel as
wheels (see bench/README.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
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


def mixed_texts(count: int, shortest: int, longest: int, seed: int = 0) -> list[str]:
    """``count`` texts of ``shortest`` to ``longest`` random words each, uniformly."""
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(995)}" for _ in range(rng.randint(shortest, longest))) for _ in range(count)]


def reference_embeddings(
    folder: Path, texts: list[str], pooling: str, dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """transformers in ``dtype`` on CUDA (its default attention), pooled as sentence-transformers'
    Pooling(mean) or Pooling(lasttoken) does, then L2-normalized: ``[num_texts, hidden_size]``
    float32 on the CPU."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=dtype).to(DEVICE).eval()
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
            rows.append(torch.nn.functional.normalize(pooled.float(), dim=-1).cpu())
    del model
    release()
    return torch.cat(rows)


def parity(folders: dict[str, Path]) -> list[dict[str, Any]]:
    from poolrunner import Runtime

    rows = []
    texts = mixed_texts(128, 3, 300, seed=1)
    for name, pooling in (("bert-base", "MEAN"), ("qwen3-0.6b", "LAST")):
        reference = reference_embeddings(folders[name], texts, pooling)
        for dtype in ("float32", "bfloat16", "float16"):
            row: dict[str, Any] = {"model": name, "dtype": dtype}
            try:
                runtime = Runtime(folders[name], device=DEVICE, dtype=dtype, pooling_type=pooling, normalize=True)
                ours = torch.from_numpy(runtime.embed(texts))
                del runtime
            except Exception as error:  # reported, and the check goes on
                traceback.print_exc()
                rows.append({**row, "error": repr(error)[:300]})
                continue
            finally:
                release()
            row.update(max_abs=float((ours - reference).abs().max()), min_cosine=min_cosine(ours, reference))
            if dtype != "float32":  # transformers' own error in this dtype, the yardstick
                own = reference_embeddings(folders[name], texts, pooling, getattr(torch, dtype))
                row["transformers_min_cosine"] = min_cosine(own, reference)
            rows.append(row)
    return rows


def min_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def release() -> None:
    """Free what the last system held, so the next one's peak memory is its own."""
    gc.collect()
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

    def poolrunner(**options: Any) -> Callable[[list[str]], object]:
        from poolrunner import Runtime

        runtime = Runtime(folder, device=DEVICE, dtype="bfloat16", pooling_type=pooling, normalize=True, **options)
        return runtime.embed

    def sentence_transformers() -> Callable[[list[str]], object]:
        from sentence_transformers import SentenceTransformer

        try:  # sentence-transformers 6 moved its modules
            from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
        except ImportError:
            from sentence_transformers.models import Normalize, Pooling, Transformer

        mode = "mean" if pooling == "MEAN" else "lasttoken"
        width = json.loads((folder / "config.json").read_text())["hidden_size"]
        model = SentenceTransformer(modules=[Transformer(str(folder)), Pooling(width, mode), Normalize()],
                                    device=DEVICE).to(torch.bfloat16)
        return lambda texts: model.encode(texts, batch_size=64, convert_to_numpy=True)

    found = {"poolrunner": poolrunner, "poolrunner (async off)": lambda: poolrunner(async_scheduling=False),
             "poolrunner (compile off)": lambda: poolrunner(compile="off"),
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


PROFILES = {"8-512": (6, 510), "512": (510, 510), "128": (126, 126)}
"""Words per text, fewest and most, by the tokens a BERT text then has (two special tokens
added); in the order run: the mixed lengths users send first."""


def throughput(folders: dict[str, Path], count: int, deadline: float) -> list[dict[str, Any]]:
    rows = []
    for profile, (shortest, longest) in PROFILES.items():
        texts = mixed_texts(count, shortest, longest, seed=longest + shortest)
        words = sum(len(text.split()) for text in texts)
        for name, pooling in (("bert-base", "MEAN"), ("qwen3-0.6b", "LAST")):
            for system, load in systems(folders[name], pooling).items():
                row: dict[str, Any] = {"model": name, "tokens": profile, "system": system}
                if time.monotonic() > deadline:
                    rows.append({**row, "skipped": "time budget"})
                    continue
                if DEVICE == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                try:
                    seconds = timed(load(), texts, repeats=3)
                except Exception as error:  # a peer that cannot run this folder is reported, not fatal
                    traceback.print_exc()
                    rows.append({**row, "error": repr(error)[:300]})
                    continue
                finally:
                    release()
                row.update(texts_per_s=count / seconds, words_per_s=words / seconds)
                if DEVICE == "cuda":
                    row["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
                rows.append(row)
                print(f"  {row}", flush=True)
    return rows


def profile(folder: Path, pooling: str, texts: list[str]) -> str:
    """torch.profiler's table of one ``Runtime.embed(texts)`` call in bfloat16 (after a warm-up):
    the kernels and operators with the most device time, then the most host time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    from poolrunner import Runtime
    from poolrunner.core.engine import compute

    runtime = Runtime(folder, device=DEVICE, dtype="bfloat16", pooling_type=pooling, normalize=True)
    runtime.embed(texts)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    recorded = profiler(activities=activities)
    compute.call(recorded.__enter__)  # the model runs on poolrunner's compute thread: profile that one
    start = time.perf_counter()
    runtime.embed(texts)
    synchronize()
    wall = time.perf_counter() - start
    compute.call(recorded.__exit__, None, None, None)
    table = recorded.key_averages()
    device_sort = "self_cuda_time_total" if DEVICE == "cuda" else "self_cpu_time_total"
    return (f"wall {wall * 1000:.1f} ms for {len(texts)} texts\n"
            + table.table(sort_by=device_sort, row_limit=15, max_name_column_width=60) + "\n"
            + table.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


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
    import transformers

    from poolrunner.core.kernels import cuda_attention

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    report: dict[str, Any] = {"gpu": name, "torch": torch.__version__, "transformers": transformers.__version__,
                              "varlen_attn": sorted(cuda_attention._parameters())}
    print(f"# {report['gpu']}, torch {report['torch']}, transformers {report['transformers']}, "
          f"varlen_attn({', '.join(report['varlen_attn'])})", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as root:
        folders = build_folders(Path(root), args.layers)
        report["parity"] = parity(folders)
        print_table(f"parity vs transformers float32 on {DEVICE}", report["parity"])
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))  # kept if the rest runs out of time
        report["throughput"] = throughput(folders, args.texts, deadline)
        print_table("throughput, bfloat16", report["throughput"])
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
        if time.monotonic() < deadline + 60:
            print("\n## profile: bert-base, 8-512 tokens, bfloat16", flush=True)
            report["profile"] = profile(folders["bert-base"], "MEAN", mixed_texts(args.texts, 6, 510, seed=516))
            print(report["profile"], flush=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
