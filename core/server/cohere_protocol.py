"""Cohere's v2 embed body and answer (``POST /v2/embed``, what ``cohere.ClientV2.embed`` sends).

The body gives one of ``texts`` (texts), ``images`` (image data URLs, or ``http(s)`` URLs the
server fetches only from its allowed media domains) or ``inputs`` (each a ``content`` list of
``{"type": "text"}`` and ``{"type": "image_url"}`` parts). A text-image model (CLIP) embeds a
text or an image, so an input's parts are its texts (joined with newlines) or one image, never
both. ``embedding_types`` picks the answer's arrays: ``float``; ``int8`` / ``uint8`` /
``binary`` / ``ubinary``, sentence-transformers' quantization of the float vectors
(:mod:`poolrunner.core.frontend.quantize`; int8 / uint8 calibrated on this request's vectors, so
they need two inputs or more; Cohere's own codes come from its trained models); ``base64``, each
float32 vector's little-endian bytes. ``truncate`` is Cohere's: ``END`` (its default) keeps the
start of an over-long text, ``START`` its end, ``NONE`` answers a 400; ``max_tokens`` keeps that
many tokens. ``output_dimension`` is ``dimensions`` (Matryoshka models only). ``input_type`` is
optional (Cohere requires it, vLLM's ``/v2/embed`` does not) and does not change the vectors (no
prompt is applied).
"""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field, StrictInt, StrictStr

from poolrunner.core.errors import InvalidRequestError
from poolrunner.core.frontend import requests as fr
from poolrunner.core.frontend.quantize import quantize
from poolrunner.core.server.errors import ApiError
from poolrunner.core.server.protocol import ContentPart, ImagePart, Part, _Body

EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]
InputType = Literal["search_document", "search_query", "classification", "clustering", "image"]


class CohereInput(_Body):
    """One of ``inputs``: its ``content`` parts (text and image URL parts, Cohere's and OpenAI's shape)."""

    content: list[Part]


class CohereEmbedRequest(_Body):
    """Cohere's v2 embed body (see the module's docstring)."""

    model: StrictStr | None = None
    input_type: InputType | None = None
    texts: list[StrictStr] | None = None
    images: list[StrictStr] | None = None
    inputs: list[CohereInput] | None = None
    embedding_types: list[EmbeddingType] | None = Field(default=None, description="Default: float.")
    output_dimension: StrictInt | None = None
    max_tokens: StrictInt | None = None
    truncate: Literal["NONE", "START", "END"] = "END"
    priority: StrictInt | None = None

    def source(self) -> Literal["texts", "images", "inputs"]:
        """The one field that holds the inputs.

        :raises ApiError: 400 unless exactly one of ``texts``, ``images``, ``inputs`` is sent.
        """
        given = [name for name in ("texts", "images", "inputs") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ApiError(400, f"send one of texts, images or inputs; got {', '.join(given) or 'none of them'}",
                           param=given[1] if len(given) > 1 else "texts")
        return given[0]  # type: ignore[return-value]

    def items(self) -> list[fr.Input]:
        """Each input: a text, or an image URL.

        :raises ApiError: as :meth:`source`; 400 for an empty list or an input with no parts, or
            with text and an image, or several images.
        """
        source = self.source()
        values: list[object] = getattr(self, source)
        if not values:
            raise ApiError(400, f"{source} is empty: send at least one", param=source)
        if source == "texts":
            return list(self.texts or [])
        if source == "images":
            return [fr.ImageURL(url) for url in self.images or []]
        return [_one_input(item, index) for index, item in enumerate(self.inputs or [])]

    def to_request(self, inputs: list[fr.Input]) -> fr.EncodeRequest:
        """The float32 embedding of ``inputs`` (:meth:`items`); :func:`by_type` makes the answer's arrays.

        :raises ApiError: 400 for ``max_tokens`` with ``truncate="NONE"``.
        """
        if self.max_tokens is not None and self.truncate == "NONE":
            raise ApiError(400, "max_tokens truncates: it cannot be combined with truncate=NONE", param="max_tokens")
        keep = None if self.truncate == "NONE" else (self.max_tokens if self.max_tokens is not None else -1)
        return fr.EncodeRequest.of(inputs=inputs, task="embed", dimensions=self.output_dimension,
                                   truncate_prompt_tokens=keep,
                                   truncation_side="left" if self.truncate == "START" else "right")


def _one_input(item: CohereInput, index: int) -> fr.Input:
    texts = [part.text for part in item.content if isinstance(part, ContentPart)]
    urls = [part.image_url.url for part in item.content if isinstance(part, ImagePart)]
    if urls and texts:
        raise ApiError(400, f"inputs[{index}] holds text and an image: a text-image model (CLIP) embeds a text or an "
                            "image, not both in one input; send them as two inputs", param="inputs")
    if len(urls) > 1:
        raise ApiError(400, f"inputs[{index}] holds {len(urls)} images: one image per input", param="inputs")
    if not urls and not texts:
        raise ApiError(400, f"inputs[{index}] has no content", param="inputs")
    return fr.ImageURL(urls[0]) if urls else "\n".join(texts)


def by_type(vectors: list[np.ndarray], types: list[EmbeddingType]) -> dict[str, list]:
    """The answer's ``embeddings``: one list per requested type, each with one entry per input.

    :raises InvalidRequestError: for int8 / uint8 of a single input (no range to calibrate on).
    """
    matrix = np.stack(vectors).astype(np.float32)
    answer: dict[str, list] = {}
    for kind in dict.fromkeys(types):
        if kind == "float":
            answer[kind] = matrix.tolist()
        elif kind == "base64":
            answer[kind] = [base64.b64encode(row.astype("<f4").tobytes()).decode() for row in matrix]
        elif kind in ("int8", "uint8") and len(matrix) < 2:  # the core's advice names ranges, not sent here
            raise InvalidRequestError(f"embedding_types {kind} needs two inputs or more: its codes are calibrated on "
                                      "the request's own vectors (sentence-transformers' quantize_embeddings), and "
                                      "one vector has no range", param="embedding_types")
        else:
            answer[kind] = quantize(matrix, kind).tolist()
    return answer


class BilledUnits(BaseModel):
    input_tokens: int
    images: int


class ApiVersion(BaseModel):
    version: str = "2"


class MetaTokens(BaseModel):
    input_tokens: int


class EmbedMeta(BaseModel):
    api_version: ApiVersion = ApiVersion()
    billed_units: BilledUnits
    tokens: MetaTokens


class CohereEmbedResponse(BaseModel):
    """Cohere's v2 answer: ``embeddings`` by type; ``texts`` echoes the texts when ``texts`` was sent."""

    id: str
    response_type: Literal["embeddings_by_type"] = "embeddings_by_type"
    embeddings: dict[str, list]
    texts: list[str] | None = None
    meta: EmbedMeta
