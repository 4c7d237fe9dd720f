"""What every OpenAI- and vLLM-shaped answer carries: its id and its token usage."""

from __future__ import annotations

import uuid

from poolrunner.core.server import protocol as p


def usage(num_tokens: int) -> p.Usage:
    return p.Usage(prompt_tokens=num_tokens, total_tokens=num_tokens)


def answer_id(prefix: str, request_id: str | None = None) -> str:
    """An answer's id: ``prefix-`` and the request's own ``request_id`` (vLLM), else a random one."""
    return f"{prefix}-{request_id or uuid.uuid4().hex}"
