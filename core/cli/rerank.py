"""``poolrunner rerank``: a query and documents in, the documents ranked best first out (JSONL, CSV
or Parquet)."""

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
    input_fields,
    load_model,
    output_format,
    positive_int,
    progress,
    read_inputs,
    request_of,
)
from poolrunner.core.files import DEFAULT_ID_FIELD, open_output
from poolrunner.core.frontend.requests import ScoreRequest

FORMATS = ("jsonl", "csv", "parquet")

DESCRIPTION = """\
Rank documents by their relevance to one query, best first.

Relevance is scored as by `poolrunner score`: a cross-encoder (a
*ForSequenceClassification model with one label) gives its activated logit (sigmoid
unless its config names another), an embedding model (the default model too) the
similarity of the two embeddings (its folder's similarity_fn_name; cosine by default).

input (the query, then one source of documents):
  --query Q         the query (required)
  DOC ...           each argument is one document
  --input FILE      by its suffix (or --input-format): .jsonl, one JSON object a
                    line, the document under --text-field (blank lines are
                    skipped); .csv (a header line, then rows) or .parquet, column
                    --text-field; any other FILE: UTF-8 text, every line is one
                    document. It is scored in chunks of 512; the scores (and, with
                    --return-documents, the texts) are kept to rank them.
  --input -         stdin, as text lines

output (by the suffix of --output FILE, or --output-format; stdout: JSON Lines):
  one {"rank": r, "index": i, "score": s} a record (a line of .jsonl, a row of .csv
  or .parquet), best first (rank 1 is the best; equal scores keep input order);
  index is the document's 0-based position among the input's records; the
  record's id follows it (its --id-field, else its "id" field where the input has
  one). --return-documents adds "document": the
  document's text. --top-n N keeps the N best."""

EPILOG = """\
examples:
  poolrunner rerank --query "what is a cat?" "Paris is in France." "A cat is a small feline."
  poolrunner rerank --model ./cross-encoder --query "what is a cat?" --input docs.txt --top-n 3
  poolrunner rerank --query "q" --input docs.jsonl --text-field body --return-documents -o ranked.jsonl"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(subparsers, "rerank", summary="rank documents by relevance to a query",
                         description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("documents", nargs="*", metavar="DOC", help="documents to rank (or use --input)")

    files = parser.add_argument_group("input and output")
    files.add_argument("-q", "--query", metavar="Q", action="append", dest="queries",
                       help="the query to rank the documents for (required)")
    add_input_option(files, "documents")
    add_output_option(files, FORMATS)

    add_task_option(add_model_options(parser), "score with",
                    "the model's own default task (BGE-M3's weights need m3_embed)")

    request = parser.add_argument_group("ranking")
    request.add_argument("--top-n", metavar="N", type=positive_int,
                         help="keep the N best documents (default: all)")
    request.add_argument("--return-documents", action="store_true",
                         help='add each document\'s text to its result, as "document"')
    add_plugin_request_options(request)
    add_truncation_options(request, pairs=True)
    add_lora_option(request)

    add_plugin_options(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Check the query, documents and output, load the model, score the documents chunk after
    chunk, then write them ranked."""
    from poolrunner.core.frontend.outputs import rank  # with the tokenizers: not for --help

    if not args.queries:
        raise CliError("--query Q is required: the query to rank the documents for")
    if len(args.queries) > 1:
        raise CliError(f"rerank takes one --query, got {len(args.queries)}; "
                       "use `poolrunner score` to score N queries against N documents")
    fmt = output_format(args, FORMATS)
    inputs = read_inputs(args, input_fields(args), args.documents, what="documents to rerank", kind="documents",
                         argument_name="DOC")
    check_output(args.output)
    runtime = load_model(args, task=args.task)
    query = args.queries[0]

    request = request_of(ScoreRequest, args, sides=("query", "documents"))

    def score(documents: list[str]) -> np.ndarray:
        return runtime.execute(attrs.evolve(request, queries=query, documents=documents))

    rows: list[int] = []
    ids: list[object] = []
    documents: list[str] = []  # kept for --return-documents only
    scores: list[float] = []
    with progress("scoring", inputs) as bar:
        for chunk, chunk_scores in inputs.results(score, bar.update):
            rows += chunk.rows
            ids += chunk.ids or []
            documents += chunk.texts if args.return_documents else []
            scores += [float(value) for value in chunk_scores]
    ranked = rank(np.array(scores), documents, top_n=args.top_n, return_documents=args.return_documents)
    with open_output(args.output, fmt) as writer:
        inputs.check("documents to rerank")
        writer.write({
            "rank": list(range(1, len(ranked) + 1)), "index": [rows[result.index] for result in ranked],
            **({args.id_field or DEFAULT_ID_FIELD: [ids[result.index] for result in ranked]} if ids else {}),
            "score": [result.score for result in ranked],
            **({"document": [result.document for result in ranked]} if args.return_documents else {}),
        })
    inputs.report()
    return 0
