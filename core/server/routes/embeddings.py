"""OpenAI's and vLLM's embedding routes: ``POST /v1/embeddings`` and ``/embeddings`` (OpenAI's
body with vLLM's fields, and infinity's ``modality``), vLLM's ``/pooling`` (any served task, plugin
request options as body fields; added per app, see :mod:`.dependencies`) and ``/classify``
(vLLM's body, or infinity's)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from poolrunner.core.errors import TokenOutOfVocabularyError
from poolrunner.core.server import infinity_protocol as i
from poolrunner.core.server import protocol as p
from poolrunner.core.server.errors import ApiError
from poolrunner.core.server.payload import bytes_response, encode_array, json_response
from poolrunner.core.server.routes import infinity
from poolrunner.core.server.routes.answers import answer_id, usage
from poolrunner.core.server.routes.dependencies import OptionBodies, Served, with_body
from poolrunner.core.server.service import PoolingService
from poolrunner.core.server.tiktoken_inputs import FOREIGN_IDS_HINT, read_inputs

router = APIRouter()


@router.post("/embeddings", response_model=p.EmbeddingResponse)  # vLLM serves both
@router.post("/v1/embeddings", response_model=p.EmbeddingResponse)
async def embeddings(body: p.EmbeddingRequest, request: Request, served: Served) -> p.EmbeddingResponse | Response:
    """OpenAI's embeddings with vLLM's fields: one vector per input (or one for ``messages``),
    in input order; ``bytes`` answers vLLM's octet-stream body with its ``metadata`` header.
    Token-id inputs are tiktoken's under ``--token-id-inputs`` (:func:`read_inputs`)."""
    service = served.pick(body.model, "embed")
    _check_encoding(body)
    items, add_special_tokens = await service.prompts(body)
    decoded = read_inputs(service.settings, body.model, items)
    try:
        vectors, num_tokens = await service.answer(request, body.to_request(decoded.inputs, add_special_tokens),
                                                   priority=body.priority)
    except TokenOutOfVocabularyError as exc:  # only without --token-id-inputs: then ids are texts already
        raise ApiError(400, f"{exc}: {FOREIGN_IDS_HINT}", param="input") from None
    vectors = decoded.answers(vectors)
    if body.encoding_format in ("bytes", "bytes_only"):
        return _bytes(body, service, vectors, "embd", num_tokens)
    data = [p.EmbeddingData(index=i, embedding=e) for i, e in enumerate(_encoded(body, vectors))]
    return p.EmbeddingResponse(id=answer_id("embd", body.request_id), created=int(time.time()), data=data,
                               model=service.answered_name, usage=usage(num_tokens))


@router.post("/classify", response_model=p.ClassificationResponse | i.InfinityClassifyResponse)
async def classify(body: p.ClassificationRequest, request: Request,
                   served: Served) -> p.ClassificationResponse | Response:
    """vLLM's classify: texts, token ids, ``[text, text_pair]`` pairs or a chat (``messages``);
    infinity's body (``raw_scores``) gets infinity's answer."""
    service = served.pick(body.model, "classify")
    if body.api() == "infinity":  # a Response: written as it is
        return JSONResponse((await infinity.classify(service, body, request)).model_dump())
    results, num_tokens = await service.answer_prompts(request, body)
    data = [p.ClassificationData(index=i, label=r.label, probs=r.probs.tolist(), num_classes=len(r.probs))
            for i, r in enumerate(results)]
    return p.ClassificationResponse(id=answer_id("classify", body.request_id), created=int(time.time()),
                                    model=service.answered_name, data=data, usage=usage(num_tokens))


async def pooling(body: p.PoolingHttpRequest, request: Request, served: Served) -> Response:
    """Any task the model serves; per-token tasks answer one ``[num_tokens, d]`` list each.
    Each output keeps its dtype: integer outputs (SPLADE's ``token_ids``) are ints, or int64 in base64.
    The plugins' request options are body fields of their own."""
    service = served.pick(body.model, body.task)
    _check_encoding(body)
    outputs, num_tokens = await service.answer_prompts(request, body)
    if body.encoding_format in ("bytes", "bytes_only"):
        return _bytes(body, service, outputs, "pool", num_tokens)
    # PoolingResponse's fields, its data written from the arrays in a worker thread (json_response):
    # per-token answers are megabytes, never Python lists, pydantic models and JSON all at once
    answer = p.PoolingResponse(id=answer_id("pool", body.request_id), created=int(time.time()),
                               model=service.answered_name, data=[], usage=usage(num_tokens)).model_dump(mode="json")
    answer["data"] = [{"object": "pooling", "index": i, "data": d}
                      for i, d in enumerate(_encoded(body, outputs, lists=False))]
    del outputs
    return await json_response(answer)


def option_routes(bodies: OptionBodies) -> APIRouter:
    """``/pooling``, its body the app's (a field per plugin request option)."""
    router = APIRouter()
    router.add_api_route("/pooling", with_body(pooling, bodies.pooling), methods=["POST"],
                         response_model=p.PoolingResponse)
    return router


def _encoded(body: Any, arrays: list[np.ndarray] | list[Any], *, lists: bool = True) -> list[Any]:
    """Each array as ``body.encoding_format`` asks (float or base64; ``embed_dtype``, ``endianness``);
    float arrays stay arrays unless ``lists`` (:func:`~poolrunner.core.server.payload.encode_array`)."""
    def encode(output: np.ndarray | dict[str, np.ndarray]) -> object:
        if isinstance(output, dict):
            return {name: encode_array(array, body.encoding_format, body.embed_dtype, body.endianness, lists=lists)
                    for name, array in output.items()}
        return encode_array(output, body.encoding_format, body.embed_dtype, body.endianness, lists=lists)

    return [encode(array) for array in arrays]


def _check_encoding(body: Any) -> None:
    """:raises ApiError: 400 for ``embed_dtype`` with a quantized ``precision`` (its payload is
    the integer codes)."""
    if body.precision != "float32" and "embed_dtype" in body.model_fields_set and body.embed_dtype != "float32":
        raise ApiError(400, f"embed_dtype={body.embed_dtype} applies to float embeddings; precision="
                            f"{body.precision} sends its {body.precision} codes", param="embed_dtype")


def _bytes(body: Any, service: PoolingService, arrays: list[Any], prefix: str, num_tokens: int) -> Response:
    """vLLM's ``bytes`` / ``bytes_only`` answer (:func:`bytes_response`) for ``arrays``.

    :raises ApiError: 400 for named outputs (one array per input is needed).
    """
    if any(isinstance(array, dict) for array in arrays):
        raise ApiError(400, f"encoding_format={body.encoding_format} needs one array per input; this task "
                            "answers named outputs: use float or base64", param="encoding_format")
    return bytes_response(arrays, embed_dtype=body.embed_dtype, endianness=body.endianness,
                          metadata=body.encoding_format == "bytes", response_id=answer_id(prefix, body.request_id),
                          created=int(time.time()), model=service.answered_name, num_tokens=num_tokens,
                          precision=body.precision)
