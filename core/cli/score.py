"""``poolrunner score``: (query, document) pairs in, one relevance score each out (JSONL, CSV or
Parquet), streamed in chunks."""

from __future__ import annotations

import argparse
from typing import Any

import attrs
import numpy as np

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
    index_columns,
    input_fields,
    load_model,
    no_inputs,
    output_format,
    progress,
    read_inputs,
    request_of,
)
from poolrunner.core.files import open_output
from poolrunner.core.frontend.requests import ScoreRequest
from poolrunner.core.frontend.scoring import pair_up

FORMATS = ("jsonl", "csv", "parquet")

DESCRIPTION = """\
Score the relevance of (query, document) pairs, in pair order.

A cross-encoder (a *ForSequenceClassification model with one label) scores each pair
with its activated logit (sigmoid unless its config names another); an embedding
model (the default model too) scores the similarity of the two embeddings (a
bi-encoder): the cosine, unless its sentence-transformers folder names dot, euclidean
or manhattan as its similarity_fn_name.

input (one source):
  --query Q DOC ...          one query and N documents: N pairs (1:N)
  --query Q1 --query Q2 ...  N queries and N documents: paired in order (N:N)
  --input FILE               a pair a record, its query under --query-field and its
                             document under --document-field: JSON Lines (blank
                             lines skipped) unless the suffix says .csv (a header
                             line, then rows) or .parquet, or --input-format does;
                             '-' reads stdin; read and scored in chunks of 512

output (by the suffix of --output FILE, or --output-format; stdout: JSON Lines):
  one {"index": i, "query": ..., "document": ..., "score": s} a record (pair i):
  a line of .jsonl, a row of .csv or .parquet; the record's id follows index (its
  --id-field, else its "id" field where the input has one)."""

EPILOG = """\
examples:
  poolrunner score --query "what is a cat?" "A cat is a small feline." "Paris is in France."
  poolrunner score --model ./cross-encoder --query "q1" --query "q2" "doc for q1" "doc for q2"
  poolrunner score --model ./cross-encoder --input pairs.jsonl --output scores.jsonl"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(subparsers, "score", summary="score (query, document) pairs (cross- or bi-encoder)",
                         description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("documents", nargs="*", metavar="DOC", help="documents to score against --query")

    files = parser.add_argument_group("input and output")
    files.add_argument("-q", "--query", metavar="Q", action="append", dest="queries",
                       help="a query (repeatable: N queries for N documents)")
    add_input_option(files, "(query, document) pairs", text_field=False, default_format="jsonl")
    files.add_argument("--query-field", metavar="FIELD", default="query",
                       help="field (column) holding the query")
    files.add_argument("--document-field", metavar="FIELD", default="document",
                       help="field (column) holding the document")
    add_output_option(files, FORMATS)

    add_task_option(add_model_options(parser), "score with",
                    "the model's own default task (BGE-M3's weights need m3_embed)")
    scoring = parser.add_argument_group("scoring")
    add_plugin_request_options(scoring)
    add_truncation_options(scoring, pairs=True)
    add_lora_option(scoring)
    add_plugin_options(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Check the pairs and the output, load the model, then score and write chunk after chunk."""
    fmt = output_format(args, FORMATS)
    fields = input_fields(args, (args.query_field, "--query-field"), (args.document_field, "--document-field"))
    inputs = read_inputs(args, fields, read_pairs(args), what="pairs to score", kind="pairs",
                         argument_name="--query and DOC", default_format="jsonl")
    check_output(args.output)
    runtime = load_model(args, task=args.task)

    request = request_of(ScoreRequest, args)

    def score(pairs: list[tuple[str, str]]) -> np.ndarray:
        return runtime.execute(attrs.evolve(request, queries=[query for query, _ in pairs],
                                            documents=[document for _, document in pairs]))

    with progress("scoring", inputs) as bar, open_output(args.output, fmt) as writer:
        for chunk, scores in inputs.results(score, bar.update):
            writer.write({**index_columns(chunk, args.id_field), "query": [pair[0] for pair in chunk.values],
                          "document": [pair[1] for pair in chunk.values], "score": [float(s) for s in scores]})
        inputs.check("pairs to score")
    inputs.report()
    return 0


def read_pairs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The (query, document) pairs of ``--query`` and DOC arguments (1:N or N:N, checked as the
    runtime checks them); none with ``--input``.

    :raises CliError: for pairs both in arguments and from ``--input``, or a query without documents.
    :raises InvalidRequestError: for counts that do not pair up.
    """
    if args.input is not None:
        if args.queries or args.documents:
            raise CliError("pass pairs either as --query and DOC arguments or with --input, not both")
        return []
    if not args.queries:
        raise CliError("pass --query Q with DOC arguments, or --input FILE (JSONL pairs)")
    if not args.documents:
        raise no_inputs("documents to score", None, arguments="DOC")
    return pair_up(args.queries, args.documents)
