"""The inputs field of a request body (``input``, TEI's ``inputs``): any JSON value, checked by the
core as the Python API's and the CLI's inputs are (:func:`~poolrunner.core.frontend.requests.as_items`,
then tokenizing), so a wrong item gets one sentence naming its index (``input 1: expected a text,
a list of token ids or a (text, text_pair) pair, got None``) rather than pydantic's error for each
member of a union. The OpenAPI schema still shows the shapes the field takes.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, TypeAdapter, WithJsonSchema

from poolrunner.core.frontend.requests import is_token_ids


def json_inputs(shape: Any) -> Any:
    """A field type taking any JSON value, documented in OpenAPI as ``shape`` (a type)."""
    return Annotated[Any, WithJsonSchema(TypeAdapter(shape).json_schema())]


def _pairs_as_tuples(value: Any) -> Any:
    """``value`` with each ``[text, text_pair]`` item of a list of inputs as a pair (a tuple, which
    is what the core takes for a pair: JSON has no tuples). A flat list of texts stays texts."""
    if not isinstance(value, list) or is_token_ids(value):
        return value
    return [tuple(item) if isinstance(item, list) and len(item) == 2 and all(isinstance(text, str) for text in item)
            else item for item in value]


def json_inputs_with_pairs(shape: Any) -> Any:
    """As :func:`json_inputs`, reading ``[text, text_pair]`` items of a list as pairs."""
    return Annotated[json_inputs(shape), AfterValidator(_pairs_as_tuples)]
