"""Cohere's v2 embed: ``POST /v2/embed`` (``cohere.ClientV2.embed``), texts and images
(:mod:`poolrunner.core.server.cohere_protocol`)."""

from __future__ import annotations

import re

from fastapi import APIRouter, Request

from poolrunner.core.errors import InvalidRequestError
from poolrunner.core.server import cohere_protocol as c
from poolrunner.core.server.routes.answers import answer_id
from poolrunner.core.server.routes.dependencies import Served

router = APIRouter()

_INPUT = re.compile(r"^input (\d+)\b")


@router.post("/v2/embed", response_model=c.CohereEmbedResponse, response_model_exclude_none=True)
async def embed(body: c.CohereEmbedRequest, request: Request, served: Served) -> c.CohereEmbedResponse:
    """One vector per input, in each of ``embedding_types`` (default ``float``); errors about an
    input name it as the body does (``images[1]``)."""
    service = served.pick(body.model, "embed")
    items = body.items()
    try:
        vectors, num_tokens = await service.answer(request, body.to_request(items), priority=body.priority)
        embeddings = c.by_type(vectors, body.embedding_types or ["float"])
    except InvalidRequestError as exc:
        raise _named(exc, body.source()) from None
    images = sum(1 for item in items if not isinstance(item, str))
    return c.CohereEmbedResponse(
        id=answer_id("embed", None), embeddings=embeddings, texts=body.texts,
        meta=c.EmbedMeta(billed_units=c.BilledUnits(input_tokens=num_tokens, images=images)))


def _named(error: InvalidRequestError, field: str) -> InvalidRequestError:
    """``error`` naming ``field[i]`` where it says ``input i``."""
    text = _INPUT.sub(lambda match: f"{field}[{match.group(1)}]", str(error), count=1)
    return InvalidRequestError(text, param=error.param or field)
