"""``poolrunner plugins``: the registered plugins, where they come from and the hooks they implement."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from poolrunner.core.cli.common import DISABLE_ENV, CliError, HelpFormatter, build_plugin_manager, disabled_plugins
from poolrunner.core.types import PluginInfo

DESCRIPTION = """\
List the registered plugins: name, source, distribution, version and implemented hooks.

source is one of
  builtin       ships with poolrunner (including "core", poolrunner's own defaults)
  entrypoint    an installed distribution's "poolrunner.plugins" entry point
  programmatic  passed in code (never seen from the command line)

Only third-party plugins are listed unless --all is given."""

EPILOG = f"""\
examples:
  poolrunner plugins                 third-party plugins
  poolrunner plugins --all           built-ins too
  poolrunner plugins --hook pool     plugins that implement the `pool` hook
  poolrunner plugins --all --json    machine-readable
  poolrunner plugins --options ./splade-model
                                     the request options plugins declare for a model

Plugins named in ${DISABLE_ENV} (comma-separated) are not registered, so not listed."""

COLUMNS = ("NAME", "SOURCE", "DIST", "VERSION", "HOOKS")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "plugins", help="list registered plugins", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("-a", "--all", action="store_true", help="include built-in plugins")
    parser.add_argument("--hook", metavar="NAME", help="only plugins implementing hook NAME")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON list of {name, source, dist, version, hooks}")
    parser.add_argument("--options", metavar="MODEL",
                        help="list the request options the plugins declare for MODEL (a folder, or a hub id "
                             "in the local cache; no weights are loaded): set them with `encode --option`, "
                             "Runtime.encode keywords or /pooling body fields")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.options is not None:
        return _list_options(args.options, as_json=args.json)
    manager = build_plugin_manager()
    if args.hook is not None:
        known = sorted(name for name in vars(manager.hook) if not name.startswith("_"))
        if args.hook not in known:
            raise CliError(f"unknown hook {args.hook!r}; hooks: {', '.join(known)}")
    infos = select(manager.plugin_infos(), include_builtins=args.all, hook=args.hook)
    if args.json:
        print(json.dumps([as_dict(info) for info in infos], indent=2))
    elif infos:
        print(format_table(infos))
    else:
        print(_nothing_found(args.all, args.hook))
    return 0


def _list_options(model: str, *, as_json: bool) -> int:
    from poolrunner.core.config import RuntimeConfig
    from poolrunner.core.loading import declared_options

    entries = list(declared_options(RuntimeConfig(model=model, disable_plugins=tuple(disabled_plugins()))))
    rows = [{"name": e.option.name, "type": e.option.type.__name__, "default": e.option.default,
             "tasks": sorted(e.option.tasks), "plugin": e.plugin, "help": e.option.help} for e in entries]
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no plugin declares request options for {model}")
    for row in rows:
        print(f"{row['name']} ({row['type']}, default {row['default']!r}; tasks {', '.join(row['tasks'])}; "
              f"plugin {row['plugin']})\n    {row['help']}")
    return 0


def select(infos: Sequence[PluginInfo], *, include_builtins: bool, hook: str | None) -> list[PluginInfo]:
    return [
        info for info in infos
        if (include_builtins or info.source != "builtin") and (hook is None or hook in info.hooks)
    ]


def as_dict(info: PluginInfo) -> dict[str, Any]:
    return {"name": info.name, "source": info.source, "dist": info.dist, "version": info.version,
            "hooks": list(info.hooks)}


def format_table(infos: Sequence[PluginInfo]) -> str:
    rows = [COLUMNS] + [
        (info.name, info.source, info.dist or "-", info.version or "-", ", ".join(info.hooks) or "-")
        for info in infos
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1]
        for row in rows
    )


def _nothing_found(include_builtins: bool, hook: str | None) -> str:
    disabled = disabled_plugins()
    note = f" ({DISABLE_ENV} leaves out: {', '.join(disabled)})" if disabled else ""
    if hook is None:
        if include_builtins:
            return f"no plugins registered{note}"
        return f"no third-party plugins installed; use --all to include built-ins{note}"
    scope = "no plugin" if include_builtins else "no third-party plugin"
    more = "" if include_builtins else "; use --all to include built-ins"
    return f"{scope} implements hook {hook!r}{more}{note}"
