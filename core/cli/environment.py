"""Options from the environment: ``POOLRUNNER_<FLAG>`` for every flag of a command, as TEI reads
each of its flags from the environment (``PORT``, ``MODEL_ID``...) and vLLM many of its own.

The precedence is: a flag on the command line, else its variable, else the built-in default.
A variable's name is the flag's destination in capitals (``--max-num-seqs`` ->
``POOLRUNNER_MAX_NUM_SEQS``); ``--help`` names it beside each flag. Values are read as the flag
reads them; switches take ``true``/``false`` (``1``/``0``, ``yes``/``no``), and flags that take
several values take them comma-separated.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Collection
from typing import Any

PREFIX = "POOLRUNNER_"
_TRUE = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


class InvalidVariable:
    """A default that stands for a variable whose value the flag refuses; the command reports
    it (:func:`check_environment`) unless the flag itself is given."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __repr__(self) -> str:
        return f"<invalid: {self.message}>"


def variable_name(action: argparse.Action) -> str:
    return PREFIX + action.dest.upper()


def read_environment(parser: argparse.ArgumentParser, *, skip: Collection[str] = ()) -> None:
    """Make every option of ``parser`` (but ``--help`` and the destinations in ``skip``) default
    to its ``POOLRUNNER_<DEST>`` variable when set, and name the variable in its help."""
    for action in parser._actions:
        if not action.option_strings or action.dest in {"help", *skip} or action.help == argparse.SUPPRESS:
            continue
        name = variable_name(action)
        action.help = f"{action.help or ''} [env: {name}]".lstrip()
        raw = os.environ.get(name)
        if raw is not None:
            action.default = _value(action, name, raw)


def check_environment(args: argparse.Namespace) -> str | None:
    """The message of the first invalid variable that decided a value of ``args``, else ``None``."""
    for value in vars(args).values():
        if isinstance(value, InvalidVariable):
            return value.message
    return None


def _value(action: argparse.Action, name: str, raw: str) -> Any:
    try:
        if action.nargs == 0:  # a switch: the variable gives the destination's value
            if raw.strip().lower() not in _TRUE:
                raise ValueError("expected true or false")
            return _TRUE[raw.strip().lower()]
        if action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction):
            return [_convert(action, part.strip()) for part in raw.split(",") if part.strip()]
        return _convert(action, raw)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        return InvalidVariable(f"${name}={raw!r}: {exc}")


def _convert(action: argparse.Action, text: str) -> Any:
    try:
        value = action.type(text) if callable(action.type) else text
    except ValueError:
        # int("abc") says "invalid literal for int() with base 10": name the expected kind instead.
        raise ValueError(f"expected {getattr(action.type, '__name__', 'a valid value')}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"must be one of {', '.join(map(str, action.choices))}")
    return value
