"""Text Embeddings Inference's routes (TEI's ``router/src/http/server.rs``): ``POST /embed``,
``/embed_all``, ``/embed_sparse``, ``/predict``, ``/similarity``, ``/decode``, ``GET /info``, and
``POST /`` (also SageMaker's ``/invocations`` for a TEI body), which answers as the served
model's own route, as TEI's does (``GET /`` and ``GET /ping``, TEI's health checks, are
:mod:`.admin`'s). TEI's bodies name no model: each route is answered by the served model that
fits its task (:meth:`ModelRouter.pick`). Every error is in TEI's shape (:class:`TeiRoute`); the
steps and rules are :mod:`poolrunner.core.server.tei`'s.
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Body, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from poolrunner.core.server import protocol as p
from poolrunner.core.server import tei
from poolrunner.core.server import tei_protocol as t
from poolrunner.core.server.errors import TeiError, TeiRoute
from poolrunner.core.server.payload import json_response
from poolrunner.core.server.routes.dependencies import Served
from poolrunner.core.similarity import similarity_pairwise
from poolrunner.core.validators import shown

router = APIRouter(route_class=TeiRoute, tags=["Text Embeddings Inference"])


@router.post("/embed", response_model=list[list[float]])
async def embed(body: t.EmbedRequest, request: Request, served: Served) -> list[list[float]]:
    """One pooled ``[d]`` vector per input, ``[[...]]`` for a single input too (TEI's
    ``EmbedResponse``); ``normalize`` defaults to true, ``dimensions`` slices first."""
    items = tei.batch(served.settings, body.inputs)
    service = tei.answering(served, "embed", "/embed", body.model)
    vectors = await tei.answer(service, request, body.to_request(items, served.settings.auto_truncate))
    return [vector.tolist() for vector in vectors]


@router.post("/embed_all", response_model=list[list[list[float]]])
async def embed_all(body: t.TokenRequest, request: Request, served: Served) -> Response:
    """Every token's hidden state, unpooled and unnormalized: ``[num_tokens, hidden]`` per
    input (task ``token_embed``), special tokens included, as TEI's ``/embed_all``; written
    from the arrays in a worker thread (:func:`~poolrunner.core.server.payload.json_response`)."""
    items = tei.batch(served.settings, body.inputs)
    service = tei.answering(served, "token_embed", "/embed_all", body.model)
    results = await tei.answer(service, request, body.to_request(items, served.settings.auto_truncate, "token_embed"))
    return await json_response(results)


@router.post("/embed_sparse", response_model=list[list[t.SparseValue]])
async def embed_sparse(body: t.TokenRequest, request: Request, served: Served) -> list[list[t.SparseValue]]:
    """The non-zero entries of each input's vocabulary-sized SPLADE vector (task
    ``sparse_embed``), by ascending token id as TEI lists them: ``[{"index", "value"}, ...]``."""
    items = tei.batch(served.settings, body.inputs)
    service = tei.answering(served, "sparse_embed", "/embed_sparse", body.model)
    results = await tei.answer(service, request,
                               body.to_request(items, served.settings.auto_truncate, "sparse_embed"))
    return [tei.sparse(result) for result in results]


@router.post("/predict", response_model=list[t.Prediction] | list[list[t.Prediction]])
async def predict(body: t.PredictRequest, request: Request,
                  served: Served) -> list[t.Prediction] | list[list[t.Prediction]]:
    """Every label's score, best first, per input; a flat list for a single input (a text,
    ``[text]`` or ``[text, text_pair]``), a list of them for a batch, as TEI's
    ``PredictResponse``. ``raw_scores`` returns the logits instead of probabilities."""
    items, single = tei.predict_items(body.inputs)
    tei.check_items(served.settings, items)
    service = tei.answering(served, "classify", "/predict", body.model)
    results = await tei.answer(service, request, body.to_request(items, served.settings.auto_truncate))
    ranked = [tei.ranked(result.probs, result.labels) for result in results]
    return ranked[0] if single else ranked


@router.post("/similarity", response_model=list[float])
async def similarity(body: t.SimilarityRequest, request: Request, served: Served) -> list[float]:
    """Cosine of ``source_sentence``'s embedding with each of ``sentences``' (TEI's
    ``/similarity``, the ``sentence-similarity`` task): ``[len(sentences)]`` floats."""
    if not body.inputs.sentences:
        raise TeiError("Empty", "inputs.sentences is empty: send at least one sentence")
    embeddings = body.to_request(served.settings.auto_truncate)
    tei.check_items(served.settings, list(embeddings.inputs))
    service = tei.answering(served, "embed", "/similarity", body.model)
    vectors = np.stack(await tei.answer(service, request, embeddings))
    return similarity_pairwise(np.repeat(vectors[:1], len(vectors) - 1, axis=0), vectors[1:], "cosine").tolist()


@router.post("/decode", response_model=list[str])
async def decode(body: t.DecodeRequest, served: Served) -> list[str]:
    """Each token-id list back to text with the model's tokenizer, one string per list
    (``[ids]`` for one list too), special tokens skipped unless ``skip_special_tokens`` is false."""
    batch = body.ids if body.ids and isinstance(body.ids[0], list) else [body.ids]
    tei.check_items(served.settings, batch, "ids")  # type: ignore[arg-type]
    tokenizer = served.default.frontend.inputs.tokenizer
    for index, ids in enumerate(batch):
        bad = [token for token in ids if not 0 <= token < len(tokenizer)]  # type: ignore[union-attr]
        if bad:
            raise TeiError("Tokenizer", f"ids[{index}]: token id {shown(bad[0])} is outside the vocabulary "
                                        f"[0, {len(tokenizer)})")
    return await run_in_threadpool(tokenizer.batch_decode, batch, skip_special_tokens=body.skip_special_tokens)


@router.get("/info", response_model=t.Info)
async def info(served: Served) -> t.Info:
    """TEI's ``Info`` of the default (first) model: the model, its type (embedding pooling, or
    a classifier's labels) and the limits."""
    return tei.info(served.default)


@router.post("/", response_model=None)
async def default_route(request: Request, body: Annotated[dict[str, Any], Body()], served: Served) -> Any:
    """``POST /`` (and SageMaker's ``/invocations`` for a TEI body): the default model's own
    route, as TEI picks it: ``/rerank`` for a one-label classifier (a body without ``inputs``),
    ``/predict`` for a classifier, ``/embed_sparse`` for SPLADE, else ``/embed``; a
    ``sentence-similarity`` body (``inputs`` an object) goes to ``/similarity``, where TEI needs
    its ``TASK`` variable set to say so."""
    if isinstance(body.get("inputs"), dict):
        return await similarity(t.SimilarityRequest.model_validate(body), request, served)
    task = served.default.frontend.default_task
    if served.default.frontend.cross_encoder and "inputs" not in body:
        return await _rerank(p.RerankRequest.model_validate(body), request, served)
    if task == "classify":
        return await predict(t.PredictRequest.model_validate(body), request, served)
    if task == "sparse_embed":
        return await embed_sparse(t.TokenRequest.model_validate(body), request, served)
    return await embed(t.EmbedRequest.model_validate(body), request, served)


async def _rerank(body: p.RerankRequest, request: Request, served: Served) -> JSONResponse:
    """``POST /`` of a reranker: TEI's ``/rerank`` of the default model."""
    if body.api() != "tei":
        raise TeiError("Validation", "POST / of a reranker takes TEI's rerank body: query and texts")
    ranked = await tei.tei_rerank(served, body, request)
    return JSONResponse([rank.model_dump(exclude_none=True) for rank in ranked])
