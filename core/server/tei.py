"""Text Embeddings Inference's API on the same server: the steps and shapes behind TEI's routes
(:mod:`poolrunner.core.server.routes.tei`), computed by the runtime's front end like every other
route, and TEI's bodies on the routes it shares with vLLM (``/rerank``, ``/tokenize``).

Errors are TEI's ``{"error", "error_type"}`` (see :mod:`poolrunner.core.server.errors`): 400 Empty,
422 Validation / Tokenizer, 424 Backend (the model does not serve the route's task), 429
Overloaded, 413 for a chunked body over the size limit (a Content-Length over it is refused by the
middleware first, in OpenAI's shape).

Where poolrunner's rules are stricter than TEI's they stay: ``dimensions`` only for Matryoshka
models, an over-long input is an error unless ``truncate`` (or ``--auto-truncate``) asks to keep
the model maximum, token ids outside the vocabulary are refused.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import numpy as np
from fastapi import Request

from poolrunner.core.errors import InputTooLongError, PromptTooLongError, truncation_helps, with_advice
from poolrunner.core.frontend import requests as fr
from poolrunner.core.server import protocol as p
from poolrunner.core.server import tei_protocol as t
from poolrunner.core.server.errors import TeiError
from poolrunner.core.server.models import ModelRouter
from poolrunner.core.server.service import PoolingService
from poolrunner.core.server.settings import ServerSettings
from poolrunner.core.validators import shown

TASK_USES = {
    "embed": "embeddings",
    "token_embed": "per-token embeddings",
    "sparse_embed": "sparse embeddings: a SPLADE model with the poolrunner-splade plugin installed",
    "classify": "label scores: a *ForSequenceClassification model",
}
"""What each task TEI's routes need is, for the 424 a model without it answers."""

TEI_POOLING = {"CLS": "cls", "MEAN": "mean", "LAST": "last_token"}
"""TEI's names of the pooling types it shares with poolrunner (``/info``); others are lowercased."""


def named(served: ModelRouter, model: object, task: str | None = None) -> PoolingService:
    """The model a TEI body asks for: its ``model`` where it names a served model or LoRA adapter
    (TEI serves one model and has no such field: any other value is ignored), else the first
    model for ``task`` (:meth:`~poolrunner.core.server.models.ModelRouter.pick`)."""
    return served.pick(model if isinstance(model, str) and served.knows(model) else None, task)


def answering(served: ModelRouter, task: str, route: str, model: object = None) -> PoolingService:
    """The model answering TEI's ``route``, which needs ``task``: :func:`named`'s.

    :raises TeiError: 424 Backend, as TEI answers a route the model type cannot serve.
    """
    service = named(served, model, task)
    if task not in service.frontend.tasks:
        raise TeiError("Backend", f"{route} needs a model that serves the task {task!r} ({TASK_USES[task]}); "
                                  f"this one serves {sorted(service.frontend.tasks)}")
    return service


def info(service: PoolingService) -> t.Info:
    """TEI's ``Info`` of ``service``'s model: the model, its type (embedding pooling, or a
    classifier's labels) and the limits."""
    runtime, settings = service.runtime, service.settings
    return t.Info(
        model_id=service.public_text(str(runtime.config.model or service.model_name)),  # never a local path
        model_sha=runtime.config.revision,
        model_dtype=runtime.precision, served_model_name=service.model_name,
        model_type=_model_type(service), max_concurrent_requests=settings.max_waiting_requests,
        max_input_length=runtime.model_config.max_model_len,
        max_batch_tokens=runtime.max_num_batched_tokens,
        max_batch_requests=runtime.config.max_num_seqs, max_client_batch_size=settings.max_inputs_per_request,
        auto_truncate=settings.auto_truncate, version=_version(),
    )


# ---- shared steps ----


def batch(settings: ServerSettings, inputs: t.EmbedInputs) -> list[fr.Input]:
    """TEI's ``Input`` as a list: a text or one token-id list is one input."""
    items = list(fr.as_items(inputs))  # type: ignore[arg-type]
    check_items(settings, items)
    return items


def check_items(settings: ServerSettings, items: list[Any], what: str = "inputs") -> None:
    """TEI's checks before tokenizing: not empty (400 Empty; a pair only when both its texts
    are, as TEI's ``EncodingInput::is_empty``), within the client batch size (422).

    :raises TeiError: naming the empty item, or the count and the limit.
    """
    if not items:
        raise TeiError("Empty", f"{what} is empty: send at least one input")
    limit = settings.max_inputs_per_request
    if len(items) > limit:
        raise TeiError("Validation", f"{what} has {len(items)} items, more than the limit of {limit} per "
                                     "request (max_client_batch_size; poolrunner serve --max-inputs-per-request)")
    for index, item in enumerate(items):
        parts = item if isinstance(item, tuple) else (item,)
        if all(isinstance(part, str | list) and not part for part in parts):  # other kinds: the core's check
            raise TeiError("Empty", f"{what}[{index}] is empty" if len(items) > 1 else f"{what} is empty")


async def answer(service: PoolingService, request: Request, frontend_request: fr.Request) -> Any:
    """``frontend_request``'s answer from the serving loop, batched with every other client's
    requests; an over-long input's error names TEI's ``truncate`` field.

    :raises TeiError: 422 Validation for an input over the model maximum.
    """
    try:
        result, _ = await service.answer(request, frontend_request)
    except (PromptTooLongError, InputTooLongError) as exc:
        if frontend_request.tokenization.truncate_prompt_tokens is not None or not truncation_helps(exc):
            raise TeiError("Validation", str(exc)) from exc  # truncating already, or in vain: the core's advice
        # the core's advice names truncate_prompt_tokens, not TEI's field
        raise TeiError("Validation", with_advice(str(exc), 'shorten it or send "truncate": true')) from exc
    return result


def _model_type(service: PoolingService) -> dict[str, t.EmbeddingModel | t.ClassifierModel]:
    """TEI's ``model_type``: a classifier's labels (``reranker`` for one label), else the pooling."""
    config, task = service.runtime.model_config, service.frontend.default_task
    if task == "classify":
        labels = t.ClassifierModel(id2label={str(i): label for i, label in enumerate(config.labels)},
                                   label2id={label: i for i, label in enumerate(config.labels)})
        return {"reranker" if len(config.labels) == 1 else "classifier": labels}
    if task == "sparse_embed":
        return {"embedding": t.EmbeddingModel(pooling="splade")}
    return {"embedding": t.EmbeddingModel(pooling=TEI_POOLING.get(config.pooling_type, config.pooling_type.lower()))}


# ---- TEI's bodies on the routes it shares with vLLM (/rerank, /tokenize; see :mod:`.routes`) ----


async def tei_rerank(served: ModelRouter, body: p.RerankRequest, request: Request) -> list[p.TeiRank]:
    """TEI's rerank, by :func:`named`'s model for scoring: every text, best first, equal scores
    the later text first (TEI sorts ascending, then reverses); ``raw_scores`` skips the
    cross-encoder's activation, ``truncate`` (default: the server's ``auto_truncate``) keeps the
    model maximum of each pair.

    :raises TeiError: 422 Validation for ``texts`` that is neither a list nor a text; 400 Empty for an
        empty one, or for an empty text beside an empty query.
    """
    service = named(served, body.model, "score")
    if not isinstance(body.texts, list | str):  # a list (or one text) is checked by the core, naming the item
        raise TeiError("Validation", f"texts must be a list of strings, got {shown(body.texts)}")
    if not body.texts:
        raise TeiError("Empty", "texts is empty: send at least one text")
    service.check_count(len(body.texts), "texts")
    # TEI refuses a pair only when both its texts are empty (EncodingInput::is_empty)
    if body.query == "" and isinstance(body.texts, list) and "" in body.texts:
        raise TeiError("Empty", f"query and texts[{body.texts.index('')}] are both empty")
    ranked = await answer(service, request, body.to_tei_request(service.settings.auto_truncate))
    ranked = sorted(ranked, key=lambda r: (r.score, r.index), reverse=True)
    return [p.TeiRank(index=r.index, score=r.score, text=r.document) for r in ranked]


async def tei_tokens(service: PoolingService, body: p.TokenizeRequest, request: Request) -> list[list[p.TeiToken]]:
    """TEI's tokenize: a list of tokens per input (one list for one text), spans in UTF-8 bytes
    and the input's own text for each token (counted from the start of ``prompt_name``'s prompt,
    as TEI's); a special token's text is the token itself.

    :raises TeiError: as :func:`check_items` (an empty text is TEI's 400 Empty).
    :raises ApiError: as :meth:`~poolrunner.core.server.service.PoolingService.tokens` (TEI's
        route answers it in TEI's shape).
    """
    tokenize = body.to_request()
    check_items(service.settings, list(tokenize.texts))
    answer = []
    tokens_of_texts = await service.tokens(request, tokenize, "inputs")
    for text, tokens in zip(service.frontend.prompted(tokenize), tokens_of_texts, strict=True):
        row = []
        for token in tokens:
            if token.span is None:
                row.append(p.TeiToken(id=token.id, text=token.token, special=True, start=None, stop=None))
                continue
            start, stop = (len(text[:offset].encode()) for offset in token.span)
            row.append(p.TeiToken(id=token.id, text=text[token.span[0]:token.span[1]], special=False,
                                  start=start, stop=stop))
        answer.append(row)
    return answer


def predict_items(inputs: t.PredictInputs) -> tuple[list[fr.Input], bool]:
    """TEI's ``PredictInput`` as ``(items, single)``: a text or a flat ``[text]`` /
    ``[text, text_pair]`` is one input; a list of those lists is a batch (``[]``: an empty one).

    :raises TeiError: 422 for a list of other than one or two texts.
    """
    if isinstance(inputs, str):
        return [inputs], True
    if inputs and all(isinstance(part, str) for part in inputs):
        return [_sequence(inputs, "inputs")], True  # type: ignore[arg-type]
    return [_sequence(sequence, f"inputs[{i}]") for i, sequence in enumerate(inputs)], False  # type: ignore[arg-type]


def _sequence(parts: list[str], where: str) -> fr.Input:
    """``[text]`` -> ``text``; ``[text, text_pair]`` -> a pair."""
    if not 1 <= len(parts) <= 2:
        raise TeiError("Validation", f"{where} has {len(parts)} texts: send a text, [text] or [text, text_pair]")
    return parts[0] if len(parts) == 1 else (parts[0], parts[1])


def ranked(scores: np.ndarray, labels: tuple[str, ...]) -> list[t.Prediction]:
    """Every label with its score, highest first, equal scores the later label first, as TEI
    sorts them (ascending, then reversed).

    :raises TeiError: 424 Backend for a NaN score, which has no rank (TEI's check too).
    """
    if np.isnan(scores).any():
        raise TeiError("Backend", "the model returned a NaN score")
    order = sorted(range(len(scores)), key=lambda i: (scores[i], i), reverse=True)
    return [t.Prediction(score=float(scores[i]), label=labels[i]) for i in order]


def sparse(output: dict[str, np.ndarray]) -> list[t.SparseValue]:
    """SPLADE's ``{"token_ids", "weights"}`` (by weight) as TEI's ``[{"index", "value"}]`` by token id."""
    order = np.argsort(output["token_ids"], kind="stable")
    return [t.SparseValue(index=int(output["token_ids"][i]), value=float(output["weights"][i])) for i in order]


def _version() -> str:
    return importlib.metadata.version("poolrunner")
