"""One system, one profile, in a process of its own: ``python bench/worker.py JOB.json``.

``run.py`` starts it with the system's own interpreter (a peer may live in its own virtual
environment), so the peak resident memory it reports (``VmHWM``: load, warm-up and timed
passes) belongs to this system alone. The job file names the system, the model, the texts file
and the output folder; the worker writes ``vectors.npy`` (float32 ``[num_texts, hidden]``, from
the last timed pass) and ``result.json``.

Modes: ``throughput`` embeds ``warmup`` texts once, then all texts ``repeats`` times and records
each pass in seconds; ``latency`` embeds one text per call, ``warmup`` calls and then
``calls`` timed calls, cycling through the texts, and records each call in seconds.

When the system's ``embed`` carries ``stages`` (the ``images`` profile), the worker then times
them apart, once over all the items: ``decode_s`` (files to RGB images) and ``preprocess_s``
(images to pixel values); the rest of a pass is the towers and the system's own machinery.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from systems import SYSTEMS


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def throughput(embed, texts: list[str], job: dict) -> tuple[list[float], np.ndarray]:
    embed(texts[: job["warmup"]])
    seconds, vectors = [], None
    for _ in range(job["repeats"]):
        start = time.perf_counter()
        vectors = embed(texts)
        seconds.append(time.perf_counter() - start)
    return seconds, np.asarray(vectors, dtype=np.float32)


def latency(embed, texts: list[str], job: dict) -> tuple[list[float], None]:
    for i in range(job["warmup"]):
        embed([texts[i % len(texts)]])
    seconds = []
    for i in range(job["calls"]):
        start = time.perf_counter()
        embed([texts[i % len(texts)]])
        seconds.append(time.perf_counter() - start)
    return seconds, None


def time_stages(stages: dict, items: list) -> dict[str, float]:
    """``decode_s`` and ``preprocess_s``: one pass of each stage over ``items``."""
    start = time.perf_counter()
    decoded = stages["decode"](items)
    middle = time.perf_counter()
    stages["preprocess"](decoded)
    return {"decode_s": middle - start, "preprocess_s": time.perf_counter() - middle}


def main(job_file: str) -> None:
    job = json.loads(Path(job_file).read_text())
    out = Path(job["out_dir"])
    texts = json.loads(Path(job["texts_file"]).read_text())
    start = time.perf_counter()
    embed = SYSTEMS[job["system"]](job)
    load_s = time.perf_counter() - start
    seconds, vectors = (throughput if job["mode"] == "throughput" else latency)(embed, texts, job)
    if vectors is not None:
        np.save(out / "vectors.npy", vectors)
    result = {"seconds": seconds, "load_s": load_s, "peak_rss_mib": peak_rss_mib()}
    if job["mode"] == "throughput" and hasattr(embed, "stages"):
        result.update(time_stages(embed.stages, texts))
    (out / "result.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip teardown: vLLM's engine processes can hang there; run.py ends the rest


if __name__ == "__main__":
    main(sys.argv[1])
