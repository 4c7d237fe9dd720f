"""The one front end of every surface: user input -> engine requests, engine outputs -> answers.

The Python API (:class:`~poolrunner.core.runtime.Runtime`), the HTTP server, the command line
and Ray actors all build requests, plan scores and convert outputs here, so each surface's
answer for the same input is the same by construction. Nothing here runs the model.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
from attrs import frozen

from poolrunner.core.chunking import LongInputs
from poolrunner.core.errors import InvalidRequestError, UnsupportedTaskError
from poolrunner.core.hooks import Hooks
from poolrunner.core.inputs.score_template import ScoreTemplate
from poolrunner.core.inputs.tokenize import InputProcessor, PromptInput
from poolrunner.core.plugin_api.options import RequestOptions
from poolrunner.core.plugin_api.output import RequestOutput
from poolrunner.core.results import ClassificationResult, RerankResult
from poolrunner.core.scoring import cosine
from poolrunner.core.types import ModelConfig, PoolingParams, PoolingRequest, PoolingTask, TruncationSide

ClassifyInput = PromptInput | tuple[str, str]
"""A text, token ids, or a ``(text, text_pair)`` pair."""

Result = np.ndarray | dict[str, np.ndarray]
"""One input's raw result: an array, or named arrays for a task with several outputs."""


@frozen(eq=False)
class ScorePlan:
    """From :meth:`Frontend.plan_score`: run ``requests``, then ``finish(outputs)`` (outputs in
    request order) gives the ``[num_pairs]`` float32 scores."""

    requests: list[PoolingRequest]
    finish: Callable[[list[RequestOutput]], np.ndarray]


class Frontend:
    """Builds and checks requests for one loaded model, and reads their outputs.

    :param model_config: The loaded model.
    :param inputs: Its prompts, tokenizer and truncation rules.
    :param hooks: The plugins' hooks (``score_outputs``).
    :param tasks: Every task the runtime serves.
    :param default_task: The task of a request that names none.
    :param options: The request options the plugins declare.
    :param max_embed_len: Embed inputs longer than ``max_model_len``, up to this many tokens, in
        windows (:mod:`poolrunner.core.chunking`); ``None``: such inputs are refused.
    :param score_template: Formats each (query, document) pair into the one prompt a
        cross-encoder scores (:mod:`poolrunner.core.inputs.score_template`); ``None``: the pair
        is tokenized as a (text, text_pair).
    """

    def __init__(self, model_config: ModelConfig, inputs: InputProcessor, hooks: Hooks, tasks: frozenset[PoolingTask],
                 default_task: PoolingTask, options: RequestOptions, *, max_embed_len: int | None = None,
                 score_template: ScoreTemplate | None = None) -> None:
        self.model_config = model_config
        self.inputs = inputs
        self.tasks = tasks
        self.default_task = default_task
        self.options = options
        self._hooks = hooks
        self._request_ids = itertools.count()
        self.long_inputs = LongInputs(inputs, max_embed_len) if max_embed_len is not None else None
        self.score_template = score_template

    def params(self, task: PoolingTask | None = None, options: Mapping[str, Any] | None = None,
               **core: Any) -> PoolingParams:
        """:class:`PoolingParams` for ``task`` (``None``: the default task), with the core fields
        ``core`` and the plugin ``options`` checked and their defaults filled in.

        :raises InvalidRequestError: for a task this runtime does not serve, a bad core value,
            or an option the task does not take (naming the option and its plugin).
        """
        params = PoolingParams(task=task or self.default_task, **core)  # a malformed value fails first
        if params.task not in self.tasks:
            raise InvalidRequestError(
                f"this runtime serves tasks {sorted(self.tasks)}, not {params.task!r}; if the model supports "
                f"{params.task!r}, load it without a task or with that task (Runtime(..., task=...), --task)",
                param="task",
            )
        extra_kwargs = self.options.resolve(params.task, options or {})
        return attrs.evolve(params, extra_kwargs=extra_kwargs) if extra_kwargs else params

    def prepare(
        self, inputs: Sequence[ClassifyInput], params: PoolingParams, *, truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right", prompt: str | None = None, prompt_name: str | None = None,
        add_special_tokens: bool = True,
    ) -> list[PoolingRequest]:
        """Validate and tokenize ``inputs`` into engine requests (fresh ids), in input order.

        ``params`` come from :meth:`params`; they are checked against the pooler (e.g.
        ``dimensions``) when the requests are admitted. ``add_special_tokens=False`` tokenizes
        texts (and pairs) without the tokenizer's special tokens (vLLM's ``add_special_tokens``).

        With ``max_embed_len`` set, an ``embed`` input (not a pair, not truncated) over
        ``max_model_len`` becomes one :class:`~poolrunner.core.chunking.WindowedRequest`, which
        the runtime runs in windows and answers with one combined vector.

        :raises InvalidRequestError: for bad input, naming its index and the limit it breaks.
        """
        if (self.long_inputs is not None and params.task == "embed" and truncate_prompt_tokens is None
                and not any(is_pair(item) for item in inputs)):
            encoded = self.long_inputs.encode(inputs, truncation_side=truncation_side, prompt=prompt,  # type: ignore[arg-type]
                                              prompt_name=prompt_name, add_special_tokens=add_special_tokens)
            return [self.long_inputs.request(f"{params.task}-{next(self._request_ids)}", ids, params)
                    for ids in encoded]
        tokenized = self._tokenize(inputs, truncate_prompt_tokens, truncation_side, prompt, prompt_name,
                                   add_special_tokens=add_special_tokens)
        return [
            PoolingRequest(request_id=f"{params.task}-{next(self._request_ids)}", prompt_token_ids=ids,
                           token_type_ids=types, params=params)
            for ids, types in tokenized
        ]

    def plan_score(
        self, pairs: Sequence[tuple[str, str]], *, truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right", use_activation: bool | None = None,
        max_document_tokens: int | None = None, plugin_options: Mapping[str, Any] | None = None,
        labels: Mapping[str, tuple[str, str]] | None = None,
    ) -> ScorePlan:
        """The requests scoring ``pairs`` needs, and how their outputs become scores.

        A ``classify`` model with one label scores each pair as a cross-encoder (formatted by the
        score template into one prompt when the runtime has one); an ``embed``
        model pools each distinct text once and scores the cosine (a bi-encoder); any other
        default task pools each text once and asks the ``score_outputs`` plugins.

        :param max_document_tokens: Cut each document (the pair's second text) to its first
            this many tokens, special tokens not counted, before pairing (Cohere's and vLLM's
            ``max_tokens_per_doc``); the query is never cut. ``None``: documents stay whole.
        :param plugin_options: Request options the plugins declare for the task, checked as
            :meth:`params` checks them; they reach the pooler and the ``score_outputs`` hook.
        :param labels: How the caller names each text (:func:`~poolrunner.core.scoring.text_labels`):
            an input error of a bi-encoder, which pools the distinct texts sorted, names the text
            so (``documents[1]``) instead of its place among them.
        :raises InvalidRequestError: for bad input (nothing is tokenized past the first error).
        :raises UnsupportedTaskError: for a runtime whose task cannot score pairs; from ``finish``
            when the ``score_outputs`` plugins decline this runtime's task.
        """
        options: dict[str, Any] = {"truncate_prompt_tokens": truncate_prompt_tokens,
                                   "truncation_side": truncation_side}
        if max_document_tokens is not None:
            pairs = self._cut_documents(pairs, max_document_tokens)
        task = self.default_task
        if task == "classify" and len(self.model_config.labels) == 1:
            params = self.params("classify", plugin_options, use_activation=use_activation)
            return ScorePlan(self.prepare(self._formatted(pairs), params, **options), lambda outputs: np.array(
                [output.numpy()[0] for output in outputs], dtype=np.float32))
        if task != "embed" and not self._hooks.implementers("score_outputs"):
            raise self._cannot_score()
        params = self.params(task, plugin_options)
        texts = sorted({text for pair in pairs for text in pair})  # each distinct text is pooled once
        try:
            requests = self.prepare(texts, params, **options)
        except InvalidRequestError as exc:
            raise _relabelled(exc, texts, labels) from None
        return ScorePlan(requests, functools.partial(self._score_pooled, pairs, texts, params.extra_kwargs or {}))

    def _formatted(self, pairs: Sequence[tuple[str, str]]) -> Sequence[ClassifyInput]:
        """Each pair as its :attr:`score_template` prompt (one text), or the pairs as they are."""
        if self.score_template is None:
            return pairs
        return [self.score_template.render(query, document) for query, document in pairs]

    def _cut_documents(self, pairs: Sequence[tuple[str, str]], max_tokens: int) -> list[tuple[str, str]]:
        """``pairs`` with each distinct document cut to its first ``max_tokens`` tokens."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidRequestError(f"max_document_tokens must be a positive integer, got {max_tokens!r}")
        cut = {document: self._first_tokens(document, max_tokens) for _, document in pairs}
        return [(query, cut[document]) for query, document in pairs]

    def _first_tokens(self, text: str, max_tokens: int) -> str:
        """``text`` if it has at most ``max_tokens`` tokens (special tokens not counted), else the
        decoded text of its first ``max_tokens`` tokens, which the tokenizer reads back as them.

        A text longer than the model maximum is only cut when ``max_tokens`` is below it; else
        it stays whole and pairing it answers the usual too-long error.
        """
        # One token more than kept tells whether the text was longer; the locked encode is
        # safe next to other requests (the tokenizer's truncation is shared state).
        keep = min(max_tokens + 1 + self.inputs.num_special_tokens[False], self.model_config.max_model_len)
        ids = self.inputs.encode([text], truncate_prompt_tokens=keep)[0]
        content = _strip_special(self.inputs.tokenizer, ids)
        if len(content) <= max_tokens:
            return text
        return self.inputs.tokenizer.decode(content[:max_tokens])

    def _score_pooled(self, pairs: Sequence[tuple[str, str]], texts: list[str], options: Mapping[str, Any],
                      outputs: list[RequestOutput]) -> np.ndarray:
        """Cosine of the embeddings (``embed``), else the plugins' ``score_outputs``; ``[num_pairs]`` float32."""
        by_text = dict(zip(texts, outputs, strict=True))
        if self.default_task == "embed":
            vectors = {text: to_array(output) for text, output in by_text.items()}
            return cosine(np.stack([vectors[q] for q, _ in pairs]), np.stack([vectors[d] for _, d in pairs]))
        scores = self._hooks.score_outputs(
            model_config=self.model_config, task=self.default_task,
            queries=[by_text[q] for q, _ in pairs], documents=[by_text[d] for _, d in pairs], options=options,
        )
        if scores is None:
            raise self._cannot_score()
        result = scores.detach().float().cpu().numpy()
        if result.shape != (len(pairs),):
            raise RuntimeError(f"score_outputs returned shape {list(result.shape)} for {len(pairs)} pairs")
        return result

    def _cannot_score(self) -> UnsupportedTaskError:
        return UnsupportedTaskError(
            f"score needs an embed model (bi-encoder) or a classify model with one label "
            f"(cross-encoder); this runtime serves {self.default_task!r} with "
            f"{len(self.model_config.labels)} labels, and no plugin scores {self.default_task!r} outputs "
            "(see `poolrunner plugins --hook score_outputs`).",
            task=self.default_task,
        )

    def _tokenize(
        self, items: Sequence[ClassifyInput], truncate_prompt_tokens: int | None, truncation_side: TruncationSide,
        prompt: str | None = None, prompt_name: str | None = None, *, add_special_tokens: bool = True,
    ) -> list[tuple[tuple[int, ...], tuple[int, ...] | None]]:
        """Tokenize single inputs and ``(text, text_pair)`` pairs, keeping input order."""
        pair_at = [i for i, item in enumerate(items) if is_pair(item)]
        single_at = [i for i, item in enumerate(items) if not is_pair(item)]
        encoded: dict[int, tuple[tuple[int, ...], tuple[int, ...] | None]] = {}
        options = {"truncate_prompt_tokens": truncate_prompt_tokens, "truncation_side": truncation_side,
                   "add_special_tokens": add_special_tokens}
        if pair_at:
            if prompt is not None or prompt_name is not None:
                raise InvalidRequestError("prompt and prompt_name apply to single texts, not to pairs")
            encoded.update(zip(pair_at, self.inputs.encode_pairs([items[i] for i in pair_at], **options),
                               strict=True))
        if single_at:
            singles = self.inputs.encode([items[i] for i in single_at], prompt=prompt,  # type: ignore[misc]
                                         prompt_name=prompt_name, **options)
            encoded.update((i, (ids, None)) for i, ids in zip(single_at, singles, strict=True))
        return [encoded[i] for i in range(len(items))]

    # ---- outputs -> answers ----

    def classifications(self, outputs: Sequence[RequestOutput]) -> list[ClassificationResult]:
        """One :class:`ClassificationResult` per ``classify`` output, over the model's labels."""
        labels = self.model_config.labels
        return [ClassificationResult(probs=to_array(output), labels=labels) for output in outputs]  # type: ignore[arg-type]


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


def is_pair(item: object) -> bool:
    """A ``(text, text_pair)`` tuple."""
    return isinstance(item, tuple) and len(item) == 2 and all(isinstance(text, str) for text in item)


def is_single(inputs: object) -> bool:
    """One input rather than a sequence of them: a text, one token-id list (ints, as the HTTP
    routes read it) or one ``(text, text_pair)`` tuple."""
    return isinstance(inputs, str) or is_pair(inputs) or is_token_ids(inputs)


def is_token_ids(value: object) -> bool:
    """A non-empty list or tuple of integers (numpy's too; booleans are not token ids)."""
    return (isinstance(value, list | tuple) and len(value) > 0
            and all(isinstance(item, int | np.integer) and not isinstance(item, bool) for item in value))


def as_items(inputs: ClassifyInput | Sequence[ClassifyInput]) -> list[ClassifyInput]:
    """``inputs`` as a list of inputs (see :func:`is_single`)."""
    return [inputs] if is_single(inputs) else list(inputs)  # type: ignore[list-item, arg-type]


def to_array(output: RequestOutput) -> Result:
    """An engine output on the CPU as numpy: floats as float32 whatever the model's dtype,
    integers (SPLADE's ``token_ids``) as they are; a dict of outputs stays a dict."""
    if isinstance(output, dict):
        return {name: to_array(tensor) for name, tensor in output.items()}  # type: ignore[misc]
    return output.float().numpy() if output.is_floating_point() else output.numpy()


def embeddings(outputs: Sequence[RequestOutput]) -> list[np.ndarray]:
    """``embed`` outputs as float32 ``[d]`` vectors."""
    return [to_array(output) for output in outputs]  # type: ignore[misc]


def check_top_n(top_n: int | None) -> None:
    """:raises InvalidRequestError: unless ``top_n`` is ``None`` or a positive integer."""
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise InvalidRequestError(f"top_n must be a positive integer, got {top_n!r}")


def rank(scores: np.ndarray, documents: Sequence[str], *, top_n: int | None = None,
         return_documents: bool = False) -> list[RerankResult]:
    """Documents best first by ``scores`` (ties keep input order), the best ``top_n`` of them."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]
    return [RerankResult(index=i, score=float(scores[i]), document=documents[i] if return_documents else None)
            for i in order]


_INPUT_INDEX = re.compile(r"^input (\d+)\b")


def _relabelled(error: InvalidRequestError, texts: list[str], labels: Mapping[str, tuple[str, str]] | None,
                ) -> InvalidRequestError:
    """``error`` about ``input i`` of ``texts`` naming that text as the caller did (``labels``),
    with its ``param``; ``error`` itself when it names no input or the text has no label (a
    document cut by ``max_document_tokens``)."""
    match = _INPUT_INDEX.match(str(error))
    label = labels.get(texts[int(match.group(1))]) if labels is not None and match is not None else None
    if label is None:
        return error
    return type(error)(label[0] + str(error)[match.end():], param=label[1])
