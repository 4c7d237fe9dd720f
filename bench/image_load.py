"""Text requests' latency while another client embeds images: issue 28's "preprocessing must not
serialize the server", against a real ``poolrunner serve``.

    python bench/image_load.py [--clients 4] [--batch 8] [--seconds 20] [--dtype float32] [--json FILE]

Starts ``poolrunner serve`` on the ``images`` profile's CLIP folder (``clip_folder.py``, ViT-B/32's
shape, seeded) as a process of its own. ``--clients`` clients each send one short text
(``"w17 w230 w9 ..."``, 4-12 words) to ``/v1/embeddings``, wait for the answer and send the next,
through three phases of ``--seconds`` each:

* ``text alone``: those clients alone;
* ``text + images``: the same, while ``--image-clients`` more clients each send ``--batch``
  of scikit-image's photographs (PNG and JPEG files as ``data:`` URLs, decoded and preprocessed
  by the server in ``Frontend.plan``, on a worker thread) per request, in a closed loop too;
* ``text + preprocessing``: the same image requests, each with one truncated PNG after its
  images: the server decodes and preprocesses them all, then answers 400 naming the truncated
  one, so the towers never run: the load of preprocessing alone;
* ``text alone again``: to see whether the machine changed.

A further client asks ``/health`` every 20 ms throughout: its slowest answer is the longest the
event loop was blocked. Printed per phase: the text requests' count, median, p99 and maximum,
the slowest ``/health``, and the images embedded per second; then each p99 against ``text
alone``. ``text + images`` against ``text + preprocessing`` tells the two causes of a text
request's wait apart: the towers' work on images in the steps it shares or follows (batching
by design; ``--serve-option=--max-num-batched-tokens=100`` makes image steps of two images), and
the server's decoding and preprocessing (on worker threads, the GIL mostly released).

The clients run in this process, on the same cores as the server; only ratios within one quiet
run mean much (``/proc/loadavg`` is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import mimetypes
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from clip_folder import VOCAB_WORDS, clip_folder  # noqa: E402
from load import Phase, loadavg, percentile, probe_health  # noqa: E402
from profiles import image_files  # noqa: E402
from serving import cpu_kind, start_serve  # noqa: E402


def texts(count: int = 400) -> list[str]:
    """Seeded word texts of 4-12 words for the CLIP folder's WordLevel tokenizer."""
    rng = random.Random(0)
    return [" ".join(f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(rng.randint(4, 12))) for _ in range(count)]


def data_urls() -> list[str]:
    """scikit-image's PNG and JPEG files as ``data:`` URLs."""
    urls = []
    for path in map(Path, image_files()):
        kind = mimetypes.guess_type(path.name)[0]
        urls.append(f"data:{kind};base64,{base64.b64encode(path.read_bytes()).decode()}")
    return urls


def truncated_url() -> str:
    """The first half of one of the photographs' PNG files: refused ("truncated or corrupt") once
    decoded, after the images before it in its request are preprocessed."""
    data = Path(next(path for path in image_files() if path.endswith("chelsea.png"))).read_bytes()
    return "data:image/png;base64," + base64.b64encode(data[: len(data) // 2]).decode()


TRUNCATED = truncated_url()


async def run_phase(name: str, url: str, args: argparse.Namespace, images: list[str], image_clients: int, *,
                    refused: bool = False) -> tuple[Phase, int]:
    """The text clients and the ``/health`` prober (and ``image_clients`` image clients, whose
    requests end with a truncated image when ``refused``) for ``args.seconds``; the phase and
    the number of images embedded (``refused``: preprocessed)."""
    phase = Phase(name)
    words = texts()
    connections = args.clients + image_clients + 1
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    done = asyncio.Event()
    embedded = 0

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        async def text_client(number: int) -> None:
            sent = number
            while not done.is_set():
                began = time.perf_counter()
                answer = await client.post("/v1/embeddings", json={"input": [words[sent % len(words)]]})
                sent += args.clients
                if answer.status_code != 200:
                    phase.failures.append(f"text: {answer.status_code} {answer.text[:200]}")
                else:
                    phase.small.append((began, time.perf_counter()))

        async def image_client(number: int) -> None:
            nonlocal embedded
            sent = number * args.batch
            while not done.is_set():
                batch = [images[(sent + i) % len(images)] for i in range(args.batch)] + [TRUNCATED] * refused
                sent += args.batch * image_clients
                began = time.perf_counter()
                answer = await client.post("/v1/embeddings", json={"input": batch})
                if refused and answer.status_code == 400 and f"input {args.batch}" in answer.text:
                    phase.big.append((began, time.perf_counter()))
                    embedded += args.batch
                elif answer.status_code != 200:
                    phase.failures.append(f"images: {answer.status_code} {answer.text[:200]}")
                else:
                    phase.big.append((began, time.perf_counter()))
                    embedded += args.batch

        async def clock() -> None:
            await asyncio.sleep(args.seconds)
            done.set()

        began = time.perf_counter()
        await asyncio.gather(clock(), probe_health(client, done, phase), *(text_client(i) for i in range(args.clients)),
                             *(image_client(i) for i in range(image_clients)))
        phase.seconds = time.perf_counter() - began
    return phase, embedded


def latencies(phase: Phase) -> list[float]:
    """Every text request's latency (s); in a phase with images, all of them too (the image
    clients never pause, so every text request overlaps one)."""
    return [end - start for start, end in phase.small]


def report(results: list[tuple[Phase, int]], args: argparse.Namespace, loads: list[str]) -> dict:
    print(f"CPU: {cpu_kind()}; /proc/loadavg before: {loads[0]}; after: {loads[1]}")
    print(f"{args.clients} text clients (4-12 words each); {args.image_clients} image client(s) of {args.batch} "
          f"data-URL images per request; dtype: {args.dtype or 'the server default'}")
    print(f"{'phase':18} {'seconds':>7} {'text req':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'health max':>10} "
          f"{'images/s':>8} {'image req p50 ms':>16}")
    print("(images/s in text + preprocessing: images preprocessed, then refused with the truncated one)")
    summary = {}
    for phase, embedded in results:
        measured = latencies(phase)
        image_p50 = percentile([end - start for start, end in phase.big], 0.5) if phase.big else float("nan")
        row = {"requests": len(measured), "p50_ms": percentile(measured, 0.5), "p99_ms": percentile(measured, 0.99),
               "max_ms": 1000 * max(measured), "health_max_ms": 1000 * max(phase.health),
               "images_per_s": embedded / phase.seconds, "image_request_p50_ms": image_p50}
        summary[phase.name] = row
        print(f"{phase.name:18} {phase.seconds:7.1f} {row['requests']:8d} {row['p50_ms']:8.1f} {row['p99_ms']:8.1f} "
              f"{row['max_ms']:8.1f} {row['health_max_ms']:10.1f} {row['images_per_s']:8.1f} {image_p50:16.0f}")
    base = summary[results[0][0].name]
    for name, row in list(summary.items())[1:]:
        print(f"{name} / {results[0][0].name}: p50 {row['p50_ms'] / base['p50_ms']:.2f}x, "
              f"p99 {row['p99_ms'] / base['p99_ms']:.2f}x")
    for phase, _ in results:
        for failure in phase.failures[:3]:
            print(f"failed in {phase.name}: {failure}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4, help="closed-loop clients of one short text each")
    parser.add_argument("--image-clients", type=int, default=1, help="closed-loop clients of image batches")
    parser.add_argument("--batch", type=int, default=8, help="images per image request")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    parser.add_argument("--dtype", help="the server's --dtype (default: its own, auto)")
    parser.add_argument("--port", type=int, default=8732)
    parser.add_argument("--serve-option", action="append", default=[], metavar="OPTION",
                        help="one more option for poolrunner serve (repeat), e.g. --serve-option=--max-num-seqs=8")
    parser.add_argument("--json", metavar="FILE", help="also write every latency to FILE")
    args = parser.parse_args(argv)

    images = data_urls()
    url = f"http://127.0.0.1:{args.port}"
    loads = [loadavg()]
    options = ["--model", str(clip_folder()), "--log-level", "warning", "--max-request-bytes", str(64 * 2**20)]
    options += (["--dtype", args.dtype] if args.dtype else []) + args.serve_option
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "server.log"
        server = start_serve(options, args.port, stderr=log.open("wb"))
        try:
            warm = argparse.Namespace(**{**vars(args), "seconds": 3.0})
            asyncio.run(run_phase("warm-up", url, warm, images, 1))
            results = [asyncio.run(run_phase(name, url, args, images, clients, refused=refused))
                       for name, clients, refused in (("text alone", 0, False),
                                                      ("text + images", args.image_clients, False),
                                                      ("text + preprocessing", args.image_clients, True),
                                                      ("text alone again", 0, False))]
        finally:
            server.terminate()
            server.wait(60)
            errors = log.read_text(errors="replace").strip()
    loads.append(loadavg())
    summary = report(results, args, loads)
    if errors:
        print(f"the server's log:\n{errors[-3000:]}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "loadavg": loads, "args": vars(args), "summary": summary,
            "phases": [{"name": p.name, "seconds": p.seconds, "text": p.small, "images": p.big, "health": p.health,
                        "failures": p.failures} for p, _ in results]}))
    return 1 if any(phase.failures for phase, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main())
