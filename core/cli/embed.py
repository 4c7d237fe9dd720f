"""``poolrunner embed``: texts in (arguments, a text file, JSONL or stdin), vectors out (JSONL or .npy)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from poolrunner.core.cli.common import DISABLE_ENV, CliError, HelpFormatter, disabled_plugins, positive_int
from poolrunner.core.config import DTYPES
from poolrunner.core.errors import PoolrunnerError
from poolrunner.core.runtime import Runtime

PROGRESS_THRESHOLD = 100
"""A progress bar (stderr) is shown for more inputs than this."""

DESCRIPTION = """\
Embed texts into one vector each and write them in input order.

input (one source):
  TEXT ...          each argument is one text
  --input FILE      FILE ending in .jsonl: one JSON object a line, the text under
                    --text-field (blank lines are skipped); any other FILE:
                    UTF-8 text, every line is one text (trailing newline
                    removed; an empty line is an input too)
  --input -         stdin, as text lines

output:
  JSONL, one {"index": i, "embedding": [...]} a line, to stdout or --output FILE;
  --output FILE.npy writes a float32 numpy array [n, d] (numpy.save) instead."""

EPILOG = f"""\
examples:
  poolrunner embed "A cat sat." "A dog ran."
  poolrunner embed --input docs.jsonl --text-field body --output vectors.npy
  cat texts.txt | poolrunner embed --input - --truncate -1 > vectors.jsonl
  poolrunner embed --model ./my-model --prompt-name query "what is pooling?"

Plugins named in ${DISABLE_ENV} (comma-separated) are left out as with --disable-plugin."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "embed", help="embed texts into vectors (JSONL or .npy)", description=DESCRIPTION,
        epilog=EPILOG, formatter_class=HelpFormatter,
    )
    parser.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed (or use --input)")

    files = parser.add_argument_group("input and output")
    files.add_argument("-i", "--input", metavar="FILE",
                    help="read texts from FILE (.jsonl or plain text lines); '-' reads stdin")
    files.add_argument("--text-field", metavar="FIELD", default="text",
                    help="JSON field holding the text, for .jsonl input")
    files.add_argument("-o", "--output", metavar="FILE",
                    help="write to FILE instead of stdout; a name ending in .npy writes a "
                         "float32 numpy array [n, d]")

    model = parser.add_argument_group("model")
    model.add_argument("-m", "--model", metavar="PATH",
                       help="local model folder (default: all-MiniLM-L6-v2, shipped with poolrunner)")
    model.add_argument("--dtype", choices=DTYPES, default="auto",
                       help="weight dtype; auto is float32 on the CPU, half precision on CUDA")
    model.add_argument("--device", default="auto",
                       help="torch device, e.g. cpu, cuda, cuda:1; auto picks CUDA when present")
    model.add_argument("--is-matryoshka", action="store_true",
                       help="accept --dimensions although the model's config does not declare "
                            "Matryoshka dimensions")
    model.add_argument("--max-num-batched-tokens", "--batch-size", metavar="N", type=positive_int,
                       default=8192, dest="max_num_batched_tokens",
                       help="token budget of one forward pass")
    model.add_argument("--max-num-seqs", metavar="N", type=positive_int, default=256,
                       help="most inputs in one forward pass")

    request = parser.add_argument_group("embedding")
    request.add_argument("--dimensions", metavar="N", type=positive_int,
                         help="Matryoshka size: keep the first N dimensions (then normalize); "
                              "only for Matryoshka models")
    request.add_argument("--no-normalize", dest="normalize", action="store_const", const=False,
                         default=None, help="do not L2-normalize (default: the model's setting)")
    request.add_argument("--truncate", metavar="N", type=int,
                         help="keep N tokens of longer inputs (special tokens included); -1 keeps "
                              "the model maximum; without it a too long input is an error")
    request.add_argument("--truncation-side", choices=("left", "right"), default="right",
                         help="right keeps the start of a long input, left keeps its end")
    prompt = request.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", metavar="STR", help="literal prefix prepended to every text")
    prompt.add_argument("--prompt-name", metavar="NAME",
                        help="name of one of the model's prompts (config_sentence_transformers.json)")

    plugins = parser.add_argument_group("plugins")
    plugins.add_argument("--disable-plugin", metavar="NAME", action="append", default=[],
                         help=f"leave plugin NAME out, built-ins too (repeatable; adds to ${DISABLE_ENV})")
    plugins.add_argument("--no-entrypoints", dest="load_entrypoints", action="store_false",
                         help="do not load installed third-party plugins (entry points)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Read the texts, load the model, embed, write. Input and option errors come before loading."""
    texts = read_texts(args.texts, args.input, args.text_field)
    if not texts:
        source = f" ({args.input} has no lines)" if args.input else ""
        raise CliError(f"no texts to embed{source}; pass TEXT arguments or --input FILE "
                       "(--input - reads stdin)")
    device = _check_device(args.device)
    if args.output not in (None, "-"):
        _check_writable(Path(args.output))
    try:
        runtime = Runtime(
            model=args.model, dtype=args.dtype, device=device,
            load_entrypoints=args.load_entrypoints, disable_plugins=disabled_plugins(args.disable_plugin),
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            is_matryoshka=True if args.is_matryoshka else None,
        )
    except PoolrunnerError:
        raise  # ModelLoadError and friends: main() reports them
    except ValueError as exc:  # a plain ValueError from core is a bad setting (an unknown plugin name)
        raise CliError(str(exc)) from exc
    vectors = runtime.embed(
        texts, dimensions=args.dimensions, normalize=args.normalize,
        truncate_prompt_tokens=args.truncate, truncation_side=args.truncation_side,
        prompt=args.prompt, prompt_name=args.prompt_name,
        show_progress_bar=len(texts) > PROGRESS_THRESHOLD,
    )
    write_vectors(vectors, args.output)
    return 0


def read_texts(texts: list[str], source: str | None, text_field: str = "text") -> list[str]:
    """The texts to embed: the arguments, or the lines of ``source`` (see the command's help).

    :raises CliError: for both sources at once, an unreadable file, or a bad JSONL line
        (named as ``FILE:LINE``).
    """
    if source is None:
        return list(texts)
    if texts:
        raise CliError("pass texts either as arguments or with --input, not both")
    if source == "-":
        return list(_text_lines(sys.stdin))
    path = Path(source)
    try:
        with path.open(encoding="utf-8-sig") as file:
            if path.suffix.lower() == ".jsonl":
                return list(_jsonl_texts(file, source, text_field))
            return list(_text_lines(file))
    except FileNotFoundError:
        raise CliError(f"input file {source!r} does not exist") from None
    except UnicodeDecodeError as exc:
        raise CliError(f"input file {source!r} is not UTF-8 text: {exc}") from None
    except OSError as exc:
        raise CliError(f"cannot read input file {source!r}: {exc.strerror or exc}") from None


def _text_lines(file: IO[str]) -> Iterator[str]:
    for line in file:
        yield line.removesuffix("\n")


def _jsonl_texts(file: IO[str], name: str, field: str) -> Iterator[str]:
    for number, line in enumerate(file, start=1):
        if not line.strip():
            continue
        where = f"{name}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CliError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})") from None
        if not isinstance(record, dict):
            raise CliError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if field not in record:
            fields = ", ".join(repr(key) for key in record) or "none"
            raise CliError(f"{where}: no field {field!r} (fields: {fields}); pick one with --text-field")
        value = record[field]
        if not isinstance(value, str):
            raise CliError(f"{where}: field {field!r} is {type(value).__name__}, not a string")
        yield value


def write_vectors(vectors: np.ndarray, output: str | None) -> None:
    """JSONL to stdout or ``output``, or a float32 ``.npy`` array when ``output`` ends in ``.npy``."""
    if output is None or output == "-":
        _write_jsonl(vectors, sys.stdout)
        sys.stdout.flush()
        return
    try:
        if output.lower().endswith(".npy"):
            with open(output, "wb") as file:
                np.save(file, np.asarray(vectors, dtype=np.float32))
        else:
            with open(output, "w", encoding="utf-8") as file:
                _write_jsonl(vectors, file)
    except OSError as exc:
        raise CliError(f"cannot write output file {output!r}: {exc.strerror or exc}") from None


def _write_jsonl(vectors: np.ndarray, file: IO[str]) -> None:
    for index, vector in enumerate(vectors):
        file.write(json.dumps({"index": index, "embedding": vector.tolist()}) + "\n")


def _check_device(device: str) -> str:
    if device == "auto":
        return device
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise CliError(f"--device {device!r} is not a torch device (try cpu, cuda or cuda:0)") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device {device!r} asks for CUDA, but no CUDA device is available; use cpu")
    return device


def _check_writable(path: Path) -> None:
    if path.is_dir():
        raise CliError(f"output {str(path)!r} is a directory; name a file")
    if not path.parent.is_dir():
        raise CliError(f"cannot write output file {str(path)!r}: folder {str(path.parent)!r} does not exist")
