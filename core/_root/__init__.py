"""poolrunner: a pluggable runtime for pooling models.

The package root re-exports the public API of :mod:`poolrunner.core` (lazily, like core itself);
built-in plugins live in :mod:`poolrunner.plugins`.
"""

from typing import Any

from importlib_metadata import version as _version

from poolrunner import core as _core
from poolrunner.core import __all__ as __all__

__version__ = _version("poolrunner")


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(_core, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])
