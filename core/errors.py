"""Exceptions raised by poolrunner. Every one derives from :class:`PoolrunnerError`."""

from __future__ import annotations


class PoolrunnerError(Exception):
    """Base class of every error poolrunner raises on purpose."""


class PluginLoadError(PoolrunnerError):
    """A plugin could not be imported or registered.

    The message names the plugin, its distribution and version, and the cause; the original
    exception is chained as ``__cause__``.
    """


class PluginConflictError(PoolrunnerError):
    """Two plugins claim the same thing (a registration name, or a ``prepare_inputs`` key)."""


class UnsupportedTaskError(PoolrunnerError, ValueError):
    """The requested pooling task is not served for this model by the installed plugins."""


class ModelLoadError(PoolrunnerError, ValueError):
    """The model folder is missing, incomplete, or describes a pipeline poolrunner cannot run."""


class InvalidRequestError(PoolrunnerError, ValueError):
    """A request, its parameters or a runtime argument were rejected before reaching the engine.

    Raised before the request is admitted, so other requests are never affected.
    """
