"""The HTTP server: OpenAI-compatible embeddings and the field's pooling endpoints over one engine
per served model.

``create_app``, ``ServedModel`` and ``ServerSettings`` are imported on first use, so that the
command line can read the server's light modules (its log settings) without loading FastAPI,
torch or a model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from poolrunner.core.server.app import create_app
    from poolrunner.core.server.models import ServedModel
    from poolrunner.core.server.settings import ServerSettings

__all__ = ["ServedModel", "ServerSettings", "create_app"]

_HOMES = {"create_app": "app", "ServedModel": "models", "ServerSettings": "settings"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
