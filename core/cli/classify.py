"""``poolrunner classify``: texts (or text pairs) in, label scores out (JSONL)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

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
    read_jsonl,
    read_texts,
    write_jsonl,
)

DESCRIPTION = """\
Classify texts (or text pairs) with a sequence-classification model and write the
scores of every label, in input order. The model must support the classify task
(a *ForSequenceClassification folder); the default model does not.

input (one source):
  TEXT ...          each argument is one text
  --input FILE      FILE ending in .jsonl: one JSON object a line, the text under
                    --text-field (blank lines are skipped); any other FILE:
                    UTF-8 text, every line is one text
  --input -         stdin, as text lines
  --pair-field F    pair classifiers: each JSON object of --input (read as JSONL,
                    whatever its name, stdin too) is one (text, text_pair) pair,
                    the pair under field F, tokenized together as the model pairs them

output:
  JSONL, one object a line, to stdout or --output FILE:
    {"index": i, "label": "pos", "score": 0.91, "probs": {"neg": 0.02, "neu": 0.07, "pos": 0.91}}
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
                       help="JSON field holding each row's text_pair: classify (text, text_pair) pairs "
                            "from --input, read as JSONL")
    add_output_option(files)

    add_model_options(parser)

    request = parser.add_argument_group("classification")
    request.add_argument("--raw-logits", action="store_true",
                         help='write the raw logits (as "logits") instead of probabilities')
    add_truncation_options(request)

    add_plugin_options(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Read the inputs, load the model for classify, classify, write. Input errors come before loading."""
    inputs = read_inputs(args)
    if not inputs:
        raise no_inputs("texts to classify", args.input, empty="records" if args.pair_field else "lines")
    check_output(args.output)
    runtime = load_runtime(args, task="classify")
    results = runtime.classify(
        inputs, use_activation=False if args.raw_logits else None,
        truncate_prompt_tokens=args.truncate, truncation_side=args.truncation_side,
        show_progress_bar=len(inputs) > PROGRESS_THRESHOLD,
    )
    write_jsonl(records(results, "logits" if args.raw_logits else "probs"), args.output)
    return 0


def read_inputs(args: argparse.Namespace) -> list[Any]:
    """The texts, or with ``--pair-field`` the ``(text, text_pair)`` tuples of the JSONL input."""
    if args.pair_field is None:
        return read_texts(args.texts, args.input, args.text_field)
    if args.input is None:
        raise CliError("--pair-field needs --input FILE: JSONL rows holding the text (--text-field) "
                       "and its pair (--pair-field)")
    if args.texts:
        raise CliError("pass texts either as arguments or with --input, not both")
    return read_jsonl(args.input, [(args.text_field, "--text-field"), (args.pair_field, "--pair-field")])


def records(results: list[Any], key: str) -> Iterator[dict[str, Any]]:
    """One output object per :class:`~poolrunner.core.results.ClassificationResult`."""
    for index, result in enumerate(results):
        values = [float(value) for value in result.probs]
        yield {"index": index, "label": result.label, "score": max(values),
               key: dict(zip(result.labels, values, strict=True))}
