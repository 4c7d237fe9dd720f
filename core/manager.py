"""Builds the plugin manager of one runtime: built-ins, entry points and code-passed plugins.

There is no module-level manager: every :class:`~poolrunner.Runtime` builds its own, so two
runtimes with different plugins live side by side in one process.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Collection, Sequence
from typing import Any

import importlib_metadata
import pluggy

from poolrunner.core.errors import PluginConflictError, PluginLoadError
from poolrunner.core.plugin_api import hookspec
from poolrunner.core.types import PluginInfo, PluginSource

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "poolrunner.plugins"

# Built-ins are found by module name, not by entry point, so they are present even with
# load_entrypoints=False. Core never imports them directly (an import-linter contract).
DEFAULT_PLUGINS: tuple[str, ...] = (
    "poolrunner.plugins.token_type_ids",
    "poolrunner.plugins.pixel_values",
    "poolrunner.plugins.lora",
    "poolrunner.plugins.sequence_pooling",
    "poolrunner.plugins.token_pooling",
    "poolrunner.plugins.async_output",
)

# Core's own default implementations (trylast). Registered like a plugin, but never disabled:
# without it no step could pool or return outputs.
CORE_PLUGIN_NAME = "core"
CORE_PLUGIN = "poolrunner.core.defaults"


class PoolrunnerPluginManager(pluggy.PluginManager):
    """A pluggy manager that records where each plugin came from and can be frozen."""

    def __init__(self) -> None:
        super().__init__(hookspec.PROJECT_NAME)
        self.add_hookspecs(hookspec)
        self._origins: dict[str, tuple[PluginSource, str | None, str | None]] = {}
        self._frozen = False

    def register_plugin(
        self,
        plugin: object,
        name: str,
        *,
        source: PluginSource,
        dist: str | None = None,
        version: str | None = None,
    ) -> None:
        """Register ``plugin`` under ``name``, unless that name is disabled.

        :raises PluginConflictError: if another plugin already uses ``name``.
        :raises PluginLoadError: if the plugin's hook implementations do not match the specs.
        """
        if self.is_blocked(name):
            return
        if self.has_plugin(name):
            raise PluginConflictError(
                f"two plugins are named {name!r}: {self.plugin_info(name).describe()} and "
                f"{PluginInfo(name=name, source=source, dist=dist, version=version).describe()}; "
                "uninstall or disable one of them"
            )
        self._origins[name] = (source, dist, version)
        try:
            self.register(plugin, name)
        except pluggy.PluginValidationError as exc:
            described = self._describe(name)  # while its origin is known: an entry point's names its distribution
            del self._origins[name]
            raise PluginLoadError(f"plugin {described} is invalid: {exc}") from exc

    def register(self, plugin: object, name: str | None = None) -> str | None:
        self._check_not_frozen()
        return super().register(plugin, name)

    def unregister(self, plugin: object | None = None, name: str | None = None) -> Any:
        self._check_not_frozen()
        return super().unregister(plugin, name)

    def freeze(self) -> None:
        """Refuse further (un)registration: a loaded runtime's plugin set is fixed."""
        self._frozen = True

    def load_entrypoints(self, entry_points: Sequence[importlib_metadata.EntryPoint]) -> None:
        """Import and register the given entry points of the ``poolrunner.plugins`` group.

        :raises PluginLoadError: naming the entry point, distribution and version of a plugin
            that fails to import.
        """
        for ep in entry_points:
            if self.is_blocked(ep.name):
                continue  # disabled plugins are never imported, so a broken one can be skipped
            dist = ep.dist.name if ep.dist else None
            version = ep.dist.version if ep.dist else None
            try:
                plugin = ep.load()
            except Exception as exc:
                raise PluginLoadError(
                    f"plugin {ep.name!r} ({dist} {version}, entry point {ep.value!r} in group "
                    f"{ep.group!r}) failed to import: {type(exc).__name__}: {exc}"
                ) from exc
            self.register_plugin(plugin, ep.name, source="entrypoint", dist=dist, version=version)

    def check_hooks(self) -> None:
        """Fail on a hook implementation that matches no spec (a misspelled hook name).

        :raises PluginLoadError: naming the plugin, its distribution and the unknown hook.
        """
        try:
            self.check_pending()
        except pluggy.PluginValidationError as exc:
            name = self.get_name(exc.plugin) or repr(exc.plugin)
            raise PluginLoadError(f"plugin {self._describe(name)} is invalid: {exc}") from exc

    def plugin_info(self, name: str) -> PluginInfo:
        source, dist, version = self._origins[name]
        plugin = self.get_plugin(name)
        hooks = sorted(caller.name for caller in self.get_hookcallers(plugin) or ())
        return PluginInfo(name=name, source=source, dist=dist, version=version, hooks=tuple(hooks))

    def plugin_infos(self) -> list[PluginInfo]:
        """Every registered plugin, in registration order."""
        return [self.plugin_info(name) for name in self._origins]

    def _describe(self, name: str) -> str:
        source, dist, version = self._origins.get(name, ("programmatic", None, None))
        return PluginInfo(name=name, source=source, dist=dist, version=version).describe()

    def _check_not_frozen(self) -> None:
        if self._frozen:
            raise RuntimeError("this runtime's plugin set is fixed once built; build a new Runtime instead")


def build_plugin_manager(
    *,
    plugins: Sequence[object] = (),
    load_entrypoints: bool = True,
    disable: Collection[str] = (),
) -> PoolrunnerPluginManager:
    """Build a fresh manager: core defaults, built-ins, entry points, then ``plugins``.

    Registration order matters only for ties: pluggy calls later registrations first, so
    code-passed plugins run before entry points, which run before built-ins.

    :param plugins: Extra plugin objects (modules or instances carrying ``@hookimpl``
        functions). A module registers under the last part of its ``__name__``, an instance
        under its class name; two with the same name conflict.
    :param load_entrypoints: Also load the ``poolrunner.plugins`` entry-point group.
    :param disable: Plugin names to leave out, built-ins included (not ``core``). A disabled
        entry point is never imported.
    :raises ValueError: if ``disable`` names ``core`` or a plugin that does not exist.
    :raises PluginLoadError: if a plugin fails to import or implements an unknown hook.
    :raises PluginConflictError: if two plugins share a name.
    """
    entry_points = list(importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)) if load_entrypoints else []
    _check_disable(disable, [ep.name for ep in entry_points], [_plugin_name(p) for p in plugins])
    pm = PoolrunnerPluginManager()
    for name in disable:
        pm.set_blocked(name)
    version = importlib_metadata.version("poolrunner")
    pm.register_plugin(importlib.import_module(CORE_PLUGIN), CORE_PLUGIN_NAME, source="builtin",
                       dist="poolrunner", version=version)
    for module_name in DEFAULT_PLUGINS:
        pm.register_plugin(importlib.import_module(module_name), _plugin_name_of_module(module_name),
                           source="builtin", dist="poolrunner", version=version)
    pm.load_entrypoints(entry_points)
    for plugin in plugins:
        pm.register_plugin(plugin, _plugin_name(plugin), source="programmatic")
    pm.check_hooks()
    logger.info("plugins: %s", ", ".join(info.describe() for info in pm.plugin_infos()))
    return pm


def _plugin_name_of_module(module_name: str) -> str:
    return module_name.rsplit(".", 1)[-1]


def _plugin_name(plugin: object) -> str:
    name = getattr(plugin, "__name__", None)
    return _plugin_name_of_module(name) if isinstance(name, str) else type(plugin).__name__


def _check_disable(disable: Collection[str], entry_points: Sequence[str], programmatic: Sequence[str]) -> None:
    if CORE_PLUGIN_NAME in disable:
        raise ValueError(f"the {CORE_PLUGIN_NAME!r} plugin holds core's defaults and cannot be disabled")
    known = {*map(_plugin_name_of_module, DEFAULT_PLUGINS), *entry_points, *programmatic}
    unknown = sorted(set(disable) - known)
    if unknown:
        raise ValueError(f"cannot disable unknown plugin(s) {unknown}; known plugins: {sorted(known)}")
