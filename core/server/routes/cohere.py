"""Cohere's v2 embed: ``POST /v2/embed`` (``cohere.ClientV2.embed``), texts and images
(:mod:`poolrunner.core.server.cohere_protocol`)."""

from __future__ import annotations

import re

from fastapi import APIRouter, Request

from poolrunner.core.errors import InvalidRequestError, truncation_helps, with_advice
from poolrunner.core.server import cohere_protocol as c
from poolrunner.core.server.errors import ApiError
from poolrunner.core.server.routes.answers import answer_id
from poolrunner.core.server.routes.dependencies import Served

router = APIRouter()

_INPUT = re.compile(r"^input(?: (\d+))?\b")
_FIELDS = {"dimensions": "output_dimension", "truncate_prompt_tokens": "max_tokens"}
"""The core's request fields, by the name of the Cohere field that sets them."""


@router.post("/v2/embed", response_model=c.CohereEmbedResponse, response_model_exclude_none=True)
async def embed(body: c.CohereEmbedRequest, request: Request, served: Served) -> c.CohereEmbedResponse:
    """One vector per input, in each of ``embedding_types`` (default ``float``); errors about an
    input name it as the body does (``images[1]``)."""
    service = served.pick(body.model, "embed")
    items = body.items()
    try:
        vectors, num_tokens = await service.answer(request, body.to_request(items), priority=body.priority)
        embeddings = c.by_type(vectors, body.embedding_types or ["float"])
    except (InvalidRequestError, ApiError) as exc:
        raise _named(exc, body.source(), truncating=body.truncate != "NONE") from None
    images = sum(1 for item in items if not isinstance(item, str))
    return c.CohereEmbedResponse(
        id=answer_id("embed", None), embeddings=embeddings, texts=body.texts,
        meta=c.EmbedMeta(billed_units=c.BilledUnits(input_tokens=num_tokens, images=images),
                         tokens=c.MetaTokens(input_tokens=num_tokens)))


def _named(error: InvalidRequestError | ApiError, field: str, *, truncating: bool) -> InvalidRequestError | ApiError:
    """``error`` in the body's names: ``field[i]`` for ``input i`` (``field`` for ``input``),
    ``output_dimension`` for ``dimensions``, ``max_tokens`` for ``truncate_prompt_tokens``; an
    over-long input's advice is Cohere's ``truncate`` when it is ``NONE``."""
    text = _INPUT.sub(lambda match: field if match.group(1) is None else f"{field}[{match.group(1)}]", str(error),
                      count=1)
    param = error.param if error.param not in (None, "input") else field
    if param in _FIELDS:
        text = text.replace(f"{param}=", f"{_FIELDS[param]}=")
        text = _FIELDS[param] + text[len(param):] if text.startswith(f"{param} ") else text
        param = _FIELDS[param]
    if truncation_helps(error) and not truncating:
        text = with_advice(text, 'shorten it or send "truncate": "END" (or "START")')
        return InvalidRequestError(text, param=param)  # not the server's advice of --truncate-prompt-tokens
    if isinstance(error, ApiError):
        return ApiError(error.status, text, param=param)
    return type(error)(text, param=param)
