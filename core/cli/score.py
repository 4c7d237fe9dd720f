"""``poolrunner score``: (query, document) pairs in, one relevance score each out (JSONL)."""

from __future__ import annotations

import argparse
from typing import Any

from poolrunner.core.cli.common import (
    CliError,
    add_command,
    add_model_options,
    add_output_option,
    add_plugin_options,
    add_truncation_options,
    check_output,
    load_runtime,
    no_inputs,
    read_jsonl,
    write_jsonl,
)
from poolrunner.core.scoring import pair_up

DESCRIPTION = """\
Score the relevance of (query, document) pairs, in pair order.

A cross-encoder (a *ForSequenceClassification model with one label) scores each pair
with its activated logit (sigmoid unless its config names another); an embedding
model (the default model too) scores the cosine similarity of the two embeddings
(a bi-encoder).

input (one source):
  --query Q DOC ...          one query and N documents: N pairs (1:N)
  --query Q1 --query Q2 ...  N queries and N documents: paired in order (N:N)
  --input FILE               JSONL, whatever FILE is named ('-' reads stdin): one
                             object a line, a pair each, its query under
                             --query-field and its document under --document-field
                             (blank lines are skipped)

output:
  JSONL, one {"index": i, "query": ..., "document": ..., "score": s} a line (pair i),
  to stdout or --output FILE."""

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
    files.add_argument("-i", "--input", metavar="FILE",
                       help="read (query, document) pairs from JSONL FILE; '-' reads stdin")
    files.add_argument("--query-field", metavar="FIELD", default="query", help="JSON field holding the query")
    files.add_argument("--document-field", metavar="FIELD", default="document",
                       help="JSON field holding the document")
    add_output_option(files)

    add_model_options(parser)
    add_truncation_options(parser.add_argument_group("scoring"), pairs=True)
    add_plugin_options(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Read the pairs, check their shape, load the model, score, write. Input errors come before loading."""
    queries, documents = read_pairs(args)
    pairs = pair_up(queries, documents)  # the runtime's own shape check, before the model loads
    check_output(args.output)
    runtime = load_runtime(args)
    scores = runtime.score(queries, documents, truncate_prompt_tokens=args.truncate,
                           truncation_side=args.truncation_side)
    write_jsonl(
        ({"index": index, "query": query, "document": document, "score": float(score)}
         for index, ((query, document), score) in enumerate(zip(pairs, scores, strict=True))),
        args.output,
    )
    return 0


def read_pairs(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The queries and the documents, from the options or from ``--input`` (then N:N)."""
    if args.input is None:
        if not args.queries:
            raise CliError("pass --query Q with DOC arguments, or --input FILE (JSONL pairs)")
        if not args.documents:
            raise no_inputs("documents to score", None, arguments="DOC")
        return args.queries, args.documents
    if args.queries or args.documents:
        raise CliError("pass pairs either as --query and DOC arguments or with --input, not both")
    rows = read_jsonl(args.input, [(args.query_field, "--query-field"), (args.document_field, "--document-field")])
    if not rows:
        raise no_inputs("pairs to score", args.input, arguments="--query and DOC", empty="records")
    return [query for query, _ in rows], [document for _, document in rows]
