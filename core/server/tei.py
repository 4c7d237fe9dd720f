"""Text Embeddings Inference's API on the same server: TEI's routes, bodies, status codes and
error shape, computed by the runtime's front end like every other route."""

from __future__ import annotations

from fastapi import FastAPI

from poolrunner.core.server.service import PoolingService


def add_tei_routes(app: FastAPI, service: PoolingService) -> None:
    """TEI's routes (``/embed``, ``/embed_all``, ...) over ``service``."""
