"""Three models in one server against three servers of one model each: memory and throughput.

    python bench/multi_model.py [--rounds 3] [--requests 60] [--clients 8]

The models are all-MiniLM-L6-v2 as an embedder, and its weights under a seeded one-label head
(a cross-encoder) and a seeded three-label head (a classifier): the same backbone size as the
MiniLM-based rerankers and classifiers people serve next to it. Each round starts both
set-ups in turn (interleaved, so load elsewhere hits both), warms them, sends the same mixed
load from ``--clients`` threads (embeddings of 8 paragraphs, a rerank of 8 paragraphs, a
classification of 8 paragraphs, in rotation) and reads the resident memory of every server
process. Prints the medians and the ratios, with ``lscpu``'s model name and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from profiles import PROFILES, load_texts  # noqa: E402
from serving import cpu_kind, start_serve  # noqa: E402

from poolrunner.core.model.metadata import resolve_model_path  # noqa: E402

BATCH = 8


def build_heads(folder: Path) -> dict[str, str]:
    """The cross-encoder and classifier folders (the default model's weights, seeded heads)."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    source = resolve_model_path(None)
    made = {}
    for name, labels in (("rerank", {"num_labels": 1}), ("labels", {"id2label": {0: "a", 1: "b", 2: "c"}})):
        model = BertForSequenceClassification.from_pretrained(source, local_files_only=True, **labels).eval()
        generator = torch.Generator().manual_seed(len(name))
        with torch.no_grad():
            model.classifier.weight.copy_(torch.randn(model.classifier.weight.shape, generator=generator) * 0.3)
        model.save_pretrained(folder / name)
        AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(folder / name)
        made[name] = str(folder / name)
    return made


def calls(urls: dict[str, str], texts: list[str], count: int) -> list[tuple[str, dict]]:
    """``count`` requests, embed / rerank / classify in rotation, each on ``BATCH`` texts."""
    made = []
    for i in range(count):
        batch = [texts[(i * BATCH + j) % len(texts)] for j in range(BATCH)]
        kind = ("embed", "rerank", "labels")[i % 3]
        if kind == "embed":
            made.append((f"{urls[kind]}/v1/embeddings", {"model": kind, "input": batch}))
        elif kind == "rerank":
            made.append((f"{urls[kind]}/rerank", {"model": kind, "query": batch[0], "documents": batch}))
        else:
            made.append((f"{urls[kind]}/classify", {"model": kind, "input": batch}))
    return made


def load(requests: list[tuple[str, dict]], clients: int) -> tuple[float, float]:
    """Requests per second and the median latency (ms) of ``requests`` from ``clients`` threads."""
    with httpx.Client(timeout=120) as client:
        def one(call: tuple[str, dict]) -> float:
            began = time.perf_counter()
            client.post(call[0], json=call[1]).raise_for_status()
            return time.perf_counter() - began

        began = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            latencies = list(pool.map(one, requests))
        return len(requests) / (time.perf_counter() - began), statistics.median(latencies) * 1000


def run_setup(groups: list[list[str]], names: list[list[str]], texts: list[str], args: argparse.Namespace,
              ) -> tuple[float, float, float]:
    """Start one server per group, load them, stop them: (MiB resident in all, req/s, p50 ms)."""
    processes, urls = [], {}
    try:
        for port, (group, served) in enumerate(zip(groups, names, strict=True), start=args.port):
            processes.append(start_serve(["--log-level", "warning", *(f"--model={m}" for m in group)], port))
            urls.update({name: f"http://127.0.0.1:{port}" for name in served})
        load(calls(urls, texts, 12), args.clients)  # warm-up
        throughput, p50 = load(calls(urls, texts, args.requests), args.clients)
        memory = sum(psutil.Process(p.pid).memory_info().rss for p in processes) / 2**20
        return memory, throughput, p50
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=60, help="requests per measurement (a multiple of 3)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--port", type=int, default=8710)
    args = parser.parse_args()
    texts = load_texts(PROFILES["paragraphs"], 400)
    with tempfile.TemporaryDirectory() as folder:
        folders = {"embed": str(resolve_model_path(None)), **build_heads(Path(folder))}
        named = {name: f"{path}:name={name}" for name, path in folders.items()}
        setups = {
            "one server, three models": ([list(named.values())], [list(named)]),
            "three servers": ([[spec] for spec in named.values()], [[name] for name in named]),
        }
        results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in setups}
        for _ in range(args.rounds):
            for name, (groups, served) in setups.items():
                results[name].append(run_setup(groups, served, texts, args))
    print(f"CPU: {cpu_kind()}; load average {os.getloadavg()[0]:.2f}; "
          f"{args.rounds} rounds, {args.requests} requests of {BATCH} texts, {args.clients} clients")
    print(f"{'set-up':28} {'resident MiB':>13} {'requests/s':>11} {'p50 ms':>8}")
    medians = {}
    for name, rows in results.items():
        medians[name] = [statistics.median(column) for column in zip(*rows, strict=True)]
        print(f"{name:28} {medians[name][0]:13.0f} {medians[name][1]:11.1f} {medians[name][2]:8.1f}")
    one, three = medians["one server, three models"], medians["three servers"]
    print(f"one server / three servers: memory {one[0] / three[0]:.2f}x, throughput {one[1] / three[1]:.2f}x")


if __name__ == "__main__":
    main()
