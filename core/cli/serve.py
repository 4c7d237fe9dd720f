"""``poolrunner serve``: the model over HTTP (OpenAI embeddings and vLLM's pooling endpoints)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from poolrunner.core.cli.common import (
    CliError,
    add_command,
    add_model_options,
    add_plugin_options,
    add_task_option,
    positive_int,
)

__all__ = ["API_KEY_ENV", "add_parser", "run"]

API_KEY_ENV = "POOLRUNNER_API_KEY"
"""The API key when --api-key is not given."""

DESCRIPTION = """\
Serve one model over HTTP until SIGTERM or Ctrl-C; requests from all clients are batched
together in the same engine steps.

endpoints:
  POST /v1/embeddings   OpenAI embeddings with vLLM's fields (float, base64 or bytes; embed_dtype,
                        endianness, dimensions, normalize, precision; messages: a chat)
  GET  /v1/models       the served model
  POST /classify        label scores (classify models): texts, [text, text_pair] pairs, or messages
  POST /score           text_1 against text_2: cosine (embed) or cross-encoder score
  POST /rerank          query and documents, ranked best first (top_n, return_documents)
  POST /pooling         any task the model serves, per-token outputs included
  POST /tokenize        the model's token ids of a prompt
  GET  /health          200 while serving (no API key needed), 503 while shutting down
  GET  /metrics         Prometheus metrics
  GET  /docs            the OpenAPI page

SIGTERM (or Ctrl-C) drains: requests in flight finish, new ones get 503, then the
process exits with status 0; a second signal stops at once."""

EPILOG = f"""\
examples:
  poolrunner serve                                     all-MiniLM-L6-v2 on 127.0.0.1:8000
  poolrunner serve --model ./reranker --port 8080 --api-key secret
  {API_KEY_ENV}=secret poolrunner serve --host 0.0.0.0
  poolrunner serve --served-model-name minilm sentence-transformers/all-MiniLM-L6-v2"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(subparsers, "serve", summary="serve the model over HTTP (OpenAI-compatible)",
                         description=DESCRIPTION, epilog=EPILOG)
    model = add_model_options(parser)
    add_task_option(model, "serve alone", default="every task the model and the plugins allow, each request "
                                                  "naming its own (/pooling's task)")
    model.add_argument("--is-matryoshka", action="store_true",
                       help="accept dimensions although the model's config does not declare it")
    model.add_argument("--max-model-len", metavar="N", type=positive_int,
                       help="most tokens per input (default: the model's maximum); longer inputs are a 400 "
                            "unless the request asks for truncate_prompt_tokens")

    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument("--api-key", metavar="KEY",
                        help=f"require 'Authorization: Bearer KEY' on every endpoint but /health "
                             f"(default: ${API_KEY_ENV}; none: open)")
    server.add_argument("--served-model-name", metavar="NAME", nargs="+",
                        help="model names clients may pass (aliases, as vLLM's); answers report the first and "
                             "/v1/models lists each (default: the folder's name)")
    server.add_argument("--allow-extra-fields", action="store_true",
                        help="accept request bodies with fields an endpoint does not know, logging them (as vLLM "
                             "does); default: such a request is a 400 naming the field")
    server.add_argument("--max-inputs-per-request", metavar="N", type=positive_int, default=2048,
                        help="most inputs (texts, pairs, documents) in one request; more is a 400")
    server.add_argument("--max-request-bytes", metavar="N", type=positive_int, default=16 * 1024 * 1024,
                        help="largest request body; larger is a 413")
    server.add_argument("--max-waiting-requests", metavar="N", type=positive_int, default=8192,
                        help="most inputs queued or running over all clients; a request that would pass "
                             "it is answered 429 at once")
    server.add_argument("--drain-timeout", metavar="SECONDS", type=float, default=30.0,
                        help="how long requests in flight may take to finish after SIGTERM")
    server.add_argument("--auto-truncate", metavar="BOOL", nargs="?", type=_boolean, const=True, default=False,
                        help="TEI's routes (/embed, /predict...) truncate an over-long input to the model maximum "
                             "when the request does not set truncate (as TEI's --auto-truncate; default: false, "
                             "such an input is a 422)")
    server.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info",
                        help="uvicorn's log level")
    add_plugin_options(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Check the settings, load the model, serve until stopped."""
    from poolrunner.core.cli.common import load_runtime
    from poolrunner.core.server import ServerSettings, create_app
    from poolrunner.core.server.serve import serve

    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be 0..65535, got {args.port}")
    try:
        settings = ServerSettings(
            served_model_name=args.served_model_name, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
            max_inputs_per_request=args.max_inputs_per_request, max_request_bytes=args.max_request_bytes,
            max_waiting_requests=args.max_waiting_requests, drain_timeout=args.drain_timeout,
            auto_truncate=args.auto_truncate, allow_extra_fields=args.allow_extra_fields,
        )
    except ValueError as exc:
        hint = "raise --max-waiting-requests or lower --max-inputs-per-request" if "max_inputs" in str(exc) else None
        raise CliError(str(exc), hint=hint) from exc
    runtime = load_runtime(args, task=args.task, is_matryoshka=True if args.is_matryoshka else None,
                           max_model_len=args.max_model_len)
    serve(create_app(runtime, settings), host=args.host, port=args.port, drain_timeout=args.drain_timeout,
          log_level=args.log_level)
    return 0


def _boolean(value: str) -> bool:
    """argparse ``type`` for ``--auto-truncate [true|false]`` (TEI takes the flag alone or with a value)."""
    answer = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(value.lower())
    if answer is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return answer
