"""Helpers shared by the subcommands: the user-error type and plugin-selection options."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable

from poolrunner.core.manager import PoolrunnerPluginManager
from poolrunner.core.manager import build_plugin_manager as _build_plugin_manager

DISABLE_ENV = "POOLRUNNER_DISABLE_PLUGINS"
"""Comma-separated plugin names the command line leaves out (the Python API ignores it)."""

EXIT_USAGE = 2
"""Exit status of every error the user can fix (argparse uses it too)."""


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
