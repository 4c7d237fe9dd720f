"""The Python API: load a model once, then embed, classify, score, rerank or encode."""

from __future__ import annotations

import functools
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from attrs import frozen
from tqdm.auto import tqdm

from poolrunner.core.config import RuntimeConfig
from poolrunner.core.engine.loop import EngineLoop
from poolrunner.core.errors import InvalidRequestError, UnsupportedTaskError
from poolrunner.core.inputs.tokenize import PromptInput
from poolrunner.core.loading import LoadedModel, load
from poolrunner.core.manager import PoolrunnerPluginManager
from poolrunner.core.output import RequestOutput
from poolrunner.core.results import ClassificationResult, RerankResult
from poolrunner.core.scoring import cosine, pair_up
from poolrunner.core.types import ModelConfig, PoolingParams, PoolingRequest, PoolingTask, TruncationSide

ClassifyInput = PromptInput | tuple[str, str]
"""A text, token ids, or a ``(text, text_pair)`` pair."""


@frozen(eq=False)
class ScorePlan:
    """From :meth:`Runtime.plan_score`: run ``requests``, then ``finish(outputs)`` (outputs in
    request order) gives the ``[num_pairs]`` float32 scores."""

    requests: list[PoolingRequest]
    finish: Callable[[list[RequestOutput]], np.ndarray]


class Runtime:
    """A loaded pooling model with its plugins, ready to serve requests.

    Methods may be called from several threads; calls take turns on the one engine, or share
    its steps once an :class:`~poolrunner.core.engine.loop.EngineLoop` is attached (as the HTTP
    server does; see :meth:`attach_loop`).

    Example::

        from poolrunner import Runtime
        runtime = Runtime()  # all-MiniLM-L6-v2, shipped with poolrunner
        vectors = runtime.embed(["A cat sat.", "A dog ran."])  # float32 [2, 384]

    :param model: Local model folder, or a Hugging Face hub id (``ORG/NAME``) already in the local
        Hugging Face cache (``HF_HUB_CACHE``, ``HF_HOME``; never downloaded); ``None`` loads the
        default model (all-MiniLM-L6-v2). A folder with a ``config.json`` wins over a hub id of
        the same spelling.
    :param plugins: Extra plugin objects to register, beside built-ins and entry points.
    :param options: Any field of :class:`~poolrunner.core.config.RuntimeConfig` (``revision``,
        ``task``, ``dtype``, ``device``, ``load_entrypoints``, ``disable_plugins``,
        ``pooler_plugin``, ``max_num_batched_tokens``, ``max_num_seqs``, ``async_scheduling``) or
        of :class:`~poolrunner.core.config.ModelOverrides` (``pooling_type``, ``normalize``,
        ``max_model_len``, ``is_matryoshka``, ``matryoshka_dimensions``). ``dtype="auto"``: on
        CUDA the config's half dtype; on a CPU with native bf16 (AVX512-BF16, AMX) bfloat16 if the
        model's outputs on probe texts stay within cosine 0.9999 of float32 (checked at load),
        else float32.
    :raises TypeError: for an unknown option.
    :raises ModelLoadError: if the folder cannot be loaded, or a hub id (at ``revision``) is not
        in the local cache.
    :raises UnsupportedTaskError: if ``task`` is not served for this model by the plugins.
    :raises PluginLoadError: if a plugin fails to import or names an unknown hook.
    """

    def __init__(
        self, model: str | os.PathLike[str] | None = None, *, plugins: Sequence[object] = (), **options: Any,
    ) -> None:
        self._serve(load(RuntimeConfig.from_options(model, **options), plugins))

    @classmethod
    def from_config(cls, config: RuntimeConfig, *, plugins: Sequence[object] = ()) -> Runtime:
        """Load the model ``config`` describes; the path every caller's options end up on."""
        runtime = cls.__new__(cls)
        runtime._serve(load(config, plugins))
        return runtime

    def _serve(self, loaded: LoadedModel) -> None:
        self.config: RuntimeConfig = loaded.config
        self.plugin_manager: PoolrunnerPluginManager = loaded.plugin_manager
        self._hooks = loaded.hooks
        self.model_config: ModelConfig = loaded.model_config
        self.task: PoolingTask = loaded.task
        self.supported_tasks: frozenset[PoolingTask] = loaded.tasks
        self.device, self.dtype = loaded.device, loaded.dtype
        self.inputs = loaded.inputs
        self.engine = loaded.engine
        self._request_ids = itertools.count()
        self._engine_lock = threading.Lock()
        self._loop: EngineLoop | None = None

    def embed(
        self,
        texts: PromptInput | Sequence[PromptInput],
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right",
        prompt: str | None = None,
        prompt_name: str | None = None,
        show_progress_bar: bool = False,
    ) -> np.ndarray:
        """Embed texts (or token-id lists) into one float32 vector each.

        :param texts: One input or a sequence of them; a text is tokenized with the model's
            tokenizer (special tokens added), a list of ints is used as ``prompt_token_ids``.
        :param dimensions: Matryoshka size ``d``: keep ``[:d]``, then normalize. Only for
            Matryoshka models; ``1 <= d <= embedding_size``.
        :param normalize: L2-normalize; ``None`` keeps the model's default.
        :param truncate_prompt_tokens: ``None``: no truncation (longer input is an error);
            ``k``: keep ``k`` tokens; ``-1``: keep the model maximum.
        :param truncation_side: ``right`` keeps the start, ``left`` keeps the end.
        :param prompt: Literal prefix for every text.
        :param prompt_name: Name of one of the model's prompts.
        :param show_progress_bar: Show a tqdm bar over finished inputs.
        :returns: ``[num_inputs, d]`` float32 for a sequence of inputs, ``[d]`` for a single text.
        :raises InvalidRequestError: naming the input and the limit it breaks; nothing runs then.
        """
        single = isinstance(texts, str)
        inputs: list[PromptInput] = [texts] if single else list(texts)  # type: ignore[list-item]
        params = self._check_task(PoolingParams(task="embed", dimensions=dimensions, normalize=normalize))
        if not inputs:
            return np.zeros((0, dimensions or self.model_config.embedding_size), dtype=np.float32)
        requests = self.prepare(inputs, params, truncate_prompt_tokens=truncate_prompt_tokens,
                                truncation_side=truncation_side, prompt=prompt, prompt_name=prompt_name)
        outputs = self._run(requests, show_progress_bar)
        vectors = np.stack([output.numpy() for output in outputs]).astype(np.float32, copy=False)
        return vectors[0] if single else vectors

    def encode(
        self,
        inputs: ClassifyInput | Sequence[ClassifyInput],
        *,
        task: PoolingTask | None = None,
        dimensions: int | None = None,
        normalize: bool | None = None,
        use_activation: bool | None = None,
        step_tag_id: int | None = None,
        returned_token_ids: Sequence[int] | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right",
        prompt: str | None = None,
        prompt_name: str | None = None,
        show_progress_bar: bool = False,
    ) -> list[np.ndarray | dict[str, np.ndarray]]:
        """Run any task this runtime serves and return each input's raw result.

        Shapes per input: ``embed`` ``[d]``; ``classify`` ``[num_labels]``; ``token_embed``
        ``[num_tokens, hidden_size]`` (or ``[num_tokens, dimensions]``); ``token_classify``
        ``[num_tokens, num_labels]``, or with STEP pooling ``[num_step_tags, num_columns]``;
        ``embed&token_classify`` a dict ``{"embedding": [hidden_size], "token_weights":
        [num_tokens]}``. Results are ragged and never stacked across inputs. All float32.

        :param inputs: Texts, token-id lists, or ``(text, text_pair)`` pairs.
        :param task: One of :attr:`supported_tasks`; ``None`` is the runtime's default task.
        :param dimensions: Matryoshka size (``embed``, and per token for ``token_embed``).
        :param normalize: L2-normalize (``embed``: default on; per token for ``token_embed``:
            default off).
        :param use_activation: ``False`` returns raw logits (``classify``, ``token_classify``).
        :param step_tag_id: STEP pooling: keep only rows whose prompt token is this id.
        :param returned_token_ids: STEP pooling: keep only these label columns.
        :returns: One array (or dict of arrays) per input, in order.
        :raises InvalidRequestError: for bad input or options the task does not take.
        """
        items = [inputs] if isinstance(inputs, str) or _is_pair(inputs) else list(inputs)
        params = self._check_task(PoolingParams(
            task=task or self.task, dimensions=dimensions, normalize=normalize, use_activation=use_activation,
            step_tag_id=step_tag_id, returned_token_ids=returned_token_ids,
        ))
        requests = self.prepare(items, params, truncate_prompt_tokens=truncate_prompt_tokens,
                                truncation_side=truncation_side, prompt=prompt, prompt_name=prompt_name)
        return [_to_numpy(output) for output in self._run(requests, show_progress_bar)]

    def classify(
        self,
        inputs: ClassifyInput | Sequence[ClassifyInput],
        *,
        use_activation: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right",
        show_progress_bar: bool = False,
    ) -> list[ClassificationResult]:
        """Score each input over the model's labels (a ``*ForSequenceClassification`` model).

        :param inputs: Texts, token-id lists, or ``(text, text_pair)`` tuples for pair
            classifiers (tokenized as the model's tokenizer pairs them, with token types). A
            tuple of two strings is one pair; pass several inputs as a list.
        :param use_activation: ``False`` returns raw logits instead of probabilities.
        :param truncate_prompt_tokens: As for :meth:`embed`.
        :param truncation_side: As for :meth:`embed`.
        :param show_progress_bar: Show a tqdm bar over finished inputs.
        :returns: One :class:`ClassificationResult` per input, in order.
        :raises InvalidRequestError: for bad input, or if this runtime's task is not ``classify``.
        """
        items = [inputs] if isinstance(inputs, str) or _is_pair(inputs) else list(inputs)
        params = self._check_task(PoolingParams(task="classify", use_activation=use_activation))
        requests = self.prepare(items, params, truncate_prompt_tokens=truncate_prompt_tokens,
                                truncation_side=truncation_side)
        outputs = self._run(requests, show_progress_bar)
        labels = self.model_config.labels
        return [ClassificationResult(probs=output.numpy().astype(np.float32), labels=labels) for output in outputs]

    def score(
        self,
        queries: str | Sequence[str],
        documents: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right",
        use_activation: bool | None = None,
    ) -> np.ndarray:
        """Relevance of each (query, document) pair: 1:1, 1:N or N:N.

        A ``classify`` model with one label scores pairs as a cross-encoder (sigmoid of its
        logit, or the logit with ``use_activation=False``); an ``embed`` model scores the cosine
        similarity of the two embeddings, in float32 (a bi-encoder). For any other task each
        text is pooled once and a plugin's ``score_outputs`` hook scores the pairs (SPLADE's
        sparse dot product, ColBERT's MaxSim).

        :returns: ``[num_pairs]`` float32, in pair order.
        :raises InvalidRequestError: for an empty side, or shapes other than 1:1, 1:N, N:N.
        :raises UnsupportedTaskError: for a runtime whose task cannot score pairs.
        """
        plan = self.plan_score(pair_up(queries, documents), truncate_prompt_tokens=truncate_prompt_tokens,
                               truncation_side=truncation_side, use_activation=use_activation)
        return plan.finish(self._run(plan.requests, False))

    def plan_score(
        self, pairs: Sequence[tuple[str, str]], *, truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right", use_activation: bool | None = None,
    ) -> ScorePlan:
        """The engine requests that scoring ``pairs`` needs, and how their outputs become scores.

        The one scoring path of :meth:`score` and the HTTP server's ``/score`` and ``/rerank``:
        the caller runs :attr:`ScorePlan.requests` (through the engine or its loop) and passes
        their outputs, in request order, to :attr:`ScorePlan.finish`. Options as for :meth:`score`.

        :raises InvalidRequestError: for bad input (nothing is tokenized past the first error).
        :raises UnsupportedTaskError: for a runtime whose task cannot score pairs; from ``finish``
            when the ``score_outputs`` plugins decline this runtime's task.
        """
        options: dict[str, Any] = {"truncate_prompt_tokens": truncate_prompt_tokens,
                                   "truncation_side": truncation_side}
        if self.task == "classify" and len(self.model_config.labels) == 1:
            params = PoolingParams(task="classify", use_activation=use_activation)
            return ScorePlan(self.prepare(pairs, params, **options), lambda outputs: np.array(
                [output.numpy()[0] for output in outputs], dtype=np.float32))
        if self.task != "embed" and not self._hooks.implementers("score_outputs"):
            raise self._cannot_score()
        texts = sorted({text for pair in pairs for text in pair})  # each distinct text is pooled once
        requests = self.prepare(texts, PoolingParams(task=self.task), **options)
        return ScorePlan(requests, functools.partial(self._score_pooled, pairs, texts))

    def _score_pooled(self, pairs: Sequence[tuple[str, str]], texts: list[str],
                      outputs: list[RequestOutput]) -> np.ndarray:
        """Cosine of the embeddings (``embed``), else the plugins' ``score_outputs``; ``[num_pairs]`` float32."""
        by_text = dict(zip(texts, outputs, strict=True))
        if self.task == "embed":
            vectors = {text: output.numpy() for text, output in by_text.items()}  # type: ignore[union-attr]
            return cosine(np.stack([vectors[q] for q, _ in pairs]), np.stack([vectors[d] for _, d in pairs]))
        scores = self._hooks.score_outputs(
            model_config=self.model_config, task=self.task,
            queries=[by_text[q] for q, _ in pairs], documents=[by_text[d] for _, d in pairs],
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
            f"(cross-encoder); this runtime serves {self.task!r} with "
            f"{len(self.model_config.labels)} labels, and no plugin scores {self.task!r} outputs "
            "(see `poolrunner plugins --hook score_outputs`)."
        )

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        top_n: int | None = None,
        return_documents: bool = False,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right",
    ) -> list[RerankResult]:
        """Rank ``documents`` by relevance to ``query``, best first.

        :param top_n: Keep the best ``top_n`` (all when ``None`` or larger than the list).
        :param return_documents: Include each document's text in its result.
        :returns: :class:`RerankResult` objects sorted by descending score (ties keep input order).
        :raises InvalidRequestError: for a non-text query, no documents, or ``top_n < 1``.
        """
        if not isinstance(query, str):
            raise InvalidRequestError(f"query must be a string, got {query!r:.80}")
        if isinstance(documents, str):
            raise InvalidRequestError("documents must be a list of strings, not one string")
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
            raise InvalidRequestError(f"top_n must be a positive integer, got {top_n!r}")
        scores = self.score(query, documents, truncate_prompt_tokens=truncate_prompt_tokens,
                            truncation_side=truncation_side)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]
        return [
            RerankResult(index=i, score=float(scores[i]), document=documents[i] if return_documents else None)
            for i in order
        ]

    def prepare(
        self, inputs: Sequence[ClassifyInput], params: PoolingParams, *, truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right", prompt: str | None = None, prompt_name: str | None = None,
    ) -> list[PoolingRequest]:
        """Validate and tokenize ``inputs`` into engine requests (fresh ids), in input order.

        The one path from user input to :class:`PoolingRequest` for this API and the HTTP
        server alike; options as for :meth:`encode`. ``params`` are checked against the engine
        (e.g. ``dimensions``) only when the requests are admitted.

        :raises InvalidRequestError: for a task this runtime does not serve, or bad input
            (naming its index and the limit it breaks).
        """
        self._check_task(params)
        tokenized = self._tokenize(inputs, truncate_prompt_tokens, truncation_side, prompt, prompt_name)
        return [
            PoolingRequest(request_id=f"{params.task}-{next(self._request_ids)}", prompt_token_ids=ids,
                           token_type_ids=types, params=params)
            for ids, types in tokenized
        ]

    def attach_loop(self, loop: EngineLoop | None) -> None:
        """Route this API's calls through ``loop`` (which owns the engine), or back to direct
        driving with ``None``; waits for a call driving the engine directly to finish first."""
        with self._engine_lock:
            self._loop = loop

    def _check_task(self, params: PoolingParams) -> PoolingParams:
        if params.task not in self.supported_tasks:
            raise InvalidRequestError(
                f"this runtime serves tasks {sorted(self.supported_tasks)}, not {params.task!r}; load "
                f"another with Runtime(..., task={params.task!r}) if the model supports it"
            )
        return params

    def _tokenize(
        self, items: Sequence[ClassifyInput], truncate_prompt_tokens: int | None, truncation_side: TruncationSide,
        prompt: str | None = None, prompt_name: str | None = None,
    ) -> list[tuple[tuple[int, ...], tuple[int, ...] | None]]:
        """Tokenize single inputs and ``(text, text_pair)`` pairs, keeping input order."""
        pair_at = [i for i, item in enumerate(items) if _is_pair(item)]
        single_at = [i for i, item in enumerate(items) if not _is_pair(item)]
        encoded: dict[int, tuple[tuple[int, ...], tuple[int, ...] | None]] = {}
        options = {"truncate_prompt_tokens": truncate_prompt_tokens, "truncation_side": truncation_side}
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

    def _run(self, requests: list[PoolingRequest], show_progress_bar: bool) -> list[RequestOutput]:
        """Run ``requests``; outputs in request order."""
        position = {request.request_id: i for i, request in enumerate(requests)}
        results: list[Any] = [None] * len(requests)
        with tqdm(total=len(requests), disable=not show_progress_bar, unit="input") as bar:
            with self._engine_lock:
                loop = self._loop
                if loop is None:  # one caller drives the engine at a time: a step hands its results to whoever runs it
                    for request_id, output in self.engine.run(requests):
                        results[position[request_id]] = output
                        bar.update()
                    return results
            # Attached: the loop batches these with other callers' requests in shared steps.
            submission = loop.submit(requests, on_output=bar.update)
            try:
                return submission.result()
            finally:
                if not submission.future.done():  # interrupted: free the engine of these requests
                    loop.abort(submission)


def _is_pair(item: object) -> bool:
    return isinstance(item, tuple) and len(item) == 2 and all(isinstance(text, str) for text in item)


def _to_numpy(output: RequestOutput) -> np.ndarray | dict[str, np.ndarray]:
    if isinstance(output, dict):
        return {name: tensor.numpy() for name, tensor in output.items()}
    return output.numpy()
