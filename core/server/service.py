"""The HTTP side of running a request: limits, the serving loop, the client's disconnects, metrics.

Routes build a request object (a body's ``to_request()``) and :meth:`PoolingService.answer` it:
the runtime's :class:`~poolrunner.core.frontend.plans.Frontend` plans it, the Python API's own
path, so an answer equals what ``Runtime.embed`` / ``classify`` / ``score`` / ``rerank`` /
``encode`` / ``tokenize`` return for the same input. Nothing here is per operation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from contextvars import ContextVar
from typing import Any, TypeVar

import attrs
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from poolrunner.core.errors import InputTooLongError, with_advice
from poolrunner.core.frontend import chunking
from poolrunner.core.frontend.plans import Plan
from poolrunner.core.frontend.requests import Input, RerankRequest, ScoreRequest, TokenizeRequest, as_items, is_pair
from poolrunner.core.frontend.requests import Request as FrontendRequest
from poolrunner.core.runtime import Runtime, Serving
from poolrunner.core.server.admission import NO_LEASE, Lease, OutputBudget
from poolrunner.core.server.errors import ApiError
from poolrunner.core.server.metrics import ServerMetrics
from poolrunner.core.server.middleware import REQUEST_STATS
from poolrunner.core.server.protocol import text_image_prompt
from poolrunner.core.server.settings import MAX_PRIORITY, ServerSettings
from poolrunner.core.types import PoolingRequest

T = TypeVar("T")
CLIENT_CLOSED = 499
"""Status recorded for a request whose client went away (nginx's convention); never sent."""


class PoolingService:
    """The runtime, its serving loop (while the app runs) and the limits, shared by all routes."""

    def __init__(self, runtime: Runtime, settings: ServerSettings, metrics: ServerMetrics,
                 model_name: str | Sequence[str], budget: OutputBudget | None = None) -> None:
        self.runtime = runtime
        self.frontend = runtime.frontend
        self.settings = settings
        self.metrics = metrics
        # the server's budget of per-token values in flight, shared by all its models
        self.budget = budget if budget is not None else OutputBudget(settings.output_budget)
        self.model_names: tuple[str, ...] = (model_name,) if isinstance(model_name, str) else tuple(model_name)
        self.model_name = self.model_names[0]  # the name answers report (vLLM: the first served name)
        self.serving: Serving | None = None  # set by the app's lifespan

    @property
    def answered_name(self) -> str:
        """The ``model`` an answer reports: the LoRA adapter the request named, else the model's
        first served name (vLLM's answers name the adapter)."""
        return ADAPTER.get() or self.model_name

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

    async def prompts(self, body: Any) -> tuple[list[Input], bool]:
        """A pooling body's inputs and whether to add special tokens: ``input`` as
        :meth:`inputs` reads it, or vLLM's chat form, ``messages`` rendered with the model's chat
        template into one text (special tokens then not added unless ``add_special_tokens``).
        For a text-image model (CLIP), or messages holding an image, the messages make one text
        or one image instead (:func:`~poolrunner.core.server.protocol.text_image_prompt`), and
        its text gets the tokenizer's special tokens unless ``add_special_tokens`` is false: CLIP
        pools the end-of-text token, so without them the vector is not CLIP's (vLLM's default
        for messages leaves them out; poolrunner answers what ``input`` with the same text does).

        :raises ApiError: 400 for both or neither of ``input`` and ``messages``, or ``chat_template``.
        :raises InvalidRequestError: when the messages cannot be rendered (no chat template...).
        """
        chat_fields = body.chat_fields()
        if body.messages is None:
            if body.input is None:
                raise ApiError(400, "send input (texts or token ids) or messages (a chat)", param="input")
            if chat_fields:
                raise ApiError(400, f"{chat_fields[0]} applies to messages, not to input", param=chat_fields[0])
            return self.inputs(body.input), body.add_special_tokens is not False
        if body.input is not None:
            raise ApiError(400, "send input or messages, not both", param="messages")
        prompt, add_special_tokens = await self.chat_prompt(body)
        return [prompt], add_special_tokens

    async def chat_prompt(self, body: Any) -> tuple[Input, bool]:
        """``body.messages`` as one prompt, and whether to add special tokens (see :meth:`prompts`).

        :raises ApiError: 400 for ``chat_template``, or no messages.
        :raises InvalidRequestError: when the messages cannot be rendered (no chat template...).
        """
        if body.chat_template is not None:
            raise ApiError(400, "chat_template is not accepted: messages are rendered with the model's chat "
                                "template (the server's --chat-template, else the tokenizer's)",
                           param="chat_template")
        if not body.messages:
            raise ApiError(400, "messages is empty: send at least one message", param="messages")
        if self.frontend.images is not None or any(message.image_urls() for message in body.messages):
            return text_image_prompt(body.messages), body.add_special_tokens is not False
        text = await run_in_threadpool(
            self.frontend.inputs.render_chat, [message.for_template() for message in body.messages],
            add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.chat_template_kwargs, tools=getattr(body, "tools", None),
        )
        return text, bool(body.add_special_tokens)

    def inputs(self, value: str | list[Any], what: str = "input") -> list[Input]:
        """A text, texts, token ids or token-id lists as a list of inputs, within the limits."""
        items = list(as_items(value))
        if not items:
            raise ApiError(400, f"{what} is empty: send at least one text or token-id list", param=what)
        self.check_count(len(items), what)
        for index, item in enumerate(items):
            if isinstance(item, str) and not item:
                where = what if isinstance(value, str) else f"{what}[{index}]"
                raise ApiError(400, f"{where} is an empty string", param=what)
            if is_pair(item):
                for side, text in enumerate(item):
                    if not text:
                        raise ApiError(400, f"{what}[{index}][{side}] is an empty string", param=what)
        return items

    def check_count(self, count: int, what: str) -> None:
        limit = self.settings.max_inputs_per_request
        if count > limit:
            raise ApiError(400, f"{what} has {count} items, more than the limit of {limit} per request "
                                "(max_inputs_per_request, the --max-inputs-per-request flag)", param=what)

    async def answer_prompts(self, request: Request, body: Any) -> tuple[Any, int]:
        r"""The answer to a body of prompts (``input`` or ``messages``: embeddings, classify,
        pooling): :meth:`prompts`, then the body's ``to_request`` of them, :meth:`answer`\ ed."""
        items, add_special_tokens = await self.prompts(body)
        return await self.answer(request, body.to_request(items, add_special_tokens), priority=body.priority)

    async def tokens(self, request: Request, tokenize: TokenizeRequest, field: str) -> Any:
        """``tokenize``'s answer (:meth:`answer`) for a ``/tokenize`` body, vLLM's or TEI's.

        :raises ApiError: 400 (TEI's shape: 422 Validation) naming ``field`` for a text over
            ``max_input_chars``, advising to shorten it: neither body takes a truncation, which
            the core's advice names.
        """
        try:
            answer, _ = await self.answer(request, tokenize)
        except InputTooLongError as exc:
            raise ApiError(400, with_advice(str(exc), "shorten it"), param=field) from None
        stats = REQUEST_STATS.get()
        if stats is not None:  # the access log's counts: no engine request was run for them
            stats.inputs += len(answer)
            stats.tokens += sum(len(tokens) for tokens in answer)
        return answer

    async def answer(self, request: Request, frontend_request: FrontendRequest, *, priority: int | None = None,
                     ) -> tuple[Any, int]:
        """Check ``frontend_request`` against the request limits, plan it (it tokenizes: in a
        worker thread, or for a short one on the event loop, :meth:`plans_inline`) and
        :meth:`execute` the plan; the answer and its token count.

        :raises ApiError: 400 for more items than ``max_inputs_per_request``; as :meth:`execute`.
        :raises InvalidRequestError: from the plan, for bad input.

        A request whose ``model`` named one of this model's LoRA adapters (:data:`ADAPTER`, set by
        the router) runs with that adapter.
        """
        self.check_count(*_size(frontend_request))
        frontend_request = with_adapter(frontend_request, ADAPTER.get())
        if self.plans_inline(frontend_request):
            plan = self.frontend.plan(frontend_request)
        else:
            plan = await run_in_threadpool(self.frontend.plan, frontend_request)
        answer = await self.execute(request, plan, priority=priority)
        if frontend_request.tokenization.lora is not None:
            self.metrics.lora_requests.labels(lora=frontend_request.tokenization.lora).inc()
        return answer

    def plans_inline(self, request: FrontendRequest) -> bool:
        """Whether :meth:`answer` plans ``request`` on the event loop: an embed or classify request
        of texts (or text pairs) of at most :data:`INLINE_PLAN_CHARS` characters in all, for a
        model without image inputs (whose strings may be image URLs, fetched while planning).
        Tokenizing those takes tens of microseconds; handing them to a worker thread and back
        cost more, in the event loop's own time, than the tokenizing (``bench/serve.py``'s
        profile of 16 clients). Anything larger is planned in a worker thread, so one big body
        never holds up the other clients."""
        inputs = getattr(request, "inputs", None)
        if inputs is None or self.frontend.images is not None:
            return False
        chars = 0
        for item in inputs:
            texts = item if is_pair(item) else (item,)
            if not all(isinstance(text, str) for text in texts):
                return False
            chars += sum(len(text) for text in texts)
            if chars > INLINE_PLAN_CHARS:
                return False
        return True

    async def execute(self, request: Request, plan: Plan[Any], *, priority: int | None = None) -> tuple[Any, int]:
        """Run ``plan``'s engine requests through the loop, batched with other clients' (``priority``
        is vLLM's: lower runs first; ``None``: 0); its answer and the requests' token count.

        :raises ApiError: 503 when not serving; 413 when the engine requests (one per request, one
            per window of a long input) are more than ``max_waiting_requests``, which they could
            never fit (a queue merely busy now is
            :class:`~poolrunner.core.errors.QueueFullError`'s 429), or their per-token outputs
            more than ``max_output_values``; 499 when the client disconnected (its requests are
            aborted then, or it stops waiting for room in the output budget).

        Per-token work first waits for room in the server's :class:`OutputBudget` (its values
        are held until the answer is sent: :meth:`_lease`).
        """
        requests = plan.requests
        if not requests:  # tokenize: answered by the plan alone
            return plan.finish([]), 0
        priority = self._priority(priority)
        if self.serving is None:
            raise ApiError(503, "the server is not serving (starting up or shut down)")
        count, limit = len(chunking.expand(requests)[0]), self.settings.max_waiting_requests
        if count > limit:
            raise ApiError(413, f"this request needs {count} engine requests (one per text the model runs: each "
                                "input, each distinct text of a score or rerank, each window of a long input), "
                                f"more than the limit of {limit} waiting or running at once (max_waiting_requests, "
                                "the --max-waiting-requests flag): it could never be queued; send fewer inputs")
        num_tokens = sum(r.num_tokens for r in requests)
        values = self._output_values(requests)
        self.metrics.request_tokens.observe(num_tokens)
        stats = REQUEST_STATS.get()
        if stats is not None:
            stats.inputs += len(requests)
            stats.tokens += num_tokens
        lease = await self._lease(request, values)
        if stats is not None:  # released once the answer is sent
            stats.leases.append(lease)
        try:
            outputs = await _unless_gone(request, self.serving.run(requests, priority=priority))
            return (await run_in_threadpool(plan.finish, outputs) if plan.offload else plan.finish(outputs)), num_tokens
        finally:
            if stats is None:
                lease.release()

    def _output_values(self, requests: Sequence[PoolingRequest]) -> int:
        """The values (tokens x hidden size) of the per-token outputs of ``requests``.

        :raises ApiError: 413 when they would pass ``max_output_values``.
        """
        tokens = sum(r.num_tokens for r in requests if r.params.task in PER_TOKEN_TASKS)
        values, limit = tokens * self.frontend.model_config.hidden_size, self.settings.max_output_values
        if values > limit:
            raise ApiError(413, f"this request's per-token outputs would hold {values} values ({tokens} tokens x "
                                f"{self.frontend.model_config.hidden_size}), more than the limit of {limit} per "
                                "request (max_output_values, the --max-output-values flag); send fewer or shorter "
                                "inputs per request")
        return values

    async def _lease(self, request: Request, values: int) -> Lease:
        """``values`` of the output budget, once they fit (:meth:`OutputBudget.acquire`); nothing
        waits for a request without per-token outputs.

        :raises ApiError: 499 when the client went away while waiting.
        """
        if not values:
            return NO_LEASE
        return await _unless_gone(request, self.budget.acquire(values))

    def _priority(self, priority: int | None) -> int:
        """A request's ``priority`` as the scheduling policy allows it (vLLM's rule).

        :raises ApiError: 400 for a priority other than 0 under ``fcfs``, or beyond :data:`MAX_PRIORITY`.
        """
        if not priority:
            return 0
        if self.settings.scheduling_policy != "priority":
            raise ApiError(400, f"priority {priority} needs priority scheduling, which this server does not use: "
                                "send 0 or leave it out, or ask the operator for --scheduling-policy priority",
                           param="priority")
        if abs(priority) > MAX_PRIORITY:
            raise ApiError(400, f"priority {priority} is out of range: -{MAX_PRIORITY}..{MAX_PRIORITY}",
                           param="priority")
        return priority


INLINE_PLAN_CHARS = 2048
"""Characters of text a request may hold in all to be planned on the event loop
(:meth:`PoolingService.plans_inline`): tokenized in well under a millisecond."""

PER_TOKEN_TASKS = frozenset({"token_embed", "token_classify", "embed&token_classify"})
"""Tasks whose output has a row per token (the others: one row per input)."""


def _size(request: FrontendRequest) -> tuple[int, str]:
    """How many items ``request`` has against ``max_inputs_per_request``, and what they are called:
    inputs, a score's pairs, a ranking's documents."""
    if isinstance(request, RerankRequest):
        return len(request.documents), "documents"
    if isinstance(request, ScoreRequest):
        sides = [1 if isinstance(side, str) else len(side) for side in (request.queries, request.documents)]
        return (sides[1] if sides[0] == 1 else max(sides)), "pairs"
    return len(getattr(request, "inputs", None) or getattr(request, "texts", ())), "input"


async def _unless_gone(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result, unless the client goes away first: then ``work`` is cancelled (the
    engine requests it runs are aborted, a wait for room ends).

    :raises ApiError: 499 (:data:`CLIENT_CLOSED`, never sent) when the client went away.
    """
    result = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not result.done():
            raise ApiError(CLIENT_CLOSED, "the client closed the connection")
        return result.result()
    finally:
        gone.cancel()
        result.cancel()  # a no-op once done


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the body was read already, so only that can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


ADAPTER: ContextVar[str | None] = ContextVar("poolrunner_adapter", default=None)
"""The LoRA adapter the request being answered named as its ``model`` (vLLM's rule), else ``None``;
set by :meth:`ModelRouter.pick <poolrunner.core.server.models.ModelRouter.pick>`."""


def with_adapter(request: FrontendRequest, adapter: str | None) -> FrontendRequest:
    """``request`` run with ``adapter`` (its ``tokenization.lora``), unless it names none."""
    if adapter is None or request.tokenization.lora is not None:
        return request
    return attrs.evolve(request, tokenization=attrs.evolve(request.tokenization, lora=adapter))
