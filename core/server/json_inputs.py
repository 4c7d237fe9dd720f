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

from poolrunner.core.frontend.requests import pairs_as_tuples


def _as_sent(value: Any) -> Any:
    return value


def json_inputs(shape: Any) -> Any:
    """A field type taking any JSON value as it was sent, documented in OpenAPI as ``shape`` (a type)."""
    return Annotated[Any, PlainValidator(_as_sent, json_schema_input_type=shape)]


def json_inputs_with_pairs(shape: Any) -> Any:
    """As :func:`json_inputs`, reading ``[text, text_pair]`` items of a list as pairs as the core's
    classify requests do (:func:`~poolrunner.core.frontend.requests.pairs_as_tuples`), before the
    server's own checks of the items."""
    return Annotated[json_inputs(shape), AfterValidator(pairs_as_tuples)]
