"""The HTTP server: OpenAI-compatible embeddings and the field's pooling endpoints over one engine."""

from poolrunner.core.server.app import create_app
from poolrunner.core.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
