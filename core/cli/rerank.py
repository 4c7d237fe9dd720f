"""``poolrunner rerank``: a query and documents in, the documents ranked best first out (JSONL)."""

from __future__ import annotations

import argparse
from typing import Any

from poolrunner.core.cli.common import (
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
)

DESCRIPTION = """\
Rank documents by their relevance to one query, best first.

Relevance is scored as by `poolrunner score`: a cross-encoder (a
*ForSequenceClassification model with one label) gives its activated logit (sigmoid
unless its config names another), an embedding model (the default model too) the
cosine similarity of the two embeddings.

input (the query, then one source of documents):
  --query Q         the query (required)
  DOC ...           each argument is one document
  --input FILE      FILE ending in .jsonl: one JSON object a line, the document
                    under --text-field (blank lines are skipped); any other FILE:
                    UTF-8 text, every line is one document
  --input -         stdin, as text lines

output:
  JSONL, one {"rank": r, "index": i, "score": s} a line, best first (rank 1 is the
  best; equal scores keep input order), to stdout or --output FILE; index is the
  document's 0-based position in the input. --return-documents adds "document": the
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
    add_output_option(files)

    add_model_options(parser)

    request = parser.add_argument_group("ranking")
    request.add_argument("--top-n", metavar="N", type=positive_int,
                         help="keep the N best documents (default: all)")
    request.add_argument("--return-documents", action="store_true",
                         help='add each document\'s text to its result, as "document"')
    add_truncation_options(request, pairs=True)

    add_plugin_options(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Read the query and documents, load the model, rank, write. Input errors come before loading."""
    if not args.queries:
        raise CliError("--query Q is required: the query to rank the documents for")
    if len(args.queries) > 1:
        raise CliError(f"rerank takes one --query, got {len(args.queries)}; "
                       "use `poolrunner score` to score N queries against N documents")
    documents = read_texts(args.documents, args.input, args.text_field, what="documents")
    if not documents:
        raise no_inputs("documents to rerank", args.input, arguments="DOC")
    check_output(args.output)
    runtime = load_runtime(args)
    results = runtime.rerank(
        args.queries[0], documents, top_n=args.top_n, return_documents=args.return_documents,
        truncate_prompt_tokens=args.truncate, truncation_side=args.truncation_side,
    )
    write_jsonl(
        ({"rank": rank, "index": result.index, "score": result.score}
         | ({"document": result.document} if args.return_documents else {})
         for rank, result in enumerate(results, start=1)),
        args.output,
    )
    return 0
