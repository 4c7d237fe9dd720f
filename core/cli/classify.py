"""``poolrunner classify``: texts (or text pairs) in, label scores out (JSONL, CSV or Parquet),
streamed in chunks."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
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
    add_truncation_options,
    check_output,
    index_columns,
    input_fields,
    load_model,
    output_format,
    progress,
    read_inputs,
    request_of,
)
from poolrunner.core.files import Chunk, open_output
from poolrunner.core.frontend.requests import ClassifyRequest
from poolrunner.core.frontend.results import ClassificationResult

FORMATS = ("jsonl", "csv", "parquet")

DESCRIPTION = """\
Classify texts (or text pairs) with a sequence-classification model and write the
scores of every label, in input order. The model must support the classify task
(a *ForSequenceClassification folder); the default model does not.

input (one source):
  TEXT ...          each argument is one text
  --input FILE      by its suffix (or --input-format): .jsonl, one JSON object a
                    line, the text under --text-field (blank lines are skipped);
                    .csv (a header line, then rows) or .parquet, column
                    --text-field; any other FILE: UTF-8 text, every line is one text
  --input -         stdin, as text lines
  --pair-field F    pair classifiers: each record of --input (JSON Lines unless its
                    suffix or --input-format says .csv or .parquet, stdin too) is
                    one (text, text_pair) pair, the pair under field F, tokenized
                    together as the model pairs them
  A file is read and classified in chunks of 512 records.

output (by the suffix of --output FILE, or --output-format; stdout: JSON Lines):
  one object a record (.jsonl), or a row (.csv: maps as JSON; .parquet: a struct):
    {"index": i, "label": "pos", "score": 0.91, "probs": {"neg": 0.02, "neu": 0.07, "pos": 0.91}}
  index is the record's 0-based position among the file's records; the record's
  id follows it (its --id-field, else its "id" field where the input has one).
  label is the best label, score its value; probs holds every label (the model's
  id2label names, in label order) after the model's activation: softmax over two or
  more labels, sigmoid for one label (a cross-encoder) or a multi-label model, or the
  activation a sentence-transformers config names. With --raw-logits the map is
  "logits" instead of "probs", and score is the highest logit."""

EPILOG = """\
examples:
  poolrunner classify --model ./sentiment "I loved it." "Meh."
  poolrunner classify --model ./sentiment --input reviews.jsonl --text-field body -o labels.jsonl
  poolrunner classify --model ./nli --input pairs.jsonl --text-field premise --pair-field hypothesis
  poolrunner classify --model ./sentiment --raw-logits "I loved it.\""""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(subparsers, "classify", summary="score texts or text pairs over a classifier's labels",
                         description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("texts", nargs="*", metavar="TEXT", help="texts to classify (or use --input)")

    files = parser.add_argument_group("input and output")
    add_input_option(files, "texts")
    files.add_argument("--pair-field", metavar="FIELD",
                       help="field (column) holding each record's text_pair: classify (text, text_pair) pairs "
                            "from --input, read as JSON Lines unless its suffix or --input-format says otherwise")
    add_output_option(files, FORMATS)

    add_model_options(parser)

    request = parser.add_argument_group("classification")
    request.add_argument("--raw-logits", action="store_true",
                         help='write the raw logits (as "logits") instead of probabilities')
    add_truncation_options(request)
    add_lora_option(request)

    add_plugin_options(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Check the input and output, load the model for classify, then classify and write chunk after chunk."""
    fmt = output_format(args, FORMATS)
    if args.pair_field is not None and args.input is None:
        raise CliError("--pair-field needs --input FILE: JSONL rows holding the text (--text-field) "
                       "and its pair (--pair-field)")
    pairs = () if args.pair_field is None else ((args.pair_field, "--pair-field"),)
    inputs = read_inputs(args, input_fields(args, (args.text_field, "--text-field"), *pairs), args.texts,
                         what="texts to classify", default_format="text" if args.pair_field is None else "jsonl")
    check_output(args.output)
    runtime = load_model(args, task="classify")

    request = request_of(ClassifyRequest, args, use_activation=False if args.raw_logits else None)

    def classify(items: list[Any]) -> list[ClassificationResult]:
        return runtime.execute(attrs.evolve(request, inputs=items))

    with progress("classifying", inputs) as bar, open_output(args.output, fmt) as writer:
        for chunk, results in inputs.results(classify, bar.update):
            writer.write(columns(chunk, results, "logits" if args.raw_logits else "probs", args.id_field))
        inputs.check("texts to classify")
    inputs.report()
    return 0


def columns(chunk: Chunk, results: Sequence[ClassificationResult], key: str,
            id_field: str | None) -> dict[str, list[Any]]:
    """The output columns of a chunk's :class:`~poolrunner.core.frontend.results.ClassificationResult` objects:
    index, the id, the best label and its score, and every label's value under ``key``."""
    values = [[float(value) for value in result.probs] for result in results]
    return {**index_columns(chunk, id_field), "label": [result.label for result in results],
            "score": [max(row) for row in values],
            key: [dict(zip(result.labels, row, strict=True)) for result, row in zip(results, values, strict=True)]}
