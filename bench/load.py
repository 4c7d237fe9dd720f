"""Other clients' latency while some send megabytes: issue 18's load test, against a real server.

    python bench/load.py [--clients 32] [--big-mb 15] [--rounds 5] [--dtype float32] [--json FILE]

Starts ``poolrunner serve`` (the default model; ``--max-request-bytes`` raised to fit the big
body, the default being 2 MB) as a process of its own. ``--clients`` clients each send one short
sentence to ``/v1/embeddings``, wait for the answer and send the next (a closed loop: the server
is never idle), through these phases:

* ``unloaded``: those clients alone, for ``--seconds``;
* ``1 x big``: the same, while one more client sends one ``--big-mb`` MB text with
  ``truncate_prompt_tokens=-1`` (``--big-route tei``: to TEI's ``/embed``, ``truncate: true``);
  ``--rounds`` times, ``--pause`` seconds apart;
* ``3 x big``: the same with three such texts sent at once each round;
* ``unloaded again``: the clients alone once more, to see whether the machine changed.

A further client asks ``/health`` every 20 ms throughout: its slowest answer is the longest the
event loop was blocked. Printed per phase: the short requests' count, median, p99 and maximum
latency (in the loaded phases: of those in flight while a big one was), the slowest ``/health``,
and the big requests' median; then each p99 against the unloaded one, and the server's resident
memory before the loaded phases, at its peak (sampled every 20 ms) and after them (once the
server was idle for ``--settle`` seconds), with the CPU and ``/proc/loadavg``. Issue 18's bar:
the p99 of ``1 x big`` within 2x of ``unloaded``, and memory after within 20% of before.

The clients run in this process, on the same cores as the server, as a client on the same
machine would; only ratios within one quiet run mean much (the load average is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from profiles import PROFILES, load_texts  # noqa: E402
from serving import cpu_kind, start_serve  # noqa: E402

MB = 1_000_000
HEALTH_EVERY = 0.02
"""Seconds between two ``/health`` probes."""
BIG_ROUTES = {"openai": "/v1/embeddings", "tei": "/embed"}
"""Where ``--big-route`` sends the big text."""


async def probe_health(client: httpx.AsyncClient, done: asyncio.Event, phase: Phase) -> None:
    """``GET /health`` every :data:`HEALTH_EVERY` seconds until ``done``: each latency into
    ``phase.health``, each answer other than 200 into ``phase.failures``."""
    while not done.is_set():
        began = time.perf_counter()
        answer = await client.get("/health")
        phase.health.append(time.perf_counter() - began)
        if answer.status_code != 200:
            phase.failures.append(f"health: {answer.status_code}")
        await asyncio.sleep(HEALTH_EVERY)


def make_big_body(text: str, route: str) -> bytes:
    """The big request's body: ``text`` truncated to the model maximum, in the route's own words."""
    if route == "tei":
        return json.dumps({"inputs": text, "truncate": True}).encode()
    return json.dumps({"input": text, "truncate_prompt_tokens": -1}).encode()


@dataclass
class Phase:
    """What one phase measured; times are ``time.perf_counter()`` seconds."""

    name: str
    seconds: float = 0.0
    small: list[tuple[float, float]] = field(default_factory=list)
    """Each short request's (start, end)."""
    big: list[tuple[float, float]] = field(default_factory=list)
    """Each big request's (start, end)."""
    health: list[float] = field(default_factory=list)
    """Each ``/health`` answer's latency."""
    failures: list[str] = field(default_factory=list)

    def latencies(self) -> list[float]:
        """The short requests' latencies (s): all of them, or with big requests in the phase, those
        in flight at some moment while a big one was."""
        if not self.big:
            return [end - start for start, end in self.small]
        return [end - start for start, end in self.small
                if any(start < big_end and end > big_start for big_start, big_end in self.big)]


class MemoryWatch:
    """The server's resident memory (MiB), sampled every ``interval`` seconds in a thread: the
    highest value since :meth:`reset`, and the value now."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.process = psutil.Process(pid)
        self.interval = interval
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> float:
        return self.process.memory_info().rss / 2**20

    def reset(self) -> None:
        self.peak = self.now()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.peak = max(self.peak, self.now())
            except psutil.Error:  # the server exited
                return


def start_server(args: argparse.Namespace, body_bytes: int, log: Path) -> subprocess.Popen:
    """``poolrunner serve`` on ``args.port``, once its ``/health`` answers; its log goes to ``log``."""
    options = ["--log-level", "warning", "--max-request-bytes", str(max(2 * body_bytes, 32 * MB))]
    options += ["--dtype", args.dtype] if args.dtype else []
    options += ["--model", args.model] if args.model else []
    return start_serve(options, args.port, stderr=log.open("wb"))


def big_text(sentences: list[str], megabytes: float) -> str:
    """Real sentences, repeated until the text has ``megabytes`` MB of characters (ASCII: bytes)."""
    unit = " ".join(sentences)
    repeats = int(megabytes * MB) // (len(unit) + 1) + 1
    return " ".join([unit] * repeats)[: int(megabytes * MB)]


async def run_phase(name: str, url: str, sentences: list[str], args: argparse.Namespace, *,
                    big_body: bytes = b"", big_clients: int = 0, seconds: float | None = None) -> Phase:
    """``args.clients`` closed-loop clients of short requests and the ``/health`` prober, for
    ``seconds``, or with ``big_clients``, until ``args.rounds`` rounds of ``big_clients`` big
    requests at once (each round after the last one's answers and ``args.pause`` seconds)."""
    phase = Phase(name)
    connections = args.clients + big_clients + 1
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    done = asyncio.Event()

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        async def small(number: int) -> None:
            sent = number
            while not done.is_set():
                text = sentences[sent % len(sentences)]
                sent += args.clients
                began = time.perf_counter()
                answer = await client.post("/v1/embeddings", json={"input": [text]})
                if answer.status_code != 200:
                    phase.failures.append(f"short: {answer.status_code} {answer.text[:200]}")
                else:
                    phase.small.append((began, time.perf_counter()))

        async def big() -> None:
            began = time.perf_counter()
            answer = await client.post(BIG_ROUTES[args.big_route], content=big_body,
                                       headers={"content-type": "application/json"})
            if answer.status_code != 200:
                phase.failures.append(f"big: {answer.status_code} {answer.text[:200]}")
            else:
                phase.big.append((began, time.perf_counter()))

        async def conduct() -> None:
            if big_clients:
                await asyncio.sleep(args.pause)
                for _ in range(args.rounds):
                    await asyncio.gather(*(big() for _ in range(big_clients)))
                    await asyncio.sleep(args.pause)
            else:
                await asyncio.sleep(seconds if seconds is not None else args.seconds)
            done.set()

        began = time.perf_counter()
        await asyncio.gather(conduct(), probe_health(client, done, phase), *(small(i) for i in range(args.clients)))
        phase.seconds = time.perf_counter() - began
    return phase


def percentile(values: list[float], share: float) -> float:
    """The ``share`` quantile (nearest rank) of ``values`` (s), in ms."""
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))]


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return " ".join(f"{value:.2f}" for value in os.getloadavg())


def report(phases: list[Phase], memory: dict[str, float], args: argparse.Namespace, loads: list[str]) -> None:
    print(f"CPU: {cpu_kind()}; /proc/loadavg before: {loads[0]}; after: {loads[1]}")
    print(f"{args.clients} clients of one short sentence each; big: {args.big_mb:g} MB text to "
          f"{BIG_ROUTES[args.big_route]}, truncated, {args.rounds} rounds {args.pause:g} s apart; "
          f"dtype: {args.dtype or 'the server default'}")
    print(f"{'phase':16} {'seconds':>7} {'short req':>9} {'measured':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
          f"{'health max':>10} {'big req':>7} {'big p50 ms':>10}")
    for phase in phases:
        measured = phase.latencies()
        big = f"{statistics.median(end - start for start, end in phase.big) * 1000:10.0f}" if phase.big else ""
        print(f"{phase.name:16} {phase.seconds:7.1f} {len(phase.small):9d} {len(measured):8d} "
              f"{percentile(measured, 0.5):8.1f} {percentile(measured, 0.99):8.1f} {max(measured) * 1000:8.1f} "
              f"{max(phase.health) * 1000:10.1f} {len(phase.big):7d} {big:>10}")
    base = phases[0].latencies()
    for phase in phases[1:]:
        measured = phase.latencies()
        print(f"{phase.name} / {phases[0].name}: p50 {percentile(measured, 0.5) / percentile(base, 0.5):.2f}x, "
              f"p99 {percentile(measured, 0.99) / percentile(base, 0.99):.2f}x")
    print(f"server RSS MiB: before {memory['before']:.0f}, peak {memory['peak']:.0f}, after {memory['after']:.0f} "
          f"(after / before {memory['after'] / memory['before']:.2f}x)")
    for phase in phases:
        for failure in phase.failures[:3]:
            print(f"failed in {phase.name}: {failure}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32, help="closed-loop clients of short requests")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each unloaded phase")
    parser.add_argument("--big-mb", type=float, default=15.0, help="size of the big text, MB of characters")
    parser.add_argument("--big-clients", default="1,3", help="the loaded phases: big requests at once in each")
    parser.add_argument("--rounds", type=int, default=5, help="big requests (at once) per loaded phase")
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between two rounds of big requests")
    parser.add_argument("--settle", type=float, default=3.0, help="idle seconds before reading memory after")
    parser.add_argument("--dtype", help="the server's --dtype (default: its own, auto)")
    parser.add_argument("--model", help="the server's --model (default: the default model)")
    parser.add_argument("--big-route", choices=sorted(BIG_ROUTES), default="openai",
                        help="send the big text to OpenAI's /v1/embeddings or TEI's /embed (truncate: true)")
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--json", metavar="FILE", help="also write every latency and the memory figures to FILE")
    args = parser.parse_args(argv)

    sentences = load_texts(PROFILES["paragraphs"], 400)
    body = make_big_body(big_text(sentences, args.big_mb), args.big_route)
    url = f"http://127.0.0.1:{args.port}"
    loads = [loadavg()]
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "server.log"
        server = start_server(args, len(body), log)
        watch = MemoryWatch(server.pid)
        try:
            asyncio.run(run_phase("warm-up", url, sentences, args, seconds=3.0))  # short requests only
            time.sleep(args.settle)
            memory = {"before": watch.now()}
            watch.reset()
            phases = [asyncio.run(run_phase("unloaded", url, sentences, args))]
            for count in (int(part) for part in args.big_clients.split(",") if part.strip()):
                phases.append(asyncio.run(run_phase(f"{count} x big", url, sentences, args, big_body=body,
                                                    big_clients=count)))
            memory["peak"] = watch.peak
            time.sleep(args.settle)
            memory["after"] = watch.now()
            phases.append(asyncio.run(run_phase("unloaded again", url, sentences, args)))
        finally:
            watch.close()
            server.terminate()
            server.wait(60)
            errors = log.read_text(errors="replace").strip()
    loads.append(loadavg())
    report(phases, memory, args, loads)
    if errors:
        print(f"the server's log:\n{errors[-3000:]}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "loadavg": loads, "memory_mib": memory, "args": vars(args),
            "phases": [{"name": p.name, "seconds": p.seconds, "small": p.small, "big": p.big, "health": p.health,
                        "failures": p.failures} for p in phases],
        }))
    return 1 if any(phase.failures for phase in phases) else 0


if __name__ == "__main__":
    sys.exit(main())
