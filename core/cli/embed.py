"""``poolrunner embed``: texts in (arguments, a text file, JSONL or stdin), vectors out (JSONL or .npy)."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from poolrunner.core.cli.common import (
    PROGRESS_THRESHOLD,
    CliError,
    add_command,
    add_input_option,
    add_model_options,
    add_output_option,
    add_plugin_options,
    add_truncation_options,
    check_output,
    load_runtime,
    no_inputs,
    positive_int,
    read_texts,
    write_jsonl,
    write_output,
)
from poolrunner.core.cli.ray_job import EPILOG as RAY_EPILOG
from poolrunner.core.cli.ray_job import add_ray_options, run_ray
from poolrunner.core.quantize import PRECISIONS

__all__ = ["add_parser", "run", "write_vectors"]

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

EPILOG = """\
examples:
  poolrunner embed "A cat sat." "A dog ran."
  poolrunner embed --input docs.jsonl --text-field body --output vectors.npy
  cat texts.txt | poolrunner embed --input - --truncate -1 > vectors.jsonl
  poolrunner embed --model ./my-model --prompt-name query "what is pooling?\""""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(subparsers, "embed", summary="embed texts into vectors (JSONL or .npy)",
                         description=DESCRIPTION, epilog=f"{EPILOG}\n\n{RAY_EPILOG}")
    parser.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed (or use --input)")

    files = parser.add_argument_group("input and output")
    add_input_option(files, "texts")
    add_output_option(files, "; a name ending in .npy writes a numpy array [n, d] (float32, or --precision's dtype)")

    model = add_model_options(parser)
    model.add_argument("--is-matryoshka", action="store_true",
                       help="accept --dimensions although the model's config does not declare "
                            "Matryoshka dimensions")

    request = parser.add_argument_group("embedding")
    request.add_argument("--dimensions", metavar="N", type=positive_int,
                         help="Matryoshka size: keep the first N dimensions (then normalize); "
                              "only for Matryoshka models")
    request.add_argument("--no-normalize", dest="normalize", action="store_const", const=False,
                         default=None, help="do not L2-normalize (default: the model's setting)")
    request.add_argument("--precision", choices=PRECISIONS, default="float32",
                         help="sentence-transformers' quantization after --dimensions and normalization: int8 / "
                              "uint8 calibrate each dimension's range on all the inputs of the run; binary / "
                              "ubinary pack one bit per dimension (.npy keeps the dtype)")
    add_truncation_options(request)
    prompt = request.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", metavar="STR", help="literal prefix prepended to every text")
    prompt.add_argument("--prompt-name", metavar="NAME",
                        help="name of one of the model's prompts (config_sentence_transformers.json)")

    add_plugin_options(parser)
    add_ray_options(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Read the texts, load the model, embed, write. Input and option errors come before loading."""
    if args.ray is not None:
        if args.precision != "float32":
            raise CliError("--precision runs on one machine only: a --ray job writes float32 vectors")
        return run_ray(args, "embed", {
            "dimensions": args.dimensions, "normalize": args.normalize, "truncate_prompt_tokens": args.truncate,
            "truncation_side": args.truncation_side, "prompt": args.prompt, "prompt_name": args.prompt_name,
        })
    texts = read_texts(args.texts, args.input, args.text_field)
    if not texts:
        raise no_inputs("texts to embed", args.input)
    check_output(args.output)
    runtime = load_runtime(args, task="embed", is_matryoshka=True if args.is_matryoshka else None)
    vectors = runtime.embed(
        texts, dimensions=args.dimensions, normalize=args.normalize,
        truncate_prompt_tokens=args.truncate, truncation_side=args.truncation_side,
        prompt=args.prompt, prompt_name=args.prompt_name, precision=args.precision,
        show_progress_bar=len(texts) > PROGRESS_THRESHOLD,
    )
    write_vectors(vectors, args.output)
    return 0


def write_vectors(vectors: np.ndarray, output: str | None) -> None:
    """JSONL to stdout or ``output``, or a ``.npy`` array in the vectors' dtype (float32, or a
    quantized precision's int8 / uint8) when ``output`` ends in ``.npy``."""
    if output is not None and output != "-" and output.lower().endswith(".npy"):
        write_output(output, lambda file: np.save(file, vectors), binary=True)
        return
    write_jsonl(({"index": index, "embedding": vector.tolist()} for index, vector in enumerate(vectors)), output)
