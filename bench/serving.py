"""What the server benchmarks (``load.py``, ``multi_model.py``) share: a ``poolrunner serve``
process that answers, and the CPU kind every figure is quoted with."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
from typing import IO

import httpx


def start_serve(options: list[str], port: int, stderr: IO[bytes] | int = subprocess.DEVNULL,
                timeout: float = 300) -> subprocess.Popen:
    """``poolrunner serve --port PORT OPTIONS...``, returned once its ``/health`` answers 200.

    :raises RuntimeError: when something already listens on ``PORT`` (its answers would be taken
        for this server's: another engineer's server, on a shared machine), when the process
        exits, or when ``timeout`` seconds pass first.
    """
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"port {port} is already in use: pick another (--port)")
    command = [sys.executable, "-m", "poolrunner", "serve", "--port", str(port), *options]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{' '.join(command)} did not come up")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                time.sleep(0.5)  # a bind that failed after all ends the process: then it was not ours
                if process.poll() is None:
                    return process
        except httpx.TransportError:
            time.sleep(0.2)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def lscpu() -> dict[str, str]:
    """``lscpu``'s fields by name (empty where there is no ``lscpu``)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return {}
    return {key.strip(): value.strip() for key, value in (line.split(":", 1) for line in text.splitlines()
                                                           if ":" in line)}


def cpu_kind() -> str:
    """The CPU's name, cores and bf16 kind, e.g. ``AMD EPYC, 2 cores, AVX512-BF16, no AMX``."""
    fields = lscpu()
    flags = set(fields.get("Flags", "").split())
    bf16 = "AVX512-BF16" if "avx512_bf16" in flags else "no AVX512-BF16"
    amx = "AMX" if "amx_bf16" in flags else "no AMX"
    return f"{fields.get('Model name', platform.processor())}, {os.cpu_count()} cores, {bf16}, {amx}"
