"""The front end's plans: one request object in, the engine requests and how their outputs
become the answer out.

:meth:`Frontend.plan` is the only road from a surface to the engine: the Python API
(:class:`~poolrunner.core.runtime.Runtime`) runs a plan synchronously, the HTTP server through
its serving loop, the CLI and Ray through the runtime. So each surface's answer for the same
request is the same by construction. Nothing here runs the model.
"""

from __future__ import annotations

import copy
import functools
import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import attrs
import numpy as np
from attrs import frozen

from poolrunner.core.activation import label_count_activation, score_activation
from poolrunner.core.adapters import LoraAdapters
from poolrunner.core.errors import InvalidRequestError, PromptTooLongError, UnsupportedTaskError, with_advice
from poolrunner.core.frontend import outputs
from poolrunner.core.frontend.chunking import LongInputs
from poolrunner.core.frontend.requests import (
    ClassifyRequest,
    EncodeRequest,
    Input,
    Request,
    RerankRequest,
    ScoreRequest,
    Tokenization,
    TokenizeRequest,
    as_items,
    is_pair,
)
from poolrunner.core.frontend.scoring import maxsim, pair_up, sigmoid_score, text_labels
from poolrunner.core.hooks import Hooks
from poolrunner.core.inputs.images import ImageInputs, is_image
from poolrunner.core.inputs.pages import PageInputs, Prepared
from poolrunner.core.inputs.score_template import ScoreTemplate
from poolrunner.core.inputs.tokenize import InputProcessor
from poolrunner.core.model.families import PAGE_RETRIEVAL_FAMILIES, TEXT_IMAGE_FAMILIES
from poolrunner.core.plugin_api.options import RequestOptions
from poolrunner.core.plugin_api.output import RequestOutput
from poolrunner.core.similarity import check_similarity_fn, similarity_pairwise
from poolrunner.core.types import ModelConfig, PoolingParams, PoolingRequest, PoolingTask
from poolrunner.core.validators import check_text, shown

A = TypeVar("A")

TASK_NEEDS: dict[str, str] = {
    "classify": "a classification head: a *ForSequenceClassification folder",
    "token_classify": "a token classification head: a *ForTokenClassification folder, or BGE-M3's "
                      "sparse_linear.pt beside a backbone",
}
"""What a folder lacks when no plugin serves these tasks for it, for the refusal's text."""


@frozen(eq=False)
class Plan(Generic[A]):
    """From :meth:`Frontend.plan`: run ``requests`` (none for tokenize), then
    ``finish(outputs)``, the outputs in request order, is the answer.

    :ivar count: The request's inputs (pairs for score, documents for rerank).
    :ivar offload: ``finish`` may be slow (a plugin scoring outputs): the server runs it in a
        worker thread.
    """

    requests: list[PoolingRequest]
    finish: Callable[[list[RequestOutput]], A]
    offload: bool = False


@frozen
class Token:
    """One token of a tokenize plan with ``with_tokens``: ``span`` is ``(start, stop)`` in
    characters, ``None`` for a special token the tokenizer added."""

    id: int
    token: str
    special: bool
    span: tuple[int, int] | None


class Frontend:
    """Plans the requests of one loaded model, and reads their outputs.

    :param model_config: The loaded model.
    :param inputs: Its prompts, tokenizer and truncation rules.
    :param hooks: The plugins' hooks (``score_outputs``).
    :param tasks: Every task the runtime serves.
    :param default_task: The task of a request that names none.
    :param task_pinned: The runtime was loaded for ``default_task`` alone (``task=``); else
        ``tasks`` is everything the plugins serve for the model.
    :param options: The request options the plugins declare.
    :param max_embed_len: Embed inputs longer than ``max_model_len``, up to this many tokens, in
        windows (:mod:`poolrunner.core.frontend.chunking`); ``None``: such inputs are refused.
    :param score_template: Formats each (query, document) pair into the one prompt a
        cross-encoder scores (:mod:`poolrunner.core.inputs.score_template`); ``None``: the pair
        is tokenized as a (text, text_pair).
    :param images: A text-image model's image inputs; ``None``: images are refused.
    :param adapters: The LoRA adapters a request's ``lora`` may name; ``None``: none.
    :param image_score: ``(logit_scale, logit_bias)`` of a family whose (text, image) pairs score
        :func:`~poolrunner.core.frontend.scoring.sigmoid_score` (SigLIP); ``None``: the cosine.
    :param check_params: Checks a request's :class:`PoolingParams` against its task's pooler
        (the engine's), so they are refused whether or not the request has inputs.
    """

    def __init__(self, model_config: ModelConfig, inputs: InputProcessor, hooks: Hooks, tasks: frozenset[PoolingTask],
                 default_task: PoolingTask, options: RequestOptions, *, max_embed_len: int | None = None,
                 score_template: ScoreTemplate | None = None, images: ImageInputs | None = None,
                 image_score: tuple[float, float] | None = None,
                 adapters: LoraAdapters | None = None, task_pinned: bool = False,
                 check_params: Callable[[PoolingParams], None] | None = None) -> None:
        self.model_config = model_config
        self.inputs = inputs
        self.tasks = tasks
        self.default_task = default_task
        self.task_pinned = task_pinned
        self.options = options
        self._check_params = check_params
        self._hooks = hooks
        self._request_ids = itertools.count()
        self.long_inputs = LongInputs(inputs, max_embed_len) if max_embed_len is not None else None
        self.score_template = score_template
        self.images = images
        self.adapters = adapters if adapters is not None else LoraAdapters(0)
        self.image_score = image_score
        self._score_activation = score_activation(model_config)  # here so that a bad name fails the load

    @property
    def cross_encoder(self) -> bool:
        """Whether the model scores pairs as a cross-encoder: default task ``classify``, one label."""
        return self.default_task == "classify" and len(self.model_config.labels) == 1

    @functools.singledispatchmethod
    def plan(self, request: Request) -> Plan[Any]:
        """The engine requests ``request`` needs, and how their outputs become its answer:

        - :class:`EncodeRequest`: one result per input (``[d]``, ``[num_tokens, d]``, a dict of
          arrays...), float32, or quantized codes for ``embed`` at another precision;
        - :class:`ClassifyRequest`: one :class:`~poolrunner.core.frontend.results.ClassificationResult` per input;
        - :class:`ScoreRequest`: ``[num_pairs]`` float32 scores, in pair order;
        - :class:`RerankRequest`: :class:`~poolrunner.core.frontend.results.RerankResult` objects, best first;
        - :class:`TokenizeRequest`: each text's ``prompt_token_ids`` (or :class:`Token` lists);
          no engine request.

        Inputs are checked and tokenized here (nothing past the first error).

        :raises InvalidRequestError: for bad input, naming it and the limit it breaks; for a task
            the runtime does not serve, or a plugin option the task does not take.
        :raises UnsupportedTaskError: for scoring with a runtime whose task cannot score pairs.
        """
        raise TypeError(f"not a request: {type(request).__name__}")

    @plan.register
    def _(self, request: EncodeRequest) -> Plan[list[outputs.Result]]:
        params = self.params(request.task, request.options, **request.pooling())
        if request.precision != "float32" and params.task != "embed":
            raise InvalidRequestError(f"precision={request.precision} applies to task 'embed', not {params.task!r}",
                                      param="precision")
        ranges = request.calibration()
        width = params.dimensions or self.model_config.embedding_size  # every embed pooler's width (the kit's check)
        if ranges is not None and ranges.shape != (2, width):
            raise InvalidRequestError(f"ranges must have shape [2, {width}] (minima, maxima per dimension), got "
                                      f"{list(ranges.shape)}", param="ranges")
        return Plan(self.prepare(request.inputs, params, request.tokenization),
                    functools.partial(outputs.results, precision=request.precision, ranges=ranges))

    @plan.register
    def _(self, request: ClassifyRequest) -> Plan[list[Any]]:
        use_activation, activate = _activation(request, None)
        params = self.params("classify", use_activation=use_activation)
        return Plan(self.prepare(request.inputs, params, request.tokenization), lambda done: outputs.classifications(
            [activate(output) for output in done], labels=self.model_config.labels))

    @plan.register
    def _(self, request: ScoreRequest) -> Plan[np.ndarray]:
        return self._plan_score(request)

    @plan.register
    def _(self, request: RerankRequest) -> Plan[list[Any]]:
        name = request.sides[1]
        images = self.images is not None
        for index, document in enumerate(request.documents):  # named as the caller sent them
            if not isinstance(document, str) and not (images and is_image(document)):
                kinds = "a string or an image" if images else "a string"
                raise InvalidRequestError(f"{name}[{index}] must be {kinds}, got {shown(document)}", param=name)
        if not isinstance(request.query, str) and not images:
            raise InvalidRequestError(f"query must be a string, got {shown(request.query)}", param="query")
        scoring = self._plan_score(request.score_request())
        documents = list(request.documents)
        return Plan(scoring.requests, lambda done: outputs.rank(
            scoring.finish(done), documents, top_n=request.top_n, return_documents=request.return_documents),
            offload=scoring.offload)

    @plan.register
    def _(self, request: TokenizeRequest) -> Plan[list[Any]]:
        tokenization = request.tokenization
        truncated = tokenization.truncate_prompt_tokens is not None
        if request.with_tokens:
            if truncated:
                raise InvalidRequestError("truncate_prompt_tokens applies to token ids, not to with_tokens' token "
                                          "strings and spans", param="truncate_prompt_tokens")
            answer: list[Any] = self._tokens(self.prompted(request), tokenization.add_special_tokens)
        else:  # the requests' own path; untruncated, any length is counted, as vLLM's /tokenize does
            inputs = self.inputs if truncated else self._unlimited_inputs
            answer = [list(ids) for ids in inputs.encode(request.texts, check_vocabulary=False,
                                                         **tokenization.encoding())]
        return Plan([], lambda _: answer)

    def prompted(self, request: TokenizeRequest) -> list[str]:
        """``request``'s texts with the prompt its tokenization names (or the model's default
        prompt) in front, as requests encode them: the texts a token's span counts in.

        :raises InvalidRequestError: for a ``prompt_name`` the model does not define.
        """
        tokenization = request.tokenization
        prefix = self.inputs.resolve_prompt(tokenization.prompt, tokenization.prompt_name)
        return [prefix + text for text in request.texts]

    def params(self, task: PoolingTask | None = None, options: Mapping[str, Any] | None = None,
               **core: Any) -> PoolingParams:
        """:class:`PoolingParams` for ``task`` (``None``: the default task), with the core fields
        ``core`` and the plugin ``options`` checked and their defaults filled in.

        :raises InvalidRequestError: for a task this runtime does not serve, a bad core value,
            an option the task does not take (naming the option and its plugin), or a value its
            pooler refuses (``dimensions`` of a model without Matryoshka dimensions).
        """
        params = PoolingParams(task=task or self.default_task, **core)  # a malformed value fails first
        if params.task not in self.tasks:
            if self.task_pinned:
                raise InvalidRequestError(
                    f"this runtime serves tasks {sorted(self.tasks)}, not {params.task!r}: it was loaded for "
                    f"{self.default_task!r} alone; load it without a task to serve every task the model supports, "
                    f"or with task={params.task!r} (Runtime(..., task=...), --task)", param="task")
            needs = TASK_NEEDS.get(params.task)
            raise InvalidRequestError(
                f"this model serves tasks {sorted(self.tasks)}, not {params.task!r}: no installed plugin serves "
                f"{params.task!r} for {self.model_config.architecture} with this folder's files"
                + (f" (it needs {needs})" if needs else "")
                + "; `poolrunner plugins --all` lists what each plugin serves", param="task")
        extra_kwargs = self.options.resolve(params.task, options or {})
        params = attrs.evolve(params, extra_kwargs=extra_kwargs) if extra_kwargs else params
        if self._check_params is not None:
            self._check_params(params)
        return params

    def prepare(self, inputs: Sequence[Input], params: PoolingParams,
                tokenization: Tokenization = Tokenization()) -> list[PoolingRequest]:  # noqa: B008 (frozen)
        """Validate and tokenize ``inputs`` into engine requests (fresh ids), in input order.

        ``params`` come from :meth:`params`, which checked them against the pooler (e.g. ``dimensions``).

        With ``max_embed_len`` set, an ``embed`` input (not a pair, not truncated) over
        ``max_model_len`` becomes one :class:`~poolrunner.core.frontend.chunking.WindowedRequest`,
        which the runtime runs in windows and answers with one combined vector.

        An image input (a text-image model's ``embed``) becomes a request of
        ``model_config.image_positions`` placeholder tokens carrying its pixel values, decoded
        and preprocessed here (the server plans in worker threads).

        A ``tokenization.lora`` name sets ``params.lora_id`` to that adapter's number, and the
        adapter's own sentence-transformers prompts, when its folder has them, replace the base
        model's (:meth:`~poolrunner.core.types.LoraRequest.prompt`). A
        page-retrieval model's inputs are its processor's (:meth:`_prepare_pages`).

        :raises InvalidRequestError: for bad input, naming its index and the limit it breaks; for
            a ``lora`` that is not loaded.
        """
        if tokenization.lora is not None:
            lora = self.adapters.get(tokenization.lora)
            params = attrs.evolve(params, lora_id=lora.lora_id)
            if tokenization.prompt is None and (prompt := lora.prompt(tokenization.prompt_name)) is not None:
                tokenization = attrs.evolve(tokenization, prompt=prompt, prompt_name=None)  # the adapter's own
        if isinstance(self.images, PageInputs):
            return self._prepare_pages(self.images, inputs, params, tokenization)
        image_at = [i for i, item in enumerate(inputs) if is_image(item, data_urls=self.images is not None)]
        if image_at:
            return self._prepare_images(inputs, image_at, params, tokenization)
        if (self.long_inputs is not None and params.task == "embed" and tokenization.truncate_prompt_tokens is None
                and not any(is_pair(item) for item in inputs)):
            encoded = self.long_inputs.encode(inputs, tokenization)  # type: ignore[arg-type]
            return [self.long_inputs.request(f"{params.task}-{next(self._request_ids)}", ids, params)
                    for ids in encoded]
        return [
            PoolingRequest(request_id=f"{params.task}-{next(self._request_ids)}", prompt_token_ids=ids,
                           token_type_ids=types, params=params)
            for ids, types in self._tokenize(inputs, tokenization)
        ]

    def _prepare_images(self, inputs: Sequence[Input], image_at: list[int], params: PoolingParams,
                        tokenization: Tokenization) -> list[PoolingRequest]:
        """:meth:`prepare` for ``inputs`` with images at ``image_at``; texts as usual."""
        if self.images is None:
            served = ", ".join([*TEXT_IMAGE_FAMILIES.values(), *PAGE_RETRIEVAL_FAMILIES.values()])
            raise InvalidRequestError(f"input {image_at[0]} is an image, but {self.model_config.architecture} has no "
                                      f"vision tower (images are served for {served})")
        if params.task != "embed":
            raise InvalidRequestError(f"input {image_at[0]} is an image: images are embedded (task 'embed'), "
                                      f"not {params.task!r}", param="task")
        self.images.check_count(len(image_at))
        text_at = [i for i in range(len(inputs)) if i not in set(image_at)]
        try:
            encoded = dict(zip(text_at, self._tokenize([inputs[i] for i in text_at], tokenization), strict=True))
        except InvalidRequestError as exc:
            raise _renumbered(exc, text_at) from None
        features = self.images.features_of({i: inputs[i] for i in image_at})
        placeholder = (0,) * (self.model_config.image_positions or 0)
        return [
            PoolingRequest(request_id=f"{params.task}-{next(self._request_ids)}", params=params,
                           pixel_values=features[i].pop("pixel_values"), image_kwargs=features[i] or None,
                           prompt_token_ids=placeholder) if i in features
            else PoolingRequest(request_id=f"{params.task}-{next(self._request_ids)}", params=params,
                                prompt_token_ids=encoded[i][0], token_type_ids=encoded[i][1])
            for i in range(len(inputs))
        ]

    def _prepare_pages(self, pages: PageInputs, inputs: Sequence[Input], params: PoolingParams,
                       tokenization: Tokenization) -> list[PoolingRequest]:
        """:meth:`prepare` for a page-retrieval model: an image as its processor's
        ``process_images`` prepares it, a text as its ``process_queries`` does (prefix and
        query-augmentation tokens included), token ids as given.

        :raises InvalidRequestError: for a tokenization option (the processor takes none), a
            pair, or an input over ``max_model_len``, naming it.
        """
        changed = [f.name for f in attrs.fields(Tokenization)  # lora picks weights, not tokens
                   if f.name != "lora" and getattr(tokenization, f.name) != f.default]
        if changed:
            raise InvalidRequestError(
                f"{changed[0]}: {self.model_config.architecture} prepares every input with its own processor "
                "(process_queries, process_images), which takes no tokenization options", param=changed[0])
        pages.check_count(sum(is_image(item, data_urls=True) for item in inputs))
        requests = []
        for index, item in enumerate(inputs):
            if is_image(item, data_urls=True):
                prepared = pages.page(item, index)
            elif isinstance(item, str):
                check_text(item, f"input {index}", param="input")
                self.inputs.check_chars(item, f"input {index}")
                prepared = pages.query(item)
            elif is_pair(item):
                raise InvalidRequestError(f"input {index} is a pair: {self.model_config.architecture} embeds "
                                          "queries and pages, one at a time")
            else:  # token ids, checked against the vocabulary and the maximum
                prepared = Prepared(tuple(self.inputs.encode([item])[0]))
            if len(prepared.prompt_token_ids) > self.model_config.max_model_len:
                limit = self.model_config.max_model_len
                raise PromptTooLongError(
                    f"input {index} has {len(prepared.prompt_token_ids)} tokens as the processor prepares it, more "
                    f"than the maximum of {limit} (max_model_len of {self.model_config.name})")
            requests.append(PoolingRequest(
                request_id=f"{params.task}-{next(self._request_ids)}", params=params,
                prompt_token_ids=prepared.prompt_token_ids, pixel_values=prepared.pixel_values,
                image_kwargs=prepared.image_kwargs))
        return requests

    def _plan_image_score(self, request: ScoreRequest) -> Plan[np.ndarray]:
        """Scoring with images (a text-image model): each input pooled once, in order, and each
        pair scored as the family scores it: CLIP, the cosine of the embeddings (its
        ``logits_per_text`` divided by ``logit_scale``, so the order is CLIP's); SigLIP, a (text,
        image) pair's :func:`~poolrunner.core.frontend.scoring.sigmoid_score` (``torch.sigmoid`` of
        its ``logits_per_text``), and pairs of one kind (image, image) the cosine. A page-retrieval
        model scores MaxSim of the token vectors (its processor's ``score_retrieval`` of one query
        and one page).

        :raises InvalidRequestError: for SigLIP, a request mixing (text, image) pairs with pairs of
            one kind (their scores would be on two scales).
        """
        sides = [list(as_items(side)) for side in (request.queries, request.documents)]
        queries, documents = sides
        if not queries or not documents:
            raise InvalidRequestError("scoring needs at least one query and one document")
        if len(queries) != 1 and len(queries) != len(documents):
            raise InvalidRequestError(f"cannot score {len(queries)} queries against {len(documents)} documents: "
                                      "use 1:1, 1:N (one query) or N:N (equal lengths)")
        task = self.default_task
        if isinstance(self.images, PageInputs) and request.max_tokens_per_doc is not None:
            raise InvalidRequestError(f"max_tokens_per_doc: {self.model_config.architecture} scores whole pages and "
                                      "queries as its processor prepares them", param="max_tokens_per_doc")
        params = self.params(task, request.options)
        try:
            requests = self.prepare([*queries, *documents], params, request.tokenization)
        except InvalidRequestError as exc:
            names = [f"{request.sides[0]}[{i}]" for i in range(len(queries))]
            names += [f"{request.sides[1]}[{i}]" for i in range(len(documents))]
            raise _renamed(exc, names) from None
        pairs = [(0 if len(queries) == 1 else i, len(queries) + i) for i in range(len(documents))]
        sigmoid = self.image_score is not None and self._cross_modal(requests, pairs, request.sides)

        def finish(done: list[RequestOutput]) -> np.ndarray:
            vectors = [outputs.to_array(output) for output in done]
            if task == "token_embed":  # a page-retrieval model: MaxSim of the token vectors
                return maxsim([vectors[q] for q, _ in pairs], [vectors[d] for _, d in pairs])
            scores = similarity_pairwise(np.stack([vectors[q] for q, _ in pairs]),
                                         np.stack([vectors[d] for _, d in pairs]), "cosine")
            return sigmoid_score(scores, *self.image_score) if sigmoid and self.image_score else scores

        return Plan(requests, finish)

    def _cross_modal(self, requests: list[PoolingRequest], pairs: list[tuple[int, int]], sides: tuple[str, str],
                     ) -> bool:
        """Whether every pair is (text, image) or (image, text), for a sigmoid-scored family:
        ``False`` when every pair is of one kind (scored by the cosine).

        :raises InvalidRequestError: when the pairs are of both kinds, naming the first unlike pair 0.
        """
        crossed = [(requests[q].pixel_values is None) != (requests[d].pixel_values is None) for q, d in pairs]
        if all(crossed) or not any(crossed):
            return all(crossed)
        odd = crossed.index(not crossed[0])
        kind = ["a pair of one kind", "a (text, image) pair"]
        raise InvalidRequestError(
            f"{sides[1]}[{odd}] makes {kind[crossed[odd]]} and {sides[1]}[0] {kind[crossed[0]]}: "
            f"{self.model_config.architecture} scores a (text, image) pair sigmoid(cosine * exp(logit_scale) + "
            "logit_bias) and a pair of one kind (text, text or image, image) by the cosine; score them in "
            "separate requests")

    def _plan_score(self, request: ScoreRequest) -> Plan[np.ndarray]:
        """A ``classify`` model with one label scores each pair as a cross-encoder (formatted by
        the score template into one prompt when the runtime has one); an ``embed`` model pools
        each distinct text once and scores the model's similarity (a bi-encoder); any other default task
        pools each text once and asks the ``score_outputs`` plugins. An input error of a
        bi-encoder, which pools the distinct texts sorted, names the text as the caller sent it
        (``documents[1]``)."""
        if isinstance(self.images, PageInputs):
            return self._plan_image_score(request)
        if self.images is not None and self.default_task == "embed" and any(
                is_image(item, data_urls=True) for side in (request.queries, request.documents)
                for item in as_items(side)):
            return self._plan_image_score(request)
        pairs = pair_up(request.queries, request.documents, names=request.sides)
        if request.max_tokens_per_doc is not None:
            pairs = self._cut_documents(pairs, request.max_tokens_per_doc)
        tokenization = request.tokenization
        task = self.default_task
        if self.cross_encoder:
            use_activation, activate = _activation(request, self._score_activation)
            params = self.params("classify", request.options, use_activation=use_activation)
            try:
                requests = self.prepare(self._formatted(pairs), params, tokenization)
            except PromptTooLongError as exc:
                raise self._pair_too_long(exc, request.max_tokens_per_doc) from None
            return Plan(requests, lambda done: np.array(
                [activate(output).numpy()[0] for output in done], dtype=np.float32))
        if task != "embed" and not self._hooks.implementers("score_outputs"):
            raise self._cannot_score()
        params = self.params(task, request.options)
        texts = sorted({text for pair in pairs for text in pair})  # each distinct text is pooled once
        try:
            requests = self.prepare(texts, params, tokenization)
        except InvalidRequestError as exc:
            labels = text_labels(request.queries, request.documents, names=request.sides)
            raise _relabelled(exc, texts, labels) from None
        return Plan(requests, functools.partial(self._score_pooled, pairs, texts, params.extra_kwargs or {}),
                    offload=task != "embed")

    def _formatted(self, pairs: Sequence[tuple[str, str]]) -> Sequence[Input]:
        """Each pair as its :attr:`score_template` prompt (one text), or the pairs as they are."""
        if self.score_template is None:
            return pairs
        return [self.score_template.render(query, document) for query, document in pairs]

    def _pair_too_long(self, exc: PromptTooLongError, max_tokens_per_doc: int | None) -> PromptTooLongError:
        """``exc`` advising ``max_tokens_per_doc`` (or, given, a lower one or a shorter query),
        which cuts the document alone: a score template's end (where an LLM reranker reads its
        answer) stays whole, as it would not with ``truncate_prompt_tokens``."""
        cut = "" if self.score_template is not None else "truncate_prompt_tokens (-1 keeps the maximum) or "
        advice = (f"shorten it, or pass {cut}max_tokens_per_doc to cut each document to its first tokens"
                  if max_tokens_per_doc is None else
                  f"shorten the query, or lower max_tokens_per_doc (now {max_tokens_per_doc})")
        return PromptTooLongError(with_advice(str(exc), advice), param=exc.param)

    def _cut_documents(self, pairs: Sequence[tuple[str, str]], max_tokens: int) -> list[tuple[str, str]]:
        """``pairs`` with each distinct document cut to its first ``max_tokens`` tokens."""
        cut = {document: self._first_tokens(document, max_tokens) for _, document in pairs}
        return [(query, cut[document]) for query, document in pairs]

    def _first_tokens(self, text: str, max_tokens: int) -> str:
        """``text`` if it has at most ``max_tokens`` tokens (special tokens not counted), else the
        decoded text of its first ``max_tokens`` tokens, which the tokenizer reads back as them.

        A text longer than the model maximum is only cut when ``max_tokens`` is below it; else
        it stays whole and pairing it answers the usual too-long error.
        """
        if not text.strip():  # nothing to cut; a text of no tokens would fail encode's checks
            return text
        # One token more than kept tells whether the text was longer; the locked encode is
        # safe next to other requests (the tokenizer's truncation is shared state).
        keep = min(max_tokens + 1 + self.inputs.num_special_tokens[False], self.model_config.max_model_len)
        ids = self.inputs.encode([text], truncate_prompt_tokens=keep)[0]
        content = _strip_special(self.inputs.tokenizer, ids)
        if len(content) <= max_tokens:
            return text
        return self.inputs.tokenizer.decode(content[:max_tokens])

    def _score_pooled(self, pairs: Sequence[tuple[str, str]], texts: list[str], options: Mapping[str, Any],
                      done: list[RequestOutput]) -> np.ndarray:
        """The model's similarity of the embeddings (``embed``: its ``similarity_fn_name``, as
        sentence-transformers' ``model.similarity`` scores; cosine unless the folder says ``dot``,
        ``euclidean`` or ``manhattan``), else the plugins' ``score_outputs``; ``[num_pairs]`` float32."""
        by_text = dict(zip(texts, done, strict=True))
        if self.default_task == "embed":
            vectors = {text: outputs.to_array(output) for text, output in by_text.items()}
            queries, documents = (np.stack([vectors[text] for text in side]) for side in zip(*pairs, strict=True))
            return similarity_pairwise(queries, documents, check_similarity_fn(self.model_config.similarity_fn_name))
        scores = self._hooks.score_outputs(
            model_config=self.model_config, task=self.default_task,
            queries=[by_text[q] for q, _ in pairs], documents=[by_text[d] for _, d in pairs], options=options,
        )
        if scores is None:
            raise self._cannot_score()
        result = scores.detach().float().cpu().numpy()
        if result.shape != (len(pairs),):
            raise RuntimeError(f"score_outputs returned shape {list(result.shape)} for {len(pairs)} pairs")
        if not np.isfinite(result).all():  # a plugin option out of range (weights of 1e308) overflows
            shown = ", ".join(f"{name}={value!r}" for name, value in options.items()) or "none"
            raise InvalidRequestError(f"the scores of {self.default_task!r} outputs are not finite (inf or nan) "
                                      f"with the request's options ({shown}): use smaller values")
        return result

    def _cannot_score(self) -> UnsupportedTaskError:
        return UnsupportedTaskError(
            f"score needs an embed model (bi-encoder) or a classify model with one label "
            f"(cross-encoder); this runtime serves {self.default_task!r} with "
            f"{len(self.model_config.labels)} labels, and no plugin scores {self.default_task!r} outputs "
            "(see `poolrunner plugins --hook score_outputs`).",
            task=self.default_task,
        )

    def _tokenize(self, items: Sequence[Input], tokenization: Tokenization,
                  ) -> list[tuple[tuple[int, ...], tuple[int, ...] | None]]:
        """Tokenize single inputs and ``(text, text_pair)`` pairs, keeping input order."""
        pair_at = [i for i, item in enumerate(items) if is_pair(item)]
        single_at = [i for i, item in enumerate(items) if not is_pair(item)]
        encoded: dict[int, tuple[tuple[int, ...], tuple[int, ...] | None]] = {}
        if pair_at:
            if tokenization.prompt is not None or tokenization.prompt_name is not None:
                raise InvalidRequestError("prompt and prompt_name apply to single texts, not to pairs")
            pairs = self.inputs.encode_pairs([items[i] for i in pair_at],  # type: ignore[misc]
                                             truncate_prompt_tokens=tokenization.truncate_prompt_tokens,
                                             truncation_side=tokenization.truncation_side,
                                             add_special_tokens=tokenization.add_special_tokens)
            encoded.update(zip(pair_at, pairs, strict=True))
        if single_at:
            singles = self.inputs.encode([items[i] for i in single_at], **tokenization.encoding())  # type: ignore[misc]
            encoded.update((i, (ids, None)) for i, ids in zip(single_at, singles, strict=True))
        return [encoded[i] for i in range(len(items))]

    def _tokens(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[Token]]:
        """Each text's tokens with their character spans (``None`` for added special tokens),
        untruncated.

        :raises InvalidRequestError: for text that is not valid Unicode or over ``max_input_chars``.
        """
        for index, text in enumerate(texts):
            check_text(text, f"input {index}", param="input")
            self.inputs.check_chars(text, f"input {index}")
        encoded = self._span_tokenizer(list(texts), add_special_tokens=add_special_tokens, return_offsets_mapping=True,
                                       return_special_tokens_mask=True, return_attention_mask=False,
                                       return_token_type_ids=False, verbose=False)
        return [
            [Token(id=token_id, token=token, special=bool(special), span=None if special else tuple(span))
             for token_id, token, special, span in zip(encoded["input_ids"][row], encoded.tokens(row),
                                                       encoded["special_tokens_mask"][row],
                                                       encoded["offset_mapping"][row], strict=True)]
            for row in range(len(texts))
        ]

    def detokenize(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """``ids`` decoded as the model's tokenizer decodes them (vLLM's ``/detokenize``).

        :raises InvalidRequestError: for an id outside the vocabulary, naming it and the range.
        """
        vocab_size = self.inputs.vocab_size
        bad = next((i for i, token in enumerate(ids) if not 0 <= token < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"tokens[{bad}] = {shown(ids[bad])} is outside the vocabulary [0, {vocab_size})",
                                      param="tokens")
        return self._span_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def _unlimited_inputs(self) -> InputProcessor:
        """:attr:`inputs` without the ``max_model_len`` limit: a tokenize request counts a text
        of any length (within ``max_input_chars``)."""
        return self.inputs.without_length_limit()

    @functools.cached_property
    def _span_tokenizer(self) -> Any:
        """A copy of the model's tokenizer for spans and decoding: those calls change the
        tokenizer's truncation settings, which :attr:`inputs` keeps per call on its own."""
        return copy.deepcopy(self.inputs.tokenizer)


def _activation(request: ClassifyRequest | ScoreRequest,
                named: Callable[[Any], Any] | None) -> tuple[bool | None, Callable[[Any], Any]]:
    """The params' ``use_activation`` for ``request`` and what the plan applies to each output.
    The pooler applies the classification rule; the label-count rule (TEI's, infinity's) and a
    cross-encoder's pair-score activation (``named``, :func:`score_activation`) run here, on the
    raw logits the pooler then returns."""
    if request.use_activation is False:
        return False, lambda output: output
    if request.activation == "labels":
        return False, label_count_activation
    if named is not None:
        return False, named
    return request.use_activation, lambda output: output


def _strip_special(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """``ids`` without the special tokens at either end (those the tokenizer added); an
    unknown-token id inside the text stays."""
    mask = tokenizer.get_special_tokens_mask(list(ids), already_has_special_tokens=True)
    start, stop = 0, len(ids)
    while start < stop and mask[start]:
        start += 1
    while stop > start and mask[stop - 1]:
        stop -= 1
    return list(ids[start:stop])


_INPUT_INDEX = re.compile(r"^input (\d+)\b")


def _renumbered(error: InvalidRequestError, indices: Sequence[int]) -> InvalidRequestError:
    """``error`` about ``input k`` of a subset of the inputs, naming ``input indices[k]``."""
    return _renamed(error, [f"input {index}" for index in indices])


def _renamed(error: InvalidRequestError, names: Sequence[str]) -> InvalidRequestError:
    """``error`` about ``input k`` naming ``names[k]`` instead; ``error`` when it names no input."""
    match = _INPUT_INDEX.match(str(error))
    if match is None or int(match.group(1)) >= len(names):
        return error
    return type(error)(names[int(match.group(1))] + str(error)[match.end():], param=error.param)


def _relabelled(error: InvalidRequestError, texts: list[str], labels: Mapping[str, tuple[str, str]] | None,
                ) -> InvalidRequestError:
    """``error`` about ``input i`` of ``texts`` naming that text as the caller did (``labels``),
    with its ``param``; ``error`` itself when it names no input or the text has no label (a
    document cut by ``max_tokens_per_doc``)."""
    match = _INPUT_INDEX.match(str(error))
    label = labels.get(texts[int(match.group(1))]) if labels is not None and match is not None else None
    if label is None:
        return error
    return type(error)(label[0] + str(error)[match.end():], param=label[1])
