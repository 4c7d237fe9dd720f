"""The fields of a request body that hold what is pooled (``input``, TEI's ``inputs``, a score's
sides, rerank's ``documents``): any JSON value, checked by the core as the Python API's and the
CLI's inputs are (:func:`~poolrunner.core.frontend.requests.as_items` and tokenizing, the score
and rerank requests' own checks), so a wrong item gets one sentence naming its index (``input 1:
expected a text, a list of token ids or a (text, text_pair) pair, got None``) rather than
pydantic's error for each member of a union. The OpenAPI schema still shows the shapes each
field takes.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, PlainValidator

from poolrunner.core.frontend.requests import is_token_ids


def _as_sent(value: Any) -> Any:
    return value


def json_inputs(shape: Any) -> Any:
    """A field type taking any JSON value as it was sent, documented in OpenAPI as ``shape`` (a type)."""
    return Annotated[Any, PlainValidator(_as_sent, json_schema_input_type=shape)]


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
