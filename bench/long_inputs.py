"""Long inputs: how time and memory grow from 512 to 8,192 tokens on 8k-context encoders.

    python bench/long_inputs.py [--models modernbert,nomic] [--lengths 512,2048,8192]
                                [--systems poolrunner,sentence-transformers] [--dtype float32]

Models (seeded random weights, built once into ``$POOLRUNNER_CACHE`` or ``~/.cache/poolrunner``;
same shapes, so the same FLOPs and memory, as the real checkpoints, which do not install offline):

* ``modernbert``: ModernBERT-base's shape (transformers' ``ModernBertConfig()`` defaults: 22
  layers of 768, 12 heads, GeGLU MLP of 1,152, every third layer global, the others over a local
  window of 128 tokens; 8,192 positions);
* ``nomic``: nomic-embed-text-v1.5's (``NomicBertConfig()``: 12 layers of 768, 12 heads, SwiGLU
  of 3,072, rotary positions), with 8,192 positions.

Both have MEAN pooling in sentence-transformers' files (``modules.json``, ``1_Pooling``), a
byte-level BPE tokenizer of 500 words (the tests' own), and are fed token ids: ``--texts`` inputs
of each length, ``<s>`` + seeded ids + ``</s>``.

Each (model, length, system) runs in a process of its own (``--worker``), so its peak resident
memory (``VmHWM``) is its own: load, one warm-up input of 128 tokens, then ``--repeats`` timed
passes over the inputs, one input per call. Systems: ``poolrunner`` (``Runtime.embed`` of
token-id lists), ``sentence-transformers`` (the model's ``forward`` on ``input_ids`` and
``attention_mask``, its own transformers modules with SDPA attention, then its pooling: what
``encode`` runs after the tokenizer) and ``vllm`` (its offline ``LLM.embed`` of
``prompt_token_ids``, MEAN pooling, its engine in the worker's process so that the memory is all
of it, in its own environment under ``bench/.peers/``, built on first use). Printed per row:
tokens/s (median pass), GFLOP/s by the FLOP model below, peak MiB, *work MiB* (peak minus
resident memory after the load: what the passes added), and the cosine of each system's vectors
to sentence-transformers' in the same run.

FLOP model per token of an ``L``-token input: ``2 * in * out`` per linear layer, plus ``4 *
hidden * K`` per layer for attention (``q.k`` and ``p.v``), ``K = L`` for a global layer and ``K
= min(L, window + 1)`` for a local one. Work memory linear in ``L`` means ``work MiB`` grows 4x
from 2,048 to 8,192 tokens; quadratic would be 16x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # tests.models.architectures: the tokenizer
RECIPE_VERSION = 1
SEED = 0
BOS, EOS, PAD = 0, 2, 1
WORDS = (5, 500)  # the tokenizer's word ids


def config_for(name: str):
    from transformers import ModernBertConfig, NomicBertConfig

    special = {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}
    if name == "modernbert":
        return ModernBertConfig(**special, cls_token_id=BOS, sep_token_id=EOS, classifier_pooling="mean")
    return NomicBertConfig(**special, max_position_embeddings=8192)


def cache_root() -> Path:
    return Path(os.environ.get("POOLRUNNER_CACHE") or Path.home() / ".cache" / "poolrunner")


def model_folder(name: str) -> Path:
    """The seeded folder of ``name``, built on first use (into a temporary folder, then renamed)."""
    folder = cache_root() / f"bench-long-{name}-seed{SEED}-v{RECIPE_VERSION}"
    if (folder / ".complete").exists():
        return folder
    import torch
    from transformers import AutoModel

    from tests.models.architectures import make_tokenizer

    cache_root().mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=cache_root(), prefix=f".{folder.name}-"))
    torch.manual_seed(SEED)
    AutoModel.from_config(config_for(name)).eval().save_pretrained(scratch)
    make_tokenizer().save_pretrained(scratch)
    (scratch / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (scratch / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8192, "do_lower_case": False}))
    (scratch / "1_Pooling").mkdir()
    (scratch / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 768, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
    (scratch / ".complete").write_text("1")
    os.replace(scratch, folder)
    return folder


def inputs(length: int, count: int) -> list[list[int]]:
    import random

    rng = random.Random(length)
    return [[BOS, *(rng.randrange(*WORDS) for _ in range(length - 2)), EOS] for _ in range(count)]


def flops_per_token(config: dict, length: int) -> float:
    """The FLOP model of the docstring, from ``config.json``'s fields."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    inner = config["intermediate_size"]
    if config["model_type"] == "modernbert":  # Wqkv, Wo; Wi (GeGLU: 2 x inner), Wo
        linear = 2 * (hidden * 3 * hidden + hidden * hidden + hidden * 2 * inner + inner * hidden)
        # local layers: keys within local_attention / 2 positions either side
        window = config["local_attention"] + 1
        keys = [length if kind == "full_attention" else min(length, window) for kind in config["layer_types"]]
    else:  # NomicBERT: Wqkv, out_proj; fc11, fc12 (SwiGLU), fc2
        linear = 2 * (hidden * 3 * hidden + hidden * hidden + 2 * hidden * inner + inner * hidden)
        keys = [length] * layers
    return linear * layers + sum(4 * hidden * k for k in keys)


# ---------------------------------------------------------------------------- worker


def rss_mib() -> tuple[float, float]:
    """(resident now, peak resident) of this process, MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def embedder(system: str, folder: str, dtype: str, scratch: Path):
    import numpy as np
    import torch

    if system == "poolrunner":
        from poolrunner import Runtime, RuntimeConfig

        runtime = Runtime.from_config(RuntimeConfig(model=folder, dtype=dtype, load_entrypoints=False))
        return lambda ids: np.asarray(runtime.embed([ids]))[0]
    if system == "vllm":  # its offline LLM, in its own environment (bench/peers.py), fed the same ids
        from vllm import LLM
        from vllm.config import PoolerConfig

        llm = LLM(model=vllm_folder(folder, scratch), runner="pooling", dtype=dtype, max_model_len=8192, seed=0,
                  pooler_config=PoolerConfig(pooling_type="MEAN"))
        return lambda ids: np.asarray(llm.embed([{"prompt_token_ids": ids}], use_tqdm=False)[0].outputs.embedding)
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(folder, device="cpu", model_kwargs={"dtype": getattr(torch, dtype),
                                                                     "attn_implementation": "sdpa"})

    @torch.inference_mode()
    def embed(ids: list[int]) -> np.ndarray:
        features = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        return model.forward(features)["sentence_embedding"][0].float().numpy()

    return embed


NOMIC_ORIGINAL_FIELDS = {
    "activation_function": "swiglu", "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False,
    "rotary_emb_scale_base": None, "rotary_emb_interleaved": False,
}
"""What nomic's own config.json (``trust_remote_code``) has and transformers' NomicBertConfig
lacks; vLLM's NomicBertModel reads these (and ``n_embd``, ``n_layer``, ``n_inner``, ``layer_norm_epsilon``)."""


def vllm_folder(folder: str, scratch: Path) -> str:
    """``folder`` as vLLM reads it: for the NomicBERT model, a view of it in ``scratch`` (links to
    its files) whose config.json also has nomic's original fields; the weights already use nomic's names."""
    config = json.loads((Path(folder) / "config.json").read_text())
    if config["model_type"] != "nomic_bert":
        return folder
    view = scratch / "vllm-view"
    view.mkdir()
    for item in Path(folder).iterdir():
        if item.name != "config.json":
            (view / item.name).symlink_to(item)
    config |= NOMIC_ORIGINAL_FIELDS | {"n_embd": config["hidden_size"], "n_layer": config["num_hidden_layers"],
                                       "n_inner": config["intermediate_size"],
                                       "layer_norm_epsilon": config["layer_norm_eps"]}
    (view / "config.json").write_text(json.dumps(config))
    return str(view)


def worker(job: dict) -> dict:
    import numpy as np

    texts = inputs(job["length"], job["texts"])
    embed = embedder(job["system"], job["folder"], job["dtype"], Path(job["result"]).parent)
    loaded = rss_mib()[0]
    embed(texts[0][:128])  # warm-up: kernels; the timed passes' own allocations stay in the peak
    seconds, vectors = [], []
    for _ in range(job["repeats"]):
        start = time.perf_counter()
        vectors = [embed(ids) for ids in texts]
        seconds.append(time.perf_counter() - start)
    now, peak = rss_mib()
    np.save(job["vectors"], np.stack(vectors).astype(np.float32))
    return {"seconds": seconds, "loaded_mib": loaded, "peak_mib": peak}


# ---------------------------------------------------------------------------- driver


def run_job(job: dict, timeout: float) -> dict:
    """``job`` in a worker process: this interpreter's, or a peer's own (bench/peers.py)."""
    from peers import PEERS, setup

    python, extra = sys.executable, {}
    if job["system"] in PEERS:
        peer = PEERS[job["system"]]
        if (problem := setup(peer)) is not None:
            return {"error": problem}
        # vLLM's engine in this process (not its own): the peak memory measured is then all of it
        python, extra = str(peer.python), {**peer.env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with tempfile.TemporaryDirectory() as scratch:
        job = {**job, "vectors": f"{scratch}/vectors.npy", "result": f"{scratch}/result.json"}
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **extra}
        try:
            done = subprocess.run([python, __file__, "--worker", json.dumps(job)], capture_output=True,
                                  text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"over {timeout:g} s"}
        if done.returncode:
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
            return {"error": f"exit {done.returncode}: {(lines or ['no output'])[-1][:200]}"}
        import numpy as np

        result = json.loads(Path(job["result"]).read_text())  # a file: vLLM writes its own lines to stdout
        result["vectors"] = np.load(job["vectors"])
        return result


def cosine(a, b) -> float:
    import numpy as np

    a, b = a / np.linalg.norm(a, axis=1, keepdims=True), b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a * b).sum(1).min())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="modernbert,nomic")
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--systems", default="poolrunner,sentence-transformers",
                        help="poolrunner, sentence-transformers, vllm (its environment is built on first use)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--texts", type=int, default=2, help="inputs of each length (one per call)")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes; the median is shown")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        job = json.loads(args.worker)
        Path(job["result"]).write_text(json.dumps(worker(job)))
        return 0

    sys.path.insert(0, str(BENCH))
    from serving import cpu_kind

    print(f"machine: {cpu_kind()}; load average {os.getloadavg()[0]:.1f}; {args.dtype}; {args.texts} input(s) per "
          f"length, one per call; {args.repeats} timed passes")
    print("| model | tokens | system | tokens/s | GFLOP/s | peak MiB | work MiB | work / previous length | min cos |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        folder = model_folder(name)
        config = json.loads((folder / "config.json").read_text())
        previous: dict[str, float] = {}
        for length in (int(n) for n in args.lengths.split(",")):
            results = {}
            for system in args.systems.split(","):
                job = {"system": system, "folder": str(folder), "dtype": args.dtype, "length": length,
                       "texts": args.texts, "repeats": args.repeats}
                results[system] = run_job(job, args.timeout)
            reference = results.get("sentence-transformers", {})
            for system, result in results.items():
                if "error" in result:
                    print(f"| {name} | {length} | {system} | not run: {result['error']} | | | | | |", flush=True)
                    continue
                tokens_s = length * args.texts / statistics.median(result["seconds"])
                work = result["peak_mib"] - result["loaded_mib"]
                growth = f"{work / previous[system]:.1f}x" if previous.get(system) else ""
                previous[system] = work
                cos = ""
                if system != "sentence-transformers" and "vectors" in reference:
                    cos = f"{cosine(result['vectors'], reference['vectors']):.5f}"
                print(f"| {name} | {length} | {system} | {tokens_s:,.0f} | "
                      f"{tokens_s * flops_per_token(config, length) / 1e9:,.0f} | {result['peak_mib']:,.0f} | "
                      f"{work:,.0f} | {growth} | {cos} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
