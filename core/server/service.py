"""What each endpoint computes: validated requests in, the runtime's serving loop, answers out.

Requests are built, scores planned and outputs converted by the runtime's
:class:`~poolrunner.core.frontend.Frontend`, the Python API's own path, so an answer equals what
``Runtime.embed`` / ``classify`` / ``score`` / ``rerank`` / ``encode`` return for the same input.
Only the HTTP limits and the client's disconnects are handled here.
"""

from __future__ import annotations

import asyncio
import copy
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from attrs import frozen
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from poolrunner.core import chunking, frontend
from poolrunner.core.frontend import ClassifyInput, Result
from poolrunner.core.plugin_api.output import RequestOutput
from poolrunner.core.frontend.quantize import Precision, check_ranges, quantize
from poolrunner.core.frontend.results import ClassificationResult, RerankResult
from poolrunner.core.runtime import Runtime, Serving
from poolrunner.core.frontend.scoring import pair_up, text_labels
from poolrunner.core.server.errors import ApiError
from poolrunner.core.server.metrics import ServerMetrics
from poolrunner.core.server.middleware import REQUEST_STATS
from poolrunner.core.server.settings import ServerSettings
from poolrunner.core.types import PoolingParams, PoolingRequest, TruncationSide
from poolrunner.core.validators import check_text

CLIENT_CLOSED = 499
"""Status recorded for a request whose client went away (nginx's convention); never sent."""


class PoolingService:
    """The runtime, its serving loop (while the app runs) and the limits, shared by all routes."""

    def __init__(self, runtime: Runtime, settings: ServerSettings, metrics: ServerMetrics,
                 model_name: str | Sequence[str]) -> None:
        self.runtime = runtime
        self.frontend = runtime.frontend
        self.settings = settings
        self.metrics = metrics
        self.model_names: tuple[str, ...] = (model_name,) if isinstance(model_name, str) else tuple(model_name)
        self.model_name = self.model_names[0]  # the name answers report (vLLM: the first served name)
        self.serving: Serving | None = None  # set by the app's lifespan

    def public_text(self, text: str) -> str:
        """``text`` with the model's folder path (how core names the model) replaced by the
        served model name: a client never learns paths on this machine."""
        config = self.runtime.model_config
        for local in sorted({config.name, config.path}, key=len, reverse=True):
            if len(local) > 1:
                text = text.replace(local, self.model_name)
        return text

    @property
    def alive(self) -> bool:
        return self.serving is not None and self.serving.alive

    @property
    def pending(self) -> int:
        return self.serving.pending if self.serving is not None else 0

    @property
    def waiting(self) -> int:
        return self.serving.waiting if self.serving is not None else 0

    async def prompts(self, body: Any) -> tuple[list[ClassifyInput], bool]:
        """A pooling body's inputs and whether to add special tokens: ``input`` as
        :meth:`inputs` reads it, or vLLM's chat form, ``messages`` rendered with the model's chat
        template into one text (special tokens then not added unless ``add_special_tokens``).

        :raises ApiError: 400 for both or neither of ``input`` and ``messages``, or ``chat_template``.
        :raises InvalidRequestError: when the messages cannot be rendered (no chat template...).
        """
        chat_fields = [name for name in ("add_generation_prompt", "continue_final_message", "chat_template",
                                         "chat_template_kwargs") if name in body.model_fields_set]
        if body.messages is None:
            if body.input is None:
                raise ApiError(400, "send input (texts or token ids) or messages (a chat)", param="input")
            if chat_fields:
                raise ApiError(400, f"{chat_fields[0]} applies to messages, not to input", param=chat_fields[0])
            return self.inputs(body.input), body.add_special_tokens is not False
        if body.input is not None:
            raise ApiError(400, "send input or messages, not both", param="messages")
        if body.chat_template is not None:
            raise ApiError(400, "chat_template is not accepted: messages are rendered with the model's own chat "
                                "template", param="chat_template")
        if not body.messages:
            raise ApiError(400, "messages is empty: send at least one message", param="messages")
        text = await run_in_threadpool(
            self.frontend.inputs.render_chat, [message.for_template() for message in body.messages],
            add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.chat_template_kwargs,
        )
        return [text], bool(body.add_special_tokens)

    def inputs(self, value: str | list[Any], what: str = "input") -> list[ClassifyInput]:
        """A text, texts, token ids or token-id lists as a list of inputs, within the limits."""
        items = frontend.as_items(value)
        if not items:
            raise ApiError(400, f"{what} is empty: send at least one text or token-id list", param=what)
        self.check_count(len(items), what)
        for index, item in enumerate(items):
            if isinstance(item, str) and not item:
                where = what if isinstance(value, str) else f"{what}[{index}]"
                raise ApiError(400, f"{where} is an empty string", param=what)
            if frontend.is_pair(item):
                for side, text in enumerate(item):
                    if not text:
                        raise ApiError(400, f"{what}[{index}][{side}] is an empty string", param=what)
        return items

    def check_count(self, count: int, what: str) -> None:
        limit = self.settings.max_inputs_per_request
        if count > limit:
            raise ApiError(400, f"{what} has {count} items, more than the limit of {limit} per request "
                                "(max_inputs_per_request)", param=what)

    async def run(
        self, request: Request, items: Sequence[ClassifyInput], params: PoolingParams,
        truncate_prompt_tokens: int | None, truncation_side: TruncationSide = "right", *,
        add_special_tokens: bool = True, priority: int | None = None,
    ) -> tuple[list[RequestOutput], int]:
        """Tokenize (in a worker thread), run through the loop; outputs in order and their token count.
        ``priority`` is vLLM's (lower runs first; ``None``: 0).

        :raises ApiError: as :meth:`run_requests`.
        """
        requests: list[PoolingRequest] = await run_in_threadpool(
            self.frontend.prepare, items, params, truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side, add_special_tokens=add_special_tokens,
        )
        return await self.run_requests(request, requests, priority=priority)

    async def run_requests(self, request: Request, requests: list[PoolingRequest], *, priority: int | None = None,
                           ) -> tuple[list[RequestOutput], int]:
        """Run prepared ``requests`` through the loop, batched with other clients'; as :meth:`run`.

        :raises ApiError: 503 when not serving; 413 when the engine requests (one per request, one
            per window of a long input) are more than ``max_waiting_requests``, which they could
            never fit (a queue merely busy now is
            :class:`~poolrunner.core.errors.QueueFullError`'s 429); 499 when the
            client disconnected (its requests are aborted then).
        """
        if self.serving is None:
            raise ApiError(503, "the server is not serving (starting up or shut down)")
        count, limit = len(chunking.expand(requests)[0]), self.settings.max_waiting_requests
        if count > limit:
            raise ApiError(413, f"this request needs {count} engine requests (one per text the model runs: each "
                                "input, each distinct text of a score or rerank, each window of a long input), "
                                f"more than the limit of {limit} waiting or running at once (max_waiting_requests, "
                                "the --max-waiting-requests flag): it could never be queued; send fewer inputs")
        num_tokens = sum(r.num_tokens for r in requests)
        self.metrics.request_tokens.observe(num_tokens)
        stats = REQUEST_STATS.get()
        if stats is not None:
            stats.inputs += len(requests)
            stats.tokens += num_tokens
        result = asyncio.ensure_future(self.serving.run(requests, priority=priority or 0))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not result.done():
                raise ApiError(CLIENT_CLOSED, "the client closed the connection")
            return result.result(), num_tokens
        finally:
            gone.cancel()
            result.cancel()  # a no-op once done; else its requests leave the engine

    async def embed(self, request: Request, items: Sequence[ClassifyInput], dimensions: int | None,
                    truncate_prompt_tokens: int | None, *, normalize: bool | None = None,
                    use_activation: bool | None = None, add_special_tokens: bool = True,
                    precision: Precision = "float32", ranges: Sequence[Sequence[float]] | None = None,
                    priority: int | None = None) -> tuple[list[np.ndarray], int]:
        """Like ``Runtime.embed``: one float32 ``[d]`` vector per input, or at a quantized
        ``precision`` (int8/uint8 ``[d]``, binary/ubinary ``[ceil(d / 8)]``) after ``dimensions``
        and normalization, calibrated on this request's embeddings unless ``ranges`` are given."""
        check_ranges(precision, ranges)
        params = self.frontend.params("embed", dimensions=dimensions, normalize=normalize,
                                      use_activation=use_activation)
        outputs, num_tokens = await self.run(request, items, params, truncate_prompt_tokens,
                                             add_special_tokens=add_special_tokens, priority=priority)
        vectors = frontend.embeddings(outputs)
        return _quantized(vectors, precision, ranges) if precision != "float32" else vectors, num_tokens

    async def classify(self, request: Request, items: Sequence[ClassifyInput], use_activation: bool | None,
                       truncate_prompt_tokens: int | None, *, add_special_tokens: bool = True,
                       priority: int | None = None) -> tuple[list[ClassificationResult], int]:
        """Like ``Runtime.classify`` (texts, token ids and ``(text, text_pair)`` pairs)."""
        params = self.frontend.params("classify", use_activation=use_activation)
        outputs, num_tokens = await self.run(request, items, params, truncate_prompt_tokens,
                                             add_special_tokens=add_special_tokens, priority=priority)
        return self.frontend.classifications(outputs), num_tokens

    async def score(self, request: Request, queries: str | list[str], documents: str | list[str],
                    use_activation: bool | None, truncate_prompt_tokens: int | None,
                    truncation_side: TruncationSide = "right", max_tokens_per_doc: int | None = None, *,
                    priority: int | None = None, names: tuple[str, str] = ("queries", "documents"),
                    options: Mapping[str, Any] | None = None) -> tuple[np.ndarray, int]:
        """``Runtime.score``'s own path (:meth:`Frontend.plan_score`): cosine of embeddings
        (bi-encoder), a one-label classifier's score of each pair (cross-encoder), or a plugin's
        ``score_outputs`` (SPLADE, ColBERT); ``[num_pairs]`` float32 and the token count.
        ``max_tokens_per_doc`` cuts each document to its first tokens (Cohere's, vLLM's field);
        ``names`` are the body's fields of the two sides, which errors name (``documents[2]``);
        ``options`` the plugins' request options, as ``Runtime.score`` takes them.

        :raises InvalidRequestError: for a side that is empty or holds text that is not valid
            Unicode (:func:`~poolrunner.core.frontend.scoring.check_side`), and the front end's errors.
        """
        check_max_tokens_per_doc(max_tokens_per_doc)
        pairs = pair_up(queries, documents, names=names)
        self.check_count(len(pairs), "pairs")
        plan = await run_in_threadpool(self.frontend.plan_score, pairs, truncate_prompt_tokens=truncate_prompt_tokens,
                                       truncation_side=truncation_side, use_activation=use_activation,
                                       max_document_tokens=max_tokens_per_doc, plugin_options=options,
                                       labels=text_labels(queries, documents, names=names))
        outputs, num_tokens = await self.run_requests(request, plan.requests, priority=priority)
        return await run_in_threadpool(plan.finish, outputs), num_tokens

    async def rerank(self, request: Request, query: str, documents: list[str], top_n: int | None,
                     return_documents: bool, truncate_prompt_tokens: int | None,
                     max_tokens_per_doc: int | None = None, *, priority: int | None = None,
                     options: Mapping[str, Any] | None = None) -> tuple[list[RerankResult], int]:
        """Like ``Runtime.rerank``: best first, ties in input order; results carry the whole
        documents even when ``max_tokens_per_doc`` scored their first tokens only."""
        frontend.check_top_n(top_n)
        self.check_count(len(documents), "documents")
        scores, num_tokens = await self.score(request, query, documents, None, truncate_prompt_tokens,
                                              max_tokens_per_doc=max_tokens_per_doc, priority=priority,
                                              names=("query", "documents"), options=options)
        return frontend.rank(scores, documents, top_n=top_n, return_documents=return_documents), num_tokens

    async def encode(self, request: Request, items: Sequence[ClassifyInput], task: str | None,
                     core: Mapping[str, Any], options: Mapping[str, Any],
                     truncate_prompt_tokens: int | None, *, add_special_tokens: bool = True,
                     precision: Precision = "float32", ranges: Sequence[Sequence[float]] | None = None,
                     priority: int | None = None) -> tuple[list[Result], int]:
        """Like ``Runtime.encode``: the raw result of any task the runtime serves, float outputs as
        float32 and integer ones (SPLADE's ``token_ids``) kept as they are (int64); ``embed``
        results at a quantized ``precision`` as :meth:`embed` gives them.

        :raises ApiError: 400 for a quantized ``precision`` on a task other than ``embed``.
        """
        check_ranges(precision, ranges)
        params = self.frontend.params(task, options, **core)
        if precision != "float32" and params.task != "embed":
            raise ApiError(400, f"precision={precision} applies to task 'embed', not {params.task!r}",
                           param="precision")
        outputs, num_tokens = await self.run(request, items, params, truncate_prompt_tokens,
                                             add_special_tokens=add_special_tokens, priority=priority)
        results = [frontend.to_array(output) for output in outputs]
        if precision != "float32":
            results = _quantized(results, precision, ranges)  # type: ignore[arg-type]
        return results, num_tokens

    async def tokenize(self, text: str) -> list[int]:
        """The model's ``prompt_token_ids`` for ``text``, checked against the model maximum."""
        ids = await run_in_threadpool(self.frontend.inputs.encode, [text])
        return list(ids[0])

    async def tokens(self, texts: list[str], add_special_tokens: bool) -> list[list[Token]]:
        """Each text's tokens with their character spans (``None`` for added special tokens),
        untruncated; in a worker thread, on :attr:`tokenizer`.

        :raises InvalidRequestError: for text that is not valid Unicode or over ``max_input_chars``.
        """
        for index, text in enumerate(texts):
            check_text(text, f"input {index}")
            self.frontend.inputs.check_chars(text, f"input {index}")
        return await run_in_threadpool(_tokens, self.tokenizer, texts, add_special_tokens)

    async def detokenize(self, ids: list[int]) -> str:
        """vLLM's ``/detokenize``: ``ids`` decoded as the tokenizer does, special tokens kept.

        :raises ApiError: 400 for an id outside the vocabulary.
        """
        vocab_size = self.frontend.inputs.vocab_size
        bad = next((i for i, token in enumerate(ids) if not 0 <= token < vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"tokens[{bad}] = {ids[bad]} is outside the vocabulary [0, {vocab_size})",
                           param="tokens")
        return await run_in_threadpool(self.tokenizer.decode, ids)

    @functools.cached_property
    def tokenizer(self) -> Any:
        """A copy of the model's tokenizer for the tokenize routes: their calls change the
        tokenizer's truncation settings, which the front end's shared tokenizer keeps per call."""
        return copy.deepcopy(self.frontend.inputs.tokenizer)


@frozen
class Token:
    """One token of :meth:`PoolingService.tokens`: ``span`` is ``(start, stop)`` in characters,
    ``None`` for a special token the tokenizer added."""

    id: int
    token: str
    special: bool
    span: tuple[int, int] | None


def _tokens(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[Token]]:
    encoded = tokenizer(texts, add_special_tokens=add_special_tokens, return_offsets_mapping=True,
                        return_special_tokens_mask=True, return_attention_mask=False,
                        return_token_type_ids=False, verbose=False)
    return [
        [Token(id=token_id, token=token, special=bool(special), span=None if special else tuple(span))
         for token_id, token, special, span in zip(encoded["input_ids"][row], encoded.tokens(row),
                                                   encoded["special_tokens_mask"][row],
                                                   encoded["offset_mapping"][row], strict=True)]
        for row in range(len(texts))
    ]


def check_max_tokens_per_doc(value: int | None) -> None:
    """:raises ApiError: 400 unless ``value`` is ``None`` or a positive integer."""
    if value is not None and value < 1:
        raise ApiError(400, f"max_tokens_per_doc must be a positive integer, got {value}", param="max_tokens_per_doc")


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the body was read already, so only that can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _quantized(vectors: list[np.ndarray], precision: Precision, ranges: Sequence[Sequence[float]] | None,
               ) -> list[np.ndarray]:
    """The request's ``[d]`` vectors at ``precision`` (:func:`~poolrunner.core.frontend.quantize.quantize`,
    as ``Runtime.embed(precision=...)``), calibrated on them unless ``ranges`` are given."""
    try:
        calibration = None if ranges is None else np.asarray(ranges, dtype=np.float32)
    except ValueError as exc:  # ragged lists
        raise ApiError(400, f"ranges must be two lists of d numbers (minima, maxima): {exc}", param="ranges") from exc
    return list(quantize(np.stack(vectors), precision, calibration))
