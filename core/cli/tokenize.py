"""``poolrunner tokenize``: texts in, each text's ``prompt_token_ids`` out (JSONL, CSV or
Parquet), as the model's requests see them; vLLM's ``/tokenize`` on the command line."""

from __future__ import annotations

import argparse
from typing import Any

import attrs

from poolrunner.core.cli.common import (
    add_command,
    add_input_option,
    add_model_options,
    add_output_option,
    add_plugin_options,
    check_device,
    check_output,
    index_columns,
    input_fields,
    load_model,
    output_format,
    progress,
    read_inputs,
    request_of,
)
from poolrunner.core.files import open_output
from poolrunner.core.frontend.requests import TokenizeRequest

FORMATS = ("jsonl", "csv", "parquet")

DESCRIPTION = """\
Tokenize texts with the model's tokenizer, as its requests are tokenized, and write
each text's token ids in input order. The model loads (its front end holds the tokenizer,
the limits and the plugins) but never runs; on the CPU in float32 unless --dtype says otherwise.

input (one source): TEXT arguments, or --input FILE as for `poolrunner embed`.

output (by the suffix of --output FILE, or --output-format; stdout: JSON Lines):
  {"index": i, "token_ids": [101, 7592, 102]} a record; the record's id follows
  index (its --id-field, else its "id" field where the input has one)."""

EPILOG = """\
examples:
  poolrunner tokenize "A cat sat."
  poolrunner tokenize --no-special-tokens --input texts.txt --output ids.jsonl"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(subparsers, "tokenize", summary="texts in, their token ids out (the model loads, never runs)",
                         description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("texts", nargs="*", metavar="TEXT", help="texts to tokenize (or use --input)")
    files = parser.add_argument_group("input and output")
    add_input_option(files, "texts")
    add_output_option(files, FORMATS)
    add_model_options(parser)
    parser.add_argument_group("tokenization").add_argument(
        "--no-special-tokens", dest="add_special_tokens", action="store_false",
        help="leave out the tokenizer's special tokens ([CLS], [SEP], BOS...)")
    add_plugin_options(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Check the input and output, load the model, then tokenize and write chunk after chunk."""
    fmt = output_format(args, FORMATS)
    inputs = read_inputs(args, input_fields(args), args.texts, what="texts to tokenize")
    check_output(args.output)
    runtime = load_model(args, **_no_precision_probe(args))
    request = request_of(TokenizeRequest, args)

    def tokenize(texts: list[str]) -> list[list[int]]:
        return runtime.execute(attrs.evolve(request, texts=texts))

    with progress("tokenizing", inputs) as bar, open_output(args.output, fmt) as writer:
        for chunk, ids in inputs.results(tokenize, bar.update):
            writer.write({**index_columns(chunk, args.id_field), "token_ids": ids})
        inputs.check("texts to tokenize")
    inputs.report()
    return 0


def _no_precision_probe(args: argparse.Namespace) -> dict[str, Any]:
    """``dtype="float32"`` where ``auto`` would choose a CPU precision by running the model on its
    probe inputs (seconds, for a model that tokenizing never runs); on CUDA ``auto`` stays, and
    its half precision with it (half the memory)."""
    from poolrunner.core.model.loader import resolve_device

    if args.dtype != "auto" or resolve_device(check_device(args.device)).type == "cuda":
        return {}
    return {"dtype": "float32"}
