"""``poolrunner serve``: the model over HTTP (OpenAI embeddings and vLLM's pooling endpoints)."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import ipaddress
import os
import sys
from typing import Any

from poolrunner.core.cli.common import (
    CliError,
    add_command,
    add_model_options,
    add_plugin_options,
    add_task_option,
    boolean,
    positive_int,
    seconds,
)
from poolrunner.core.cli.environment import check_environment, read_environment
from poolrunner.core.cli.model_specs import load_served_models, model_keys, model_specs
from poolrunner.core.cli.ray_serve import add_ray_serve_options, ray_serve_requested, run_ray_serve
from poolrunner.core.server.logs import LOG_FORMATS, LOG_LEVELS
from poolrunner.core.server.settings import LOOPBACK_HOSTS, MAX_PRIORITY, SCHEDULING_POLICIES

__all__ = ["API_KEY_ENV", "add_parser", "run"]

API_KEY_ENV = "POOLRUNNER_API_KEY"
"""The API key when --api-key is not given."""
SERVER_SPIN_COUNT = "10000"
"""libgomp's ``GOMP_SPINCOUNT`` for ``serve`` unless set (its own default: 300,000): short enough
to leave the CPU to the event loop between steps, long enough to bridge one step's operations."""

DESCRIPTION = """\
Serve a model (or several: --model repeated) over HTTP until SIGTERM or Ctrl-C; requests from
all clients are batched together in the same engine steps, each model's in its own.

endpoints:
  POST /v1/embeddings   OpenAI embeddings with vLLM's fields (float, base64 or bytes; embed_dtype,
                        endianness, dimensions, normalize, precision; messages: a chat)
  GET  /v1/models       the served models
  POST /classify        label scores (classify models): texts, [text, text_pair] pairs, or messages
  POST /score           text_1 against text_2: cosine (embed) or cross-encoder score
  POST /rerank          query and documents, ranked best first (top_n, return_documents)
  POST /pooling         any task the model serves, per-token outputs included
  POST /tokenize        the model's token ids of a prompt
  GET  /health          200 while serving (no API key needed), 503 while shutting down
  GET  /metrics         Prometheus metrics (no API key needed unless --protect-metrics)
  GET  /docs, /redoc    the OpenAPI pages (assets served locally)

SIGTERM (or Ctrl-C) drains: requests in flight finish, new ones get a JSON 503 (and
their connection closed after it), then the listener closes and the process exits with
status 0; a second signal stops at once.

Every flag can also come from the environment as POOLRUNNER_<FLAG> (shown in [env: ...]);
a flag on the command line wins over its variable, which wins over the default. Switches
take true/false; flags with several values take them comma-separated. Plugins to leave out
come from $POOLRUNNER_DISABLE_PLUGINS (comma-separated), added to --disable-plugin."""

EPILOG = f"""\
examples:
  poolrunner serve                                     all-MiniLM-L6-v2 on 127.0.0.1:8000
  poolrunner serve --model ./reranker --port 8080 --api-key secret
  {API_KEY_ENV}=secret poolrunner serve --host 0.0.0.0
  poolrunner serve --served-model-name minilm sentence-transformers/all-MiniLM-L6-v2
  poolrunner serve --model ./embedder:name=embed --model ./reranker:name=rerank    two models
  poolrunner serve --ray-serve --replicas 4 --host 0.0.0.0    4 replicas on Ray Serve"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(subparsers, "serve", summary="serve the model over HTTP (OpenAI-compatible)",
                         description=DESCRIPTION, epilog=EPILOG)
    model = add_model_options(parser, several="repeat it to serve several models in one process, each with its "
                                                "own engine, as PATH:name=NAME[:task=TASK:dtype=...] (options: "
                                                "name and every flag of this group); requests choose one by their "
                                                "model field")
    add_task_option(model, "serve alone", default="every task the model and the plugins allow, each request "
                                                  "naming its own (/pooling's task)")
    model.add_argument("--is-matryoshka", action="store_true",
                       help="accept dimensions although the model's config does not declare it")
    parser.set_defaults(model_keys=model_keys(model))  # what each --model PATH:KEY=VALUE may set

    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument("--api-key", metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics "
                             "(default: none, open)")
    server.add_argument("--served-model-name", metavar="NAME", nargs="+",
                        help="model names clients may pass (aliases, as vLLM's); answers report the first and "
                             "/v1/models lists each (default: the folder's name)")
    server.add_argument("--allow-extra-fields", action="store_true",
                        help="accept request bodies with fields an endpoint does not know, logging them (as vLLM "
                             "does); default: such a request is a 400 naming the field")
    server.add_argument("--max-inputs-per-request", metavar="N", type=positive_int, default=2048,
                        help="most inputs (texts, pairs, documents) in one request; more is a 400")
    server.add_argument("--max-request-bytes", metavar="N", type=positive_int, default=2_000_000,
                        help="largest request body, bytes; larger is a 413 (TEI's --payload-limit)")
    server.add_argument("--max-waiting-requests", metavar="N", type=positive_int, default=8192,
                        help="most inputs queued or running over all clients; a request that would pass "
                             "it is answered 429 at once (413 when it alone needs more than N engine requests)")
    server.add_argument("--max-output-values", metavar="N", type=positive_int, default=1 << 24,
                        help="most values (tokens x hidden size) of one request's per-token outputs (token_embed, "
                             "token_classify); more is a 413")
    server.add_argument("--max-output-values-in-flight", metavar="N", type=positive_int,
                        help="most per-token output values held by all requests at once, until sent; a request "
                             "that would pass it waits its turn (default: a quarter of the memory at 48 bytes a "
                             "value, at least --max-output-values)")
    server.add_argument("--drain-timeout", metavar="SECONDS", default=30.0,
                        type=functools.partial(seconds, allow_zero=True),
                        help="how long requests in flight may take to finish after SIGTERM; then their "
                             "connections are closed and the process exits")
    server.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                        help="vLLM's: fcfs refuses a request's 'priority' other than 0 (a 400); priority runs "
                             f"lower values first, within -{MAX_PRIORITY}..{MAX_PRIORITY}")
    server.add_argument("--max-connections", metavar="N", type=positive_int, default=1024,
                        help="most connections (and requests running) at once; a request past it is answered 503 "
                             "and its connection closed")
    server.add_argument("--keep-alive-timeout", metavar="SECONDS", type=seconds, default=5.0,
                        help="how long an idle connection stays open after an answer")
    server.add_argument("--read-timeout", metavar="SECONDS", type=seconds, default=30.0,
                        help="how long a client may take to send a whole request (head and body), from the "
                             "connection's opening or its previous answer; then the connection is closed")
    server.add_argument("--auto-truncate", metavar="BOOL", nargs="?", type=boolean, const=True, default=True,
                        help="TEI's routes (/embed, /predict...) truncate an over-long input to the model maximum "
                             "when the request does not set truncate (TEI's --auto-truncate and its default, true; "
                             "false: such an input is a 422)")
    server.add_argument("--allowed-origins", metavar="ORIGIN", nargs="+", default=[],
                        help="origins whose browser pages may call the API (CORS), e.g. https://app.example.com, "
                             "or * for any (default: none, no CORS headers)")
    server.add_argument("--truncate-prompt-tokens", metavar="N", type=_truncation, default=None,
                        help="truncate_prompt_tokens of an OpenAI, vLLM, Jina or Cohere request that sets none "
                             "(-1: the model maximum), for clients that cannot send it; default: an over-long input "
                             "is a 400 (vLLM's). TEI's routes follow --auto-truncate")
    server.add_argument("--any-model-name", action="store_true",
                        help="a single-model server answers any 'model' in a request (TEI's behaviour), so clients' "
                             "default names reach it; default: an unknown name is a 404 (vLLM's)")
    server.add_argument("--token-id-inputs", metavar="tiktoken:NAME",
                        help="read /v1/embeddings token ids as this tiktoken encoding's (cl100k_base: OpenAI's "
                             "embedding models', which LangChain's OpenAIEmbeddings sends by default), decoded to "
                             "text for the model's tokenizer; read from tiktoken's cache (TIKTOKEN_CACHE_DIR), never "
                             "downloaded (default: ids are the model's own)")
    server.add_argument("--token-id-chunk-length", metavar="N", type=positive_int,
                        help="with --token-id-inputs: a list of exactly N ids is continued by the next (LangChain "
                             "cuts a long text so, N=8191): embedded as one text, each list answered with its vector "
                             "(default: each list its own text)")
    server.add_argument("--allowed-hosts", metavar="HOST", nargs="+",
                        help="Host header values answered (names or addresses, '*.example.com', '*' for any); "
                             "another is a 400, against DNS rebinding (default: localhost, 127.0.0.1 and ::1 when "
                             "--host is a loopback address, else any)")
    server.add_argument("--protect-metrics", action="store_true",
                        help="require the API key on /metrics too (default: open, left to the network as TEI "
                             "and vLLM do)")
    server.add_argument("--allow-runtime-lora", action="store_true",
                        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), behind the API "
                             "key; give --max-loras to leave room (default: off, 404)")
    server.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                        help="level of uvicorn's and poolrunner's logs")
    server.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="json: one JSON object per line; each request's line has request_id, method, route, "
                             "status, inputs, tokens and latency_ms, never its text or the API key")
    add_ray_serve_options(parser)
    add_plugin_options(parser)
    read_environment(parser, skip={"disable_plugin"})  # that one has its own variable, DISABLE_ENV
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Check the settings, load the model, serve until stopped."""
    invalid = check_environment(args)
    if invalid is not None:
        raise CliError(invalid, hint="fix or unset the variable, or give the flag")
    _check_installed()
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be 0..65535, got {args.port}")
    from poolrunner.core.memory import limit_malloc_arenas
    from poolrunner.core.server.logs import configured

    limit_malloc_arenas(max(2, os.cpu_count() or 1))  # before the server's threads exist
    if "torch" not in sys.modules:  # read once, when torch loads its OpenMP library
        # A server waits for requests between steps; OpenMP's workers spinning there (libgomp's
        # default: 300,000 spins after each parallel region) take the CPU its event loop and
        # tokenizer need. 16 clients on 2 cores (bench/README.md): p99 0.37-0.58 s against 0.47-0.78 s.
        os.environ.setdefault("GOMP_SPINCOUNT", SERVER_SPIN_COUNT)
    with configured(args.log_level, args.log_format):  # the load logs too
        _serve(args)
    return 0


def _serve(args: argparse.Namespace) -> None:
    from poolrunner.core.server import ServerSettings, create_app
    from poolrunner.core.server.connections import ConnectionLimits
    from poolrunner.core.server.serve import serve

    try:
        settings = ServerSettings(
            api_key=args.api_key,
            max_inputs_per_request=args.max_inputs_per_request, max_request_bytes=args.max_request_bytes,
            max_waiting_requests=args.max_waiting_requests, drain_timeout=args.drain_timeout,
            max_output_values=args.max_output_values, max_output_values_in_flight=args.max_output_values_in_flight,
            auto_truncate=args.auto_truncate, allow_extra_fields=args.allow_extra_fields,
            allowed_origins=args.allowed_origins, protect_metrics=args.protect_metrics,
            allow_runtime_lora=args.allow_runtime_lora,
            scheduling_policy=args.scheduling_policy, allowed_hosts=_allowed_hosts(args),
            any_model_name=args.any_model_name, truncate_prompt_tokens=args.truncate_prompt_tokens,
            token_id_inputs=args.token_id_inputs, token_id_chunk_length=args.token_id_chunk_length,
        )
    except ValueError as exc:
        hint = ("raise --max-waiting-requests or lower --max-inputs-per-request" if "max_inputs" in str(exc)
                else "raise --max-output-values-in-flight or lower --max-output-values" if "in_flight" in str(exc)
                else None)
        raise CliError(str(exc), hint=hint) from exc
    specs = model_specs(args)
    if args.any_model_name and len(specs) > 1:  # before any model loads
        raise CliError("--any-model-name needs a single model: with several, a request's model must say which",
                       hint="serve clients' default names as aliases instead: --model PATH:name=NAME")
    if ray_serve_requested(args):
        if len(specs) > 1:
            raise CliError("--ray-serve deploys one model; give one --model")
        run_ray_serve(specs[0].namespace(args), settings, specs[0].names)
        return
    models = load_served_models(args, specs)
    limits = ConnectionLimits(keep_alive_timeout=args.keep_alive_timeout, read_timeout=args.read_timeout,
                              max_connections=args.max_connections)
    try:
        app = create_app(models, settings)
    except ValueError as exc:  # a name a model shares with another's adapter, known once they loaded
        raise CliError(str(exc)) from exc
    serve(app, host=args.host, port=args.port, drain_timeout=args.drain_timeout, limits=limits,
          log_level=args.log_level, log_format=args.log_format)


SERVER_MODULES = ("fastapi", "uvicorn", "prometheus_client", "fastapi_offline", "pythonjsonlogger", "psutil")
"""What the ``serve`` extra installs, by import name."""


def _check_installed() -> None:
    missing = [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise CliError(f"the server's packages are not installed (missing: {', '.join(missing)})",
                       hint="pip install -e '.[serve]' in the poolrunner checkout")


def _truncation(value: str) -> int:
    """argparse ``type`` for ``truncate_prompt_tokens``: -1 or a positive number of tokens."""
    try:
        tokens = int(value)
    except ValueError:
        tokens = 0
    if tokens < 1 and tokens != -1:
        raise argparse.ArgumentTypeError(f"expected -1 (the model maximum) or a positive number of tokens, "
                                         f"got {value!r}")
    return tokens


def _allowed_hosts(args: argparse.Namespace) -> list[str] | None:
    """``--allowed-hosts``, else the loopback names when listening on a loopback address only."""
    if args.allowed_hosts:
        return args.allowed_hosts
    try:
        loopback = ipaddress.ip_address(args.host).is_loopback
    except ValueError:  # a name
        loopback = args.host.lower() == "localhost"
    return list(LOOPBACK_HOSTS) if loopback else None
