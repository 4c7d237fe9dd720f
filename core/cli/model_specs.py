"""``serve --model PATH[:KEY=VALUE...]``, repeated: several models in one server, each with its
own served names and options.

``--model ./reranker:name=rerank:task=classify`` serves the folder ``./reranker`` as ``rerank``;
the keys are those of :data:`KEYS` (the ``serve`` flags of the same name), ``name`` repeated
for aliases. A flag given for the whole command applies to every model that does not set its
own key. Options are separated by ``:`` because ``,`` separates models in ``$POOLRUNNER_MODEL``.
"""

from __future__ import annotations

import argparse
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

from attrs import frozen

from poolrunner.core.cli.common import CliError, boolean, positive_int
from poolrunner.core.config import DTYPES

logger = logging.getLogger(__name__)

_OPTION = re.compile(r":([a-z][a-z-]*)=([^:]*)")
_OPTIONS_AT_END = re.compile(r"(?::[a-z][a-z-]*=[^:]*)+$")


def _choice(choices: Sequence[str]) -> Callable[[str], str]:
    def check(value: str) -> str:
        if value not in choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {value!r}")
        return value

    return check


KEYS: dict[str, Callable[[str], Any]] = {
    "name": str, "task": str, "dtype": _choice(DTYPES), "revision": str, "max-model-len": positive_int,
    "max-num-seqs": positive_int, "max-num-batched-tokens": positive_int, "is-matryoshka": boolean,
    "score-template": str,
}
"""The keys a model may set, each read as its ``serve`` flag reads it; ``name`` may repeat."""


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


def parse_model_spec(text: str) -> ModelSpec:
    """``PATH[:KEY=VALUE...]`` as a :class:`ModelSpec`; a path holding ``:`` stays whole unless
    what follows the colon reads as options.

    :raises CliError: for an unknown key, a key given twice (but ``name``), a bad value or no path.
    """
    options_at = _OPTIONS_AT_END.search(text)
    path, options_text = (text[:options_at.start()], options_at.group()) if options_at else (text, "")
    if not path:
        raise CliError(f"--model {text!r} names no model folder before its options")
    names: list[str] = []
    options: dict[str, Any] = {}
    for key, value in _OPTION.findall(options_text):
        if key not in KEYS:
            raise CliError(f"--model {text!r}: unknown option {key!r}; a model may set {', '.join(KEYS)}")
        try:
            converted = KEYS[key](value)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise CliError(f"--model {text!r}: {key}: {exc}") from None
        if key == "name":
            if not value:
                raise CliError(f"--model {text!r}: name is empty")
            names.append(value)
        elif key.replace("-", "_") in options:
            raise CliError(f"--model {text!r} sets {key} twice")
        else:
            options[key.replace("-", "_")] = converted
    return ModelSpec(path, tuple(names), options)


def model_specs(args: argparse.Namespace) -> list[ModelSpec]:
    """Every ``--model`` of ``args`` (the default model when none), with ``--served-model-name``
    as the names of a lone model.

    :raises CliError: as :func:`parse_model_spec`; for ``--served-model-name`` with several
        models (each takes ``name=`` instead) or a name two models share.
    """
    specs = [parse_model_spec(text) for text in args.model] if args.model else [ModelSpec(None, (), {})]
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
        runtime = load_runtime(options, task=options.task, is_matryoshka=True if options.is_matryoshka else None,
                               max_model_len=options.max_model_len)
        model = ServedModel(runtime, spec.names or (default_model_name(runtime),))
        logger.info("loaded %r (%s): task %s, %s on %s; resident memory +%d MiB%s", model.names[0],
                    runtime.model_config.name, runtime.task, runtime.precision, runtime.device,
                    (process.memory_info().rss - before) >> 20, _cuda_memory(runtime.device))
        served.append(model)
    try:
        return served_models(served, None)
    except ValueError as exc:
        raise CliError(str(exc), hint="give each model its own name: --model PATH:name=NAME") from exc


def _cuda_memory(device: Any) -> str:
    if device.type != "cuda":
        return ""
    import torch

    return f", CUDA memory allocated {torch.cuda.memory_allocated(device) >> 20} MiB in all"
