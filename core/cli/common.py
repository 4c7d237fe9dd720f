"""Helpers shared by the subcommands: the user-error type, the options every model command takes
(model, plugins, truncation, input and output), input reading, JSONL writing and model loading."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from poolrunner.core.config import COMPILE_MODES, DTYPES
from poolrunner.core.manager import PoolrunnerPluginManager
from poolrunner.core.manager import build_plugin_manager as _build_plugin_manager
from poolrunner.core.types import POOLING_TASKS

DISABLE_ENV = "POOLRUNNER_DISABLE_PLUGINS"
"""Comma-separated plugin names the command line leaves out (the Python API ignores it)."""

EXIT_USAGE = 2
"""Exit status of every error the user can fix (argparse uses it too)."""

PROGRESS_THRESHOLD = 100
"""A progress bar (stderr) is shown for more inputs than this, where the API offers one."""

DISABLE_NOTE = f"Plugins named in ${DISABLE_ENV} (comma-separated) are left out as with --disable-plugin."
"""Last line of the epilog of every command that loads a model."""


class CliError(Exception):
    """An error the user can fix: printed as ``poolrunner: error: <message>``, exit status 2.

    :param hint: An optional second line telling the user what to do.
    """

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the hand-wrapped descriptions and epilogs, and shows defaults where they help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "%(default)" not in text
            and action.default not in (None, False, True, [], argparse.SUPPRESS)
            and action.option_strings
        ):
            text += " (default: %(default)s)"
        return text


def positive_int(value: str) -> int:
    """argparse ``type`` for options that must be >= 1."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def plugin_option(value: str) -> tuple[str, Any]:
    """``NAME=VALUE`` as ``(NAME, VALUE)``, VALUE read as JSON (``64``, ``0.5``, ``true``,
    ``"7"``) and as plain text when it is not JSON (``max``)."""
    name, equals, text = value.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {value!r}")
    try:
        return name, json.loads(text)
    except ValueError:
        return name, text


def plugin_options(pairs: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """``--option`` pairs as keyword arguments.

    :raises CliError: for an option given twice (which value was meant is unknowable).
    """
    options: dict[str, Any] = {}
    for name, value in pairs:
        if name in options:
            raise CliError(f"--option {name} is given twice ({options[name]!r} and {value!r}): give it once")
        options[name] = value
    return options


def add_plugin_request_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--option", dest="options", metavar="NAME=VALUE", type=plugin_option, action="append",
                       default=[], help="a request option a plugin declares (`poolrunner plugins --options MODEL` "
                                        "lists them), "
                                        "VALUE as JSON; repeat for several options")


def disabled_plugins(names: Iterable[str] = ()) -> list[str]:
    """``names`` (from ``--disable-plugin``) plus those of ``$POOLRUNNER_DISABLE_PLUGINS``, once each."""
    from_env = (name.strip() for name in os.environ.get(DISABLE_ENV, "").split(","))
    return list(dict.fromkeys([*names, *(name for name in from_env if name)]))


def build_plugin_manager(
    *, load_entrypoints: bool = True, disable: Iterable[str] = ()
) -> PoolrunnerPluginManager:
    """:func:`poolrunner.core.build_plugin_manager` with the command line's error handling.

    An unknown name to disable is a :class:`CliError` (core raises a plain ``ValueError``).
    """
    try:
        return _build_plugin_manager(load_entrypoints=load_entrypoints, disable=disabled_plugins(disable))
    except ValueError as exc:
        raise CliError(str(exc), hint=f"check --disable-plugin and ${DISABLE_ENV}") from exc


# --- options shared by the model commands (embed, classify, score, rerank) ---------------------


def add_command(
    subparsers: Any, name: str, *, summary: str, description: str, epilog: str
) -> argparse.ArgumentParser:
    """A subcommand parser with the common formatter; its epilog ends with the plugin note."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name, help=summary, description=description, epilog=f"{epilog}\n\n{DISABLE_NOTE}",
        formatter_class=HelpFormatter,
    )
    return parser


def add_input_option(group: argparse._ArgumentGroup, what: str, *, text_field: bool = True) -> None:
    """``-i/--input FILE`` and, with ``text_field``, ``--text-field FIELD`` (read by :func:`read_texts`)."""
    group.add_argument("-i", "--input", metavar="FILE",
                       help=f"read {what} from FILE (.jsonl or plain text lines); '-' reads stdin")
    if text_field:
        group.add_argument("--text-field", metavar="FIELD", default="text",
                           help="JSON field holding the text, for .jsonl input")


def add_output_option(group: argparse._ArgumentGroup, extra: str = "") -> None:
    """``-o/--output FILE``."""
    group.add_argument("-o", "--output", metavar="FILE",
                       help=f"write to FILE instead of stdout{extra}")


def add_task_option(model: argparse._ArgumentGroup, verb: str, default: str = "the model's own default task") -> None:
    """``--task``: not argparse choices, since plugins declare tasks of their own (sparse_embed);
    the runtime checks the name when the model loads."""
    model.add_argument("--task", metavar="TASK",
                       help=f"task to {verb}: {', '.join(POOLING_TASKS)}, or one a plugin declares "
                            f"(e.g. sparse_embed); default: {default}")


def add_model_options(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The ``model`` group (folder or hub id, revision, dtype, device, batching); returned for
    command-specific additions."""
    model = parser.add_argument_group("model")
    model.add_argument("-m", "--model", metavar="PATH",
                       help="local model folder, or a Hugging Face hub id already in the local Hugging Face "
                            "cache ($HF_HUB_CACHE, $HF_HOME; never downloaded) (default: all-MiniLM-L6-v2, "
                            "shipped with poolrunner)")
    model.add_argument("--revision", metavar="REV",
                       help="branch, tag or commit hash of a hub id --model, from the cache (default: main)")
    model.add_argument("--dtype", choices=DTYPES, default="auto",
                       help="precision; bf16-mixed: float32 weights, bfloat16 matrix products (CPU); auto: half "
                            "precision on CUDA; on the CPU bfloat16 or else bf16-mixed where bf16 is native and "
                            "accurate for this model (checked at load), else float32")
    model.add_argument("--device", default="auto",
                       help="torch device, e.g. cpu, cuda, cuda:1; auto picks CUDA when present")
    model.add_argument("--compile", choices=COMPILE_MODES, default="auto",
                       help="auto: on the CPU, prepack linear weights for oneDNN at load and fuse bias and "
                            "activation into the matmul; off: run transformers' modules as they are")
    model.add_argument("--max-num-batched-tokens", "--batch-size", metavar="N", type=positive_int,
                       default=None, dest="max_num_batched_tokens",
                       help="token budget of one forward pass (default: 2048 on the CPU, 16384 on CUDA)")
    model.add_argument("--max-num-seqs", metavar="N", type=positive_int, default=256,
                       help="most inputs in one forward pass")
    model.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="launch each forward pass before collecting the last one's results (default: on "
                            "with CUDA, off on the CPU)")
    model.add_argument("--max-embed-len", metavar="N", type=positive_int, default=None,
                       help="embed inputs longer than the model maximum, up to N tokens, in windows of the model "
                            "maximum whose vectors are averaged by token count (vLLM's chunked processing; MEAN "
                            "pooling models only); default: such inputs are an error unless truncated")
    return model


def add_truncation_options(group: argparse._ArgumentGroup, *, pairs: bool = False) -> None:
    """``--truncate N`` and ``--truncation-side``; ``pairs`` words the help for (text, pair) inputs."""
    what = "a (query, document) pair" if pairs else "longer inputs"
    group.add_argument("--truncate", metavar="N", type=int,
                       help=f"keep N tokens of {what} (special tokens included); -1 keeps the model "
                            "maximum; without it a too long input is an error")
    group.add_argument("--truncation-side", choices=("left", "right"), default="right",
                       help="right keeps the start of a long input, left keeps its end")


def add_plugin_options(parser: argparse.ArgumentParser) -> None:
    """The ``plugins`` group: ``--disable-plugin NAME`` (repeatable) and ``--no-entrypoints``."""
    plugins = parser.add_argument_group("plugins")
    plugins.add_argument("--disable-plugin", metavar="NAME", action="append", default=[],
                         help=f"leave plugin NAME out, built-ins too (repeatable; adds to ${DISABLE_ENV})")
    plugins.add_argument("--no-entrypoints", dest="load_entrypoints", action="store_false",
                         help="do not load installed third-party plugins (entry points)")


def runtime_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~poolrunner.core.config.RuntimeConfig` options of the model, plugin and
    batching flags, for a local runtime and a Ray job alike."""
    return {
        "model": args.model, "revision": args.revision, "dtype": args.dtype, "device": args.device,
        "compile": args.compile,
        "load_entrypoints": args.load_entrypoints, "disable_plugins": disabled_plugins(args.disable_plugin),
        "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
        "async_scheduling": args.async_scheduling, "max_embed_len": args.max_embed_len,
    }


def load_runtime(args: argparse.Namespace, **options: Any) -> Any:
    """The :class:`~poolrunner.core.runtime.Runtime` the model, plugin and batching options ask for.

    ``options`` are further :class:`~poolrunner.core.config.RuntimeConfig` options (``task=``,
    ``is_matryoshka=``...). Loading errors (``ModelLoadError``, ``UnsupportedTaskError``...)
    propagate for ``main`` to report; a plain ``ValueError`` from core (an unknown plugin name)
    becomes a :class:`CliError`.
    """
    from poolrunner.core.config import RuntimeConfig
    from poolrunner.core.errors import PoolrunnerError
    from poolrunner.core.runtime import Runtime

    settings = {**runtime_options(args), "device": check_device(args.device), **options}
    try:
        return Runtime.from_config(RuntimeConfig.from_options(**settings))
    except PoolrunnerError:
        raise  # ModelLoadError and friends: main() reports them
    except ValueError as exc:  # a plain ValueError from core is a bad setting (an unknown plugin name)
        raise CliError(str(exc)) from exc


def check_device(device: str) -> str:
    """``device`` if torch knows it and it is there; ``auto`` passes as it is."""
    if device == "auto":
        return device
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise CliError(f"--device {device!r} is not a torch device (try cpu, cuda or cuda:0)") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device {device!r} asks for CUDA, but no CUDA device is available; use cpu")
    return device


# --- input ------------------------------------------------------------------------------------


def read_texts(texts: Sequence[str], source: str | None, text_field: str = "text", what: str = "texts") -> list[str]:
    """The arguments ``texts``, or the texts of ``source``: a ``.jsonl`` file (the string under
    ``text_field`` of each object; blank lines skipped), ``-`` (stdin, text lines) or any other
    file (UTF-8 text, one text a line, the trailing newline removed; an empty line is a text too).

    :raises CliError: for both sources at once, an unreadable file, or a bad JSONL line
        (named as ``FILE:LINE``).
    """
    if source is None:
        return list(texts)
    if texts:
        raise CliError(f"pass {what} either as arguments or with --input, not both")
    with open_input(source) as file:
        if source != "-" and Path(source).suffix.lower() == ".jsonl":
            return [record[0] for record in _jsonl_records(file, source, [(text_field, "--text-field")])]
        return [line.removesuffix("\n") for line in file]


def read_jsonl(source: str, fields: Sequence[tuple[str, str]]) -> list[tuple[str, ...]]:
    """The string values of ``fields`` in each JSON object of ``source`` (``-``: stdin), whatever
    the file is named; blank lines are skipped.

    :param fields: ``(field name, the option that names it)`` pairs, in the order of the returned
        tuples; the option is for the error message of a missing field.
    :raises CliError: for an unreadable file, or a bad line (named as ``FILE:LINE``).
    """
    with open_input(source) as file:
        return list(_jsonl_records(file, source, fields))


@contextlib.contextmanager
def open_input(source: str) -> Iterator[IO[str]]:
    """``source`` opened as UTF-8 text (a BOM is dropped), or stdin for ``-``; read errors are CliErrors."""
    try:
        if source == "-":
            yield sys.stdin
            return
        with open(source, encoding="utf-8-sig") as file:
            yield file
    except FileNotFoundError:
        raise CliError(f"input file {source!r} does not exist") from None
    except IsADirectoryError:
        raise CliError(f"input {source!r} is a directory; name a file") from None
    except UnicodeDecodeError as exc:
        raise CliError(f"input file {source!r} is not UTF-8 text: {exc}") from None
    except OSError as exc:
        raise CliError(f"cannot read input file {source!r}: {exc.strerror or exc}") from None


def _jsonl_records(file: IO[str], name: str, fields: Sequence[tuple[str, str]]) -> Iterator[tuple[str, ...]]:
    name = "<stdin>" if name == "-" else name
    for number, line in enumerate(file, start=1):
        if not line.strip():
            continue
        where = f"{name}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CliError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})") from None
        if not isinstance(record, dict):
            raise CliError(f"{where}: expected a JSON object, got {type(record).__name__}")
        values = []
        for field, option in fields:
            if field not in record:
                known = ", ".join(repr(key) for key in record) or "none"
                raise CliError(f"{where}: no field {field!r} (fields: {known}); pick one with {option}")
            value = record[field]
            if not isinstance(value, str):
                raise CliError(f"{where}: field {field!r} is {type(value).__name__}, not a string")
            values.append(value)
        yield tuple(values)


def no_inputs(what: str, source: str | None, *, arguments: str = "TEXT", empty: str = "lines") -> CliError:
    """The error for nothing to process: ``no <what>[ (<source> has no <empty>)]; pass <arguments>
    arguments or --input FILE``."""
    where = f" ({'stdin' if source == '-' else source} has no {empty})" if source else ""
    return CliError(f"no {what}{where}; pass {arguments} arguments or --input FILE (--input - reads stdin)")


# --- output -----------------------------------------------------------------------------------


def check_output(output: str | None) -> None:
    """Fail before loading the model if ``output`` (a file name; ``None`` or ``-``: stdout) cannot be written."""
    if output in (None, "-"):
        return
    path = Path(output)
    if path.is_dir():
        raise CliError(f"output {str(path)!r} is a directory; name a file")
    if not path.parent.is_dir():
        raise CliError(f"cannot write output file {str(path)!r}: folder {str(path.parent)!r} does not exist")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise CliError(f"cannot write output file {str(path)!r}: folder {str(path.parent)!r} is not writable")


def write_output(output: str | None, write: Any, *, binary: bool = False) -> None:
    """Call ``write(file)`` on stdout (``output`` ``None`` or ``-``) or on a new file that
    replaces ``output`` only once ``write`` has returned: a run that fails or is interrupted
    (Ctrl-C) midway leaves the previous ``output`` as it was, and no partial file.

    A broken pipe on stdout propagates (``main`` handles it); a file that cannot be written is a CliError.
    """
    if output in (None, "-"):
        write(sys.stdout)
        sys.stdout.flush()
        return
    target = Path(output)
    partial: Path | None = None
    try:
        with tempfile.NamedTemporaryFile("wb" if binary else "w", encoding=None if binary else "utf-8",
                                         dir=target.parent, prefix=f".{target.name}.", suffix=".partial",
                                         delete=False) as file:
            partial = Path(file.name)
            write(file)
        os.chmod(partial, _file_mode(target))  # a temporary file is private (0600); the output is not
        os.replace(partial, target)
    except BaseException as exc:
        if partial is not None:
            partial.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise CliError(f"cannot write output file {output!r}: {exc.strerror or exc}") from None
        raise


def _file_mode(path: Path) -> int:
    """The permission bits ``path`` keeps (it exists) or a new file gets under the umask."""
    if path.exists():
        return path.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_jsonl(records: Iterable[Mapping[str, Any]], output: str | None) -> None:
    """One JSON object a line (non-ASCII escaped, so any terminal encoding works), to stdout or ``output``."""

    def write(file: IO[str]) -> None:
        for record in records:
            file.write(json.dumps(record) + "\n")

    write_output(output, write)
