"""The HTTP server: OpenAI-compatible embeddings and the field's pooling endpoints over one engine.

``create_app`` and ``ServerSettings`` are imported on first use, so that the command line can
read the server's light modules (its log settings) without loading FastAPI, torch or a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from poolrunner.core.server.app import create_app
    from poolrunner.core.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from poolrunner.core.server.app import create_app

        return create_app
    if name == "ServerSettings":
        from poolrunner.core.server.settings import ServerSettings

        return ServerSettings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
