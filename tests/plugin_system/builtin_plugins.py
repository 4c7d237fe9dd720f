"""The built-in plugins, for tests that mean "whatever the built-ins are".

The names come from core's own list (:data:`poolrunner.core.manager.DEFAULT_PLUGINS`, after
``core``), and what each built-in implements or serves from a manager with built-ins only, so a
new built-in does not break tests about something else. Exactly one test names every built-in
and what it does: ``test_plugin_manager.py::test_the_builtin_plugins_are_pinned``.

Import it as ``tests.plugin_system.builtin_plugins`` (the repository root is on ``sys.path``).
"""

from __future__ import annotations

from collections.abc import Collection

import importlib_metadata

from poolrunner.core import ModelConfig, PluginInfo, build_plugin_manager
from poolrunner.core.hooks import Hooks
from poolrunner.core.manager import CORE_PLUGIN_NAME, DEFAULT_PLUGINS

VERSION = importlib_metadata.version("poolrunner")

BUILTIN_PLUGINS: tuple[str, ...] = (CORE_PLUGIN_NAME, *(module.rsplit(".", 1)[-1] for module in DEFAULT_PLUGINS))
"""Every built-in plugin's name, in registration order: core's defaults, then ``DEFAULT_PLUGINS``."""

DISABLEABLE_BUILTINS: tuple[str, ...] = BUILTIN_PLUGINS[1:]
"""The built-ins a user can disable: all but ``core``."""

POOLING_HOOKS = frozenset({"supported_tasks", "get_pooler"})


def builtin_infos() -> list[PluginInfo]:
    """What a manager with built-ins only reports about each of them, in registration order."""
    return build_plugin_manager(load_entrypoints=False).plugin_infos()


def builtins_implementing(*hooks: str) -> list[str]:
    """The built-ins implementing any of ``hooks``, in registration order."""
    return [info.name for info in builtin_infos() if set(hooks) & set(info.hooks)]


def pooling_builtins() -> list[str]:
    """The built-ins that serve tasks or give poolers (``token_type_ids`` and ``core`` do not)."""
    return builtins_implementing(*POOLING_HOOKS)


def describe_pooling_builtins(model_config: ModelConfig, *, without: Collection[str] = ()) -> str:
    """The built-ins' part of an ``UnsupportedTaskError``'s "pooling plugins:" list, for
    ``model_config``: ``NAME (poolrunner VERSION) serves [TASKS]`` joined by ``", "``, in
    registration order, leaving out the disabled built-ins ``without``."""
    served = Hooks(build_plugin_manager(load_entrypoints=False)).tasks_by_plugin(model_config=model_config)
    return ", ".join(
        f"{name} (poolrunner {VERSION}) serves {sorted(served.get(name, ()))}"
        for name in pooling_builtins() if name not in without
    )
