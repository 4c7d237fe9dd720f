"""Request and response bodies, in the OpenAI shape for ``/v1/embeddings`` and vLLM's for the rest.

Request models forbid unknown fields and use strict types, so ``"1"`` is never taken for a
token id nor ``1.0`` for an integer: such input is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, create_model

from poolrunner.core.plugin_api.options import RequestOptions

TokenIds = list[StrictInt]
EncodingFormat = Literal["float", "base64"]
Vector = list[float] | str
"""A float list, or with ``encoding_format="base64"`` the base64 of its little-endian float32 bytes."""
PoolingArray = list[int] | list[float] | list[list[int]] | list[list[float]] | str
"""One ``/pooling`` output in its own dtype: ints (e.g. SPLADE's ``token_ids``) stay JSON ints, floats
are float32; with ``encoding_format="base64"`` the base64 of its little-endian, row-major bytes,
int64 for integer outputs and float32 for float ones."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = Field(default=None, description="Must be the served model name when given.")
    truncate_prompt_tokens: StrictInt | None = Field(
        default=None, description="Keep this many tokens of each input (-1: the model maximum); "
                                  "without it a too long input is a 400.")


class EmbeddingRequest(_Request):
    """OpenAI's embeddings request: ``input`` is a text, texts, token ids or token-id lists."""

    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    encoding_format: EncodingFormat = "float"
    dimensions: StrictInt | None = None
    user: StrictStr | None = None  # accepted for OpenAI compatibility; unused


class PoolingHttpRequest(_Request):
    """vLLM's ``/pooling``: any task this server's runtime serves, per-token outputs included."""

    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    task: StrictStr | None = Field(default=None, description="Defaults to the served task.")
    encoding_format: EncodingFormat = "float"
    dimensions: StrictInt | None = None
    normalize: StrictBool | None = None
    use_activation: StrictBool | None = None


_OPTION_FIELD_TYPES: dict[type, Any] = {
    int: StrictInt, float: StrictInt | StrictFloat, bool: StrictBool, str: StrictStr,
}


def pooling_request_model(options: RequestOptions) -> type[PoolingHttpRequest]:
    """:class:`PoolingHttpRequest` with one optional body field per plugin request option, so
    the OpenAPI schema shows them and a wrongly typed value is a 400 naming the field."""
    fields: dict[str, Any] = {
        entry.option.name: (
            _OPTION_FIELD_TYPES[entry.option.type] | None,
            Field(default=None, description=f"{entry.option.help} Plugin {entry.plugin!r}; tasks "
                                            f"{sorted(entry.option.tasks)}; default {entry.option.default!r}."),
        )
        for entry in options
    }
    if not fields:
        return PoolingHttpRequest
    return create_model("PoolingHttpRequest", __base__=PoolingHttpRequest, __doc__=PoolingHttpRequest.__doc__,
                        **fields)


class ClassificationRequest(_Request):
    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    use_activation: StrictBool | None = None


class ScoreRequest(_Request):
    """vLLM's ``/score``: ``text_1`` against ``text_2`` as 1:1, 1:N or N:N."""

    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    use_activation: StrictBool | None = None


class RerankRequest(_Request):
    query: StrictStr
    documents: list[StrictStr]
    top_n: StrictInt | None = None
    return_documents: StrictBool = False


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    prompt: StrictStr


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Vector


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: Usage


class PoolingData(BaseModel):
    object: Literal["pooling"] = "pooling"
    index: int
    data: PoolingArray | dict[str, PoolingArray] = Field(
        description="The task's output, or one array per name for named outputs (SPLADE's "
                    "{token_ids, weights}); integer arrays are JSON ints, or with encoding_format=base64 "
                    "little-endian int64 bytes; float arrays little-endian float32 bytes.")


class ClassificationData(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class _ListResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    usage: Usage


class PoolingResponse(_ListResponse):
    data: list[PoolingData]


class ClassificationResponse(_ListResponse):
    data: list[ClassificationData]


class ScoreResponse(_ListResponse):
    data: list[ScoreData]


class RerankDocument(BaseModel):
    text: str


class RerankData(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: Usage
    results: list[RerankData]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "poolrunner"
    max_model_len: int
    task: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
