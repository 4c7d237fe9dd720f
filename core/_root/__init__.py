"""poolrunner: a pluggable runtime for pooling models.

The package root re-exports the public API of :mod:`poolrunner.core`; built-in plugins live in
:mod:`poolrunner.plugins`.
"""

import importlib_metadata

from poolrunner.core import *  # noqa: F403
from poolrunner.core import __all__ as __all__

__version__ = importlib_metadata.version("poolrunner")
