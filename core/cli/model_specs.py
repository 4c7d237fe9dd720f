"""``serve --model PATH[:KEY=VALUE...]``, repeated: several models in one server, each with its
own served names and options.

``--model ./reranker:name=rerank:task=classify`` serves the folder ``./reranker`` as ``rerank``;
the keys are ``name`` (repeated for aliases) and every flag of ``serve``'s ``model`` group
(:func:`model_keys`: ``dtype``, ``task``, ``hf-overrides``...). A flag given for the whole
command applies to every model that does not set its own key. Options are separated by ``:``
because ``,`` separates models in ``$POOLRUNNER_MODEL``.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from attrs import frozen

from poolrunner.core.cli.common import CliError, boolean

logger = logging.getLogger(__name__)

_KEY = re.compile(r":([a-z][a-z-]*)=")


def model_keys(group: argparse._ArgumentGroup) -> dict[str, Callable[[str], Any]]:
    """The keys a ``--model`` value may set: ``name`` (repeatable), and every other flag of the
    command's ``model`` group by its long name (``dtype``, ``max-model-len``, ``hf-overrides``...),
    each read as the flag reads its value (a switch takes true / false; a flag of several values,
    ``lora-modules``, one value a key, the key repeatable)."""
    keys: dict[str, Callable[[str], Any]] = {"name": str}
    for action in group._group_actions:
        long_names = [option[2:] for option in action.option_strings if option.startswith("--")]
        if action.dest != "model" and long_names:
            keys[long_names[0]] = _reader(action)
    return keys


def _reader(action: argparse.Action) -> Callable[[str], Any]:
    """How ``action``'s flag reads one value: its ``type`` (a switch: true / false), then its ``choices``."""
    read = boolean if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction) else action.type or str
    if action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction | argparse._ExtendAction):
        read = _listed(read)
    if action.choices is None:
        return read

    def chosen(value: str) -> Any:
        converted = read(value)
        if converted not in action.choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(map(str, action.choices))}, got {value!r}")
        return converted

    return chosen


def _listed(read: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """``read`` of one value of a flag of several, as the one-item list the flag's values extend."""
    def one(value: str) -> list[Any]:
        return [read(value)]

    return one


@frozen
class ModelSpec:
    """One ``--model`` value: the folder (``None``: the default model), the served names it asks
    for (empty: the folder's name) and its own options by flag destination (``max_model_len``...)."""

    model: str | None
    names: tuple[str, ...]
    options: dict[str, Any]

    def namespace(self, args: argparse.Namespace) -> argparse.Namespace:
        """The command's ``args`` with this model and its options in place of the flags'."""
        return argparse.Namespace(**{**vars(args), "model": self.model, **self.options})


def parse_model_spec(text: str, keys: dict[str, Callable[[str], Any]]) -> ModelSpec:
    """``PATH[:KEY=VALUE...]`` as a :class:`ModelSpec`, ``keys`` those of :func:`model_keys`. The
    path ends where the rest of the text reads as ``:KEY=VALUE`` pairs (a path holding ``:``
    stays whole otherwise); a value runs to the next ``:KEY=``, and one that starts with ``{`` or
    ``[`` is JSON, colons and all (``hf-overrides={"a": 1}``).

    :raises CliError: for an unknown key, a key given twice (but ``name``), a bad value or no path.
    """
    start, pairs = len(text), []
    for match in _KEY.finditer(text):
        try:
            pairs = list(_options(text, match.start()))
        except CliError:
            continue
        start = match.start()
        break
    path = text[:start]
    if not path:
        raise CliError(f"--model {text!r} names no model folder before its options")
    names: list[str] = []
    options: dict[str, Any] = {}
    for key, value in pairs:
        if key not in keys:
            raise CliError(f"--model {text!r}: unknown option {key!r}; a model may set {', '.join(keys)}")
        try:
            converted = keys[key](value)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise CliError(f"--model {text!r}: {key}: {exc}") from None
        if key == "name":
            if not value:
                raise CliError(f"--model {text!r}: name is empty")
            names.append(value)
        elif isinstance(converted, list):  # a flag of several values: each key adds one
            options.setdefault(key.replace("-", "_"), []).extend(converted)
        elif key.replace("-", "_") in options:
            raise CliError(f"--model {text!r} sets {key} twice")
        else:
            options[key.replace("-", "_")] = converted
    return ModelSpec(path, tuple(names), options)


def _options(text: str, at: int) -> Iterator[tuple[str, str]]:
    """The ``(key, value)`` pairs of ``text[at:]``, a run of ``:KEY=VALUE``."""
    while at < len(text):
        match = _KEY.match(text, at)
        if match is None:
            raise CliError(f"--model {text!r}: expected :KEY=VALUE at {text[at:at + 20]!r}")
        value_at = match.end()
        if text[value_at:value_at + 1] in ("{", "["):
            try:
                end = value_at + json.JSONDecoder().raw_decode(text[value_at:])[1]
            except ValueError as exc:
                raise CliError(f"--model {text!r}: {match.group(1)}: the JSON value does not parse: {exc}") from None
        else:
            following = _KEY.search(text, value_at)
            end = following.start() if following else len(text)
        yield match.group(1), text[value_at:end]
        at = end


def model_specs(args: argparse.Namespace) -> list[ModelSpec]:
    """Every ``--model`` of ``args`` (the default model when none), with ``--served-model-name``
    as the names of a lone model.

    :raises CliError: as :func:`parse_model_spec`; for ``--served-model-name`` with several
        models (each takes ``name=`` instead) or a name two models share.
    """
    specs = ([parse_model_spec(text, args.model_keys) for text in args.model] if args.model
             else [ModelSpec(None, (), {})])
    if args.served_model_name:
        if len(specs) > 1:
            raise CliError("--served-model-name names a single model; with several, give each its names as "
                           "--model PATH:name=NAME")
        specs[0] = ModelSpec(specs[0].model, (*args.served_model_name, *specs[0].names), specs[0].options)
    return specs


def load_served_models(args: argparse.Namespace, specs: Sequence[ModelSpec]) -> list[Any]:
    """Load each model of ``specs`` into a runtime of its own (the command's flags, overridden by
    its options) and log what it costs: the process's resident memory before and after
    (and CUDA memory allocated, on CUDA).

    :returns: :class:`~poolrunner.core.server.models.ServedModel` s, in order.
    :raises CliError: for a name two models share.
    """
    import psutil

    from poolrunner.core.cli.common import load_runtime
    from poolrunner.core.server.models import ServedModel, default_model_name, served_models

    process = psutil.Process()
    served = []
    for spec in specs:
        options = spec.namespace(args)
        before = process.memory_info().rss
        runtime = load_runtime(options, task=options.task, is_matryoshka=True if options.is_matryoshka else None)
        model = ServedModel(runtime, spec.names or (default_model_name(runtime),))
        logger.info("loaded %r (%s): task %s, %s on %s; resident memory +%d MiB%s", model.names[0],
                    runtime.model_config.name, runtime.task, runtime.precision, runtime.device,
                    (process.memory_info().rss - before) >> 20, _cuda_memory(runtime.device))
        served.append(model)
    try:
        return served_models(served, None)
    except ValueError as exc:
        raise CliError(str(exc)) from exc  # it says which names to change


def _cuda_memory(device: Any) -> str:
    if device.type != "cuda":
        return ""
    import torch

    return f", CUDA memory allocated {torch.cuda.memory_allocated(device) >> 20} MiB in all"
