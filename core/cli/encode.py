"""``poolrunner encode``: any task the model serves, raw per-input results out (JSONL, CSV, Parquet
or .npz), streamed in chunks."""

from __future__ import annotations

import argparse
from typing import Any

import attrs

from poolrunner.core.cli.common import (
    CliError,
    add_command,
    add_input_option,
    add_lora_option,
    add_model_options,
    add_output_option,
    add_plugin_options,
    add_plugin_request_options,
    add_task_option,
    add_truncation_options,
    check_output,
    flag_values,
    index_columns,
    input_fields,
    load_model,
    output_format,
    positive_int,
    progress,
    read_inputs,
    request_of,
)
from poolrunner.core.cli.ray_job import EPILOG as RAY_EPILOG
from poolrunner.core.cli.ray_job import add_ray_options, run_ray
from poolrunner.core.files import open_output
from poolrunner.core.frontend.requests import EncodeRequest

__all__ = ["add_parser", "run"]

FORMATS = ("jsonl", "csv", "parquet", "npz")

DESCRIPTION = """\
Run any task the model serves and write each input's result in input order.

results per input (float32 unless said otherwise):
  embed                 [d]                       one vector
  classify              [num_labels]              probabilities (or --raw-logits)
  token_embed           [num_tokens, hidden]      one vector per token
  token_classify        [num_tokens, num_labels]  per-token probabilities; with
                        --step-tag-id only the rows of that token ([num_tags, n]);
                        BGE-M3's sparse_linear.pt: [n] weights, BOS and EOS left out
  embed&token_classify  {"embedding": [hidden], "token_weights": [n]}
  a plugin's task       as the plugin says, e.g. sparse_embed (poolrunner-splade):
                        {"token_ids": [k] int64, "weights": [k]}

input: TEXT arguments, or --input FILE (.jsonl, .csv or .parquet with --text-field,
else text lines; or --input-format), read and run in chunks of 512 records.

output (by the suffix of --output FILE, or --output-format; stdout: JSON Lines):
  .jsonl    one {"index": i, "task": ..., "output": ...} a line (nested lists)
  .csv      columns index, task, output (JSON)
  .parquet  columns index, task, output (list columns; a struct for named outputs)
  .npz      a numpy archive, one array per input named "<index>" (or
            "<index>/<name>" for named outputs)
  index is the record's 0-based position among the file's records; the record's
  id follows it (its --id-field, else its "id" field where the input has one;
  not in .npz)."""

EPILOG = """\
examples:
  poolrunner encode --task token_embed "A cat sat." --output tokens.npz
  poolrunner encode --model ./splade --task sparse_embed --option top_k=20 "A cat sat."
  poolrunner encode --model ./ner-model --task token_classify --input texts.txt
  poolrunner encode --model ./prm --task token_classify --step-tag-id 12902 --returned-token-ids 0 1 "step 1 ..."\
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(subparsers, "encode", summary="run any task; per-input arrays (JSONL, CSV, Parquet, .npz)",
                         description=DESCRIPTION, epilog=f"{EPILOG}\n\n{RAY_EPILOG}")
    parser.add_argument("texts", nargs="*", metavar="TEXT", help="inputs (or use --input)")
    files = parser.add_argument_group("input and output")
    add_input_option(files, "inputs")
    add_output_option(files, FORMATS, "; .npz: a numpy archive of one array per input")

    model = add_model_options(parser)
    add_task_option(model, "run")
    model.add_argument("--is-matryoshka", action="store_true",
                       help="accept --dimensions although the model's config does not declare it")

    request = parser.add_argument_group("task options")
    request.add_argument("--dimensions", metavar="N", type=positive_int,
                         help="Matryoshka size (embed; per token for token_embed)")
    normalize = request.add_mutually_exclusive_group()
    normalize.add_argument("--normalize", dest="normalize", action="store_const", const=True, default=None,
                           help="L2-normalize (per token for token_embed, where it is off by default)")
    normalize.add_argument("--no-normalize", dest="normalize", action="store_const", const=False,
                           help="do not L2-normalize")
    request.add_argument("--raw-logits", dest="use_activation", action="store_const", const=False, default=None,
                         help="classify / token_classify: raw logits instead of probabilities")
    request.add_argument("--step-tag-id", metavar="ID", type=int,
                         help="STEP pooling (token_classify): keep only rows whose token is ID")
    request.add_argument("--returned-token-ids", metavar="ID", type=int, nargs="+",
                         help="STEP pooling: keep only these label columns")
    add_plugin_request_options(request)
    add_truncation_options(request)
    add_lora_option(request)
    add_plugin_options(parser)
    add_ray_options(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Check the input and output, load the model, then encode and write chunk after chunk."""
    request = request_of(EncodeRequest, args)  # checked before anything is read or loaded
    if args.ray is not None:
        return run_ray(args, args.task, flag_values(EncodeRequest, args, "task"))
    if args.output_format is None and args.output and args.output.lower().endswith(".npy"):
        raise CliError("encode results are ragged: write .npz or JSONL, not .npy")
    fmt = output_format(args, FORMATS)
    if fmt == "npz" and args.id_field is not None:
        raise CliError("--id-field: a .npz archive holds the arrays only; write .jsonl, .csv or .parquet to keep ids")
    inputs = read_inputs(args, input_fields(args), args.texts, what="inputs to encode", kind="inputs")
    check_output(args.output)
    runtime = load_model(args, task=args.task, is_matryoshka=True if args.is_matryoshka else None)

    def encode(texts: list[str]) -> list[Any]:
        return runtime.execute(attrs.evolve(request, inputs=texts))

    with progress("encoding", inputs) as bar, open_output(args.output, fmt, column="output") as writer:
        for chunk, results in inputs.results(encode, bar.update):
            writer.write({**index_columns(chunk, args.id_field), "task": [runtime.task] * len(chunk),
                          "output": results})
        inputs.check("inputs to encode")
    inputs.report()
    return 0
