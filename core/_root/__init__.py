"""poolrunner: a pluggable runtime for pooling models.

The package root re-exports the public API of :mod:`poolrunner.core`; built-in plugins live in
:mod:`poolrunner.plugins`.
"""

from poolrunner.core import *  # noqa: F403
from poolrunner.core import __all__ as __all__

import importlib_metadata

__version__ = importlib_metadata.version("poolrunner")
