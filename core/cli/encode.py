"""``poolrunner encode``: any task the model serves, raw per-input results out (JSONL or .npz)."""

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
    add_plugin_request_options,
    add_task_option,
    add_truncation_options,
    check_output,
    load_runtime,
    no_inputs,
    plugin_options,
    positive_int,
    read_texts,
    write_jsonl,
    write_output,
)
from poolrunner.core.cli.ray_job import EPILOG as RAY_EPILOG
from poolrunner.core.cli.ray_job import add_ray_options, run_ray

__all__ = ["add_parser", "run"]

DESCRIPTION = """\
Run any task the model serves and write each input's result in input order.

results per input (float32 unless said otherwise):
  embed                 [d]                       one vector
  classify              [num_labels]              probabilities (or --raw-logits)
  token_embed           [num_tokens, hidden]      one vector per token
  token_classify        [num_tokens, num_labels]  per-token probabilities; with
                        --step-tag-id only the rows of that token ([num_tags, n])
  embed&token_classify  {"embedding": [hidden], "token_weights": [num_tokens]}
  a plugin's task       as the plugin says, e.g. sparse_embed (poolrunner-splade):
                        {"token_ids": [k] int64, "weights": [k]}

input: TEXT arguments, or --input FILE (.jsonl with --text-field, else text lines).

output:
  JSONL, one {"index": i, "task": ..., "output": ...} a line (nested lists), to
  stdout or --output FILE; --output FILE.npz writes a numpy .npz archive instead,
  one array per input named "<index>" (or "<index>/<name>" for named outputs)."""

EPILOG = """\
examples:
  poolrunner encode --task token_embed "A cat sat." --output tokens.npz
  poolrunner encode --model ./splade --task sparse_embed --option top_k=20 "A cat sat."
  poolrunner encode --model ./ner-model --task token_classify --input texts.txt
  poolrunner encode --model ./prm --task token_classify --step-tag-id 12902 --returned-token-ids 0 1 "step 1 ..."\
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(subparsers, "encode", summary="run any task; per-input arrays (JSONL or .npz)",
                         description=DESCRIPTION, epilog=f"{EPILOG}\n\n{RAY_EPILOG}")
    parser.add_argument("texts", nargs="*", metavar="TEXT", help="inputs (or use --input)")
    files = parser.add_argument_group("input and output")
    add_input_option(files, "inputs")
    add_output_option(files, "; a name ending in .npz writes a numpy archive")

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
    add_plugin_options(parser)
    add_ray_options(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Read the inputs, load the model, encode, write. Input and option errors come before loading."""
    options = plugin_options(args.options)
    if args.ray is not None:
        return run_ray(args, args.task, {
            "dimensions": args.dimensions, "normalize": args.normalize, "use_activation": args.use_activation,
            "step_tag_id": args.step_tag_id, "returned_token_ids": args.returned_token_ids,
            "truncate_prompt_tokens": args.truncate, "truncation_side": args.truncation_side, **options,
        })
    texts = read_texts(args.texts, args.input, args.text_field)
    if not texts:
        raise no_inputs("inputs to encode", args.input)
    check_output(args.output)
    if args.output and args.output.lower().endswith(".npy"):
        raise CliError("encode results are ragged: write .npz or JSONL, not .npy")
    runtime = load_runtime(args, task=args.task, is_matryoshka=True if args.is_matryoshka else None)
    results = runtime.encode(
        texts, dimensions=args.dimensions, normalize=args.normalize, use_activation=args.use_activation,
        step_tag_id=args.step_tag_id, returned_token_ids=args.returned_token_ids,
        truncate_prompt_tokens=args.truncate, truncation_side=args.truncation_side,
        show_progress_bar=len(texts) > PROGRESS_THRESHOLD, **options,
    )
    if args.output is not None and args.output.lower().endswith(".npz"):
        arrays = {name: array for index, result in enumerate(results) for name, array in _named(index, result)}
        write_output(args.output, lambda file: np.savez(file, **arrays), binary=True)
    else:
        write_jsonl(({"index": i, "task": runtime.task, "output": _as_lists(r)} for i, r in enumerate(results)),
                    args.output)
    return 0


def _named(index: int, result: np.ndarray | dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    if isinstance(result, dict):
        return [(f"{index}/{name}", array) for name, array in result.items()]
    return [(str(index), result)]


def _as_lists(result: np.ndarray | dict[str, np.ndarray]) -> Any:
    if isinstance(result, dict):
        return {name: array.tolist() for name, array in result.items()}
    return result.tolist()
