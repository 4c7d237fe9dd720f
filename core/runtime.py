"""The Python API: load a model once, then embed, classify, score, rerank or encode."""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from poolrunner.core.config import ModelOverrides, RuntimeConfig, default_token_budget
from poolrunner.core.engine.engine import Engine
from poolrunner.core.engine.runner import ModelRunner
from poolrunner.core.engine.scheduler import Scheduler
from poolrunner.core.errors import InvalidRequestError, UnsupportedTaskError
from poolrunner.core.hooks import Hooks
from poolrunner.core.inputs.tokenize import InputProcessor, PromptInput
from poolrunner.core.manager import PoolrunnerPluginManager, build_plugin_manager
from poolrunner.core.model import loader, metadata
from poolrunner.core.output import RequestOutput
from poolrunner.core.results import ClassificationResult, RerankResult
from poolrunner.core.scoring import cosine, pair_up
from poolrunner.core.selection import resolve_task, select_pooler
from poolrunner.core.types import ModelConfig, PoolingParams, PoolingRequest, PoolingTask, TruncationSide

ClassifyInput = PromptInput | tuple[str, str]
"""A text, token ids, or a ``(text, text_pair)`` pair."""

logger = logging.getLogger(__name__)


class Runtime:
    """A loaded pooling model with its plugins, ready to serve requests.

    Methods may be called from several threads; calls take turns on the one engine.

    Example::

        from poolrunner import Runtime
        runtime = Runtime()  # all-MiniLM-L6-v2, shipped with poolrunner
        vectors = runtime.embed(["A cat sat.", "A dog ran."])  # float32 [2, 384]

    :param model: Local model folder; ``None`` loads the default model (all-MiniLM-L6-v2).
    :param task: Task to serve; ``None`` picks the model's default (vLLM's order).
    :param dtype: ``auto``, ``float32``, ``bfloat16`` or ``float16``.
    :param device: ``auto`` (CUDA when present, else CPU) or a torch device string.
    :param plugins: Extra plugin objects to register, beside built-ins and entry points.
    :param load_entrypoints: Load the ``poolrunner.plugins`` entry-point group.
    :param disable_plugins: Names of plugins to leave out (built-ins too).
    :param pooler_plugin: Name of the plugin whose pooler to use when several offer one.
    :param max_num_batched_tokens: Token budget of one forward pass; ``None``: 2048 on the CPU,
        16384 on CUDA.
    :param max_num_seqs: Most requests in one forward pass.
    :param async_scheduling: Launch the next step before collecting the previous one's results;
        ``None``: on for CUDA, where the copies then overlap compute; off on the CPU.
    :param pooling_type: Override the model's sequence pooling (``CLS``, ``MEAN``, ``LAST``).
    :param normalize: Override the model's default normalization.
    :param max_model_len: Lower the longest accepted prompt, in tokens.
    :param is_matryoshka: Accept ``dimensions`` although the model's config does not declare it.
    :param matryoshka_dimensions: The allowed ``dimensions`` (implies ``is_matryoshka``).
    :raises ModelLoadError: if the folder cannot be loaded.
    :raises UnsupportedTaskError: if ``task`` is not served for this model by the plugins.
    :raises PluginLoadError: if a plugin fails to import or names an unknown hook.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        task: PoolingTask | None = None,
        dtype: str = "auto",
        device: str = "auto",
        plugins: Sequence[object] = (),
        load_entrypoints: bool = True,
        disable_plugins: Collection[str] = (),
        pooler_plugin: str | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int = 256,
        async_scheduling: bool | None = None,
        pooling_type: str | None = None,
        normalize: bool | None = None,
        max_model_len: int | None = None,
        is_matryoshka: bool | None = None,
        matryoshka_dimensions: Sequence[int] | None = None,
    ) -> None:
        self.config = RuntimeConfig(
            model=None if model is None else os.fspath(model), task=task, dtype=dtype,
            device=device, pooler_plugin=pooler_plugin, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, async_scheduling=async_scheduling,
            overrides=ModelOverrides(
                pooling_type=pooling_type, normalize=normalize, max_model_len=max_model_len,
                is_matryoshka=is_matryoshka, matryoshka_dimensions=matryoshka_dimensions,
            ),
        )
        self.plugin_manager: PoolrunnerPluginManager = build_plugin_manager(
            plugins=plugins, load_entrypoints=load_entrypoints, disable=disable_plugins
        )
        self.plugin_manager.freeze()
        hooks = Hooks(self.plugin_manager)
        path = metadata.resolve_model_path(self.config.model)
        hf_config = metadata.load_hf_config(path)
        tokenizer = loader.load_tokenizer(path)
        self.model_config: ModelConfig = metadata.load_model_config(
            path, hf_config, tokenizer.model_max_length, self.config.overrides
        )
        # The task check runs before the (slow) weight load, so a wrong task fails fast.
        self.task: PoolingTask = resolve_task(hooks, self.plugin_manager, self.model_config, self.config.task)
        self.device = loader.resolve_device(self.config.device)
        self.dtype = loader.resolve_dtype(self.config.dtype, hf_config, self.device)
        model_module = loader.load_model(path, hf_config, self.dtype, self.device)
        pooler = select_pooler(hooks, self.plugin_manager, self.model_config, self.task, model_module,
                               self.config.pooler_plugin)
        self.inputs = InputProcessor(tokenizer, self.model_config)
        self.engine = Engine(
            ModelRunner(model_module, pooler.to(self.device), hooks, self.model_config),
            Scheduler(max_num_batched_tokens=self.config.max_num_batched_tokens
                      or default_token_budget(self.device.type),
                      max_num_seqs=self.config.max_num_seqs, chunked_prefill=self.model_config.is_causal),
            hooks, self.model_config, self.device,
            async_scheduling=(self.device.type == "cuda" if async_scheduling is None else async_scheduling),
        )
        self._request_ids = itertools.count()
        self._engine_lock = threading.Lock()
        logger.info("loaded %s (%s) for task %r on %s as %s", path, self.model_config.architecture,
                    self.task, self.device, self.dtype)

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
        tokenized = self._tokenize(inputs, truncate_prompt_tokens, truncation_side, prompt, prompt_name)
        outputs = self._run(tokenized, params, show_progress_bar)
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
        :param task: Must be the runtime's task (the default); a runtime serves one task.
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
        tokenized = self._tokenize(items, truncate_prompt_tokens, truncation_side, prompt, prompt_name)
        return [_to_numpy(output) for output in self._run(tokenized, params, show_progress_bar)]

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
        outputs = self._run(self._tokenize(items, truncate_prompt_tokens, truncation_side), params,
                            show_progress_bar)
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
        similarity of the two embeddings, in float32 (a bi-encoder).

        :returns: ``[num_pairs]`` float32, in pair order.
        :raises InvalidRequestError: for an empty side, or shapes other than 1:1, 1:N, N:N.
        :raises UnsupportedTaskError: for a runtime whose task cannot score pairs.
        """
        pairs = pair_up(queries, documents)
        if self.task == "embed":
            texts = sorted({text for pair in pairs for text in pair})
            vectors = dict(zip(texts, self.embed(texts, truncate_prompt_tokens=truncate_prompt_tokens,
                                                 truncation_side=truncation_side), strict=True))
            return cosine(np.stack([vectors[q] for q, _ in pairs]), np.stack([vectors[d] for _, d in pairs]))
        if self.task == "classify" and len(self.model_config.labels) == 1:
            results = self.classify(pairs, use_activation=use_activation,
                                    truncate_prompt_tokens=truncate_prompt_tokens, truncation_side=truncation_side)
            return np.array([result.probs[0] for result in results], dtype=np.float32)
        raise UnsupportedTaskError(
            f"score needs an embed model (bi-encoder) or a classify model with one label "
            f"(cross-encoder); this runtime serves {self.task!r} with "
            f"{len(self.model_config.labels)} labels. Late interaction (token_embed) is not "
            "supported yet."
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

    def _check_task(self, params: PoolingParams) -> PoolingParams:
        if params.task != self.task:
            raise InvalidRequestError(
                f"this runtime serves task {self.task!r}, not {params.task!r}; load another with "
                f"Runtime(..., task={params.task!r}) if the model supports it"
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

    def _run(
        self, inputs: list[tuple[tuple[int, ...], tuple[int, ...] | None]], params: PoolingParams,
        show_progress_bar: bool,
    ) -> list[RequestOutput]:
        """Run tokenized ``(prompt_token_ids, token_type_ids)`` inputs; outputs in input order."""
        requests = [
            PoolingRequest(request_id=f"{params.task}-{next(self._request_ids)}", prompt_token_ids=ids,
                           token_type_ids=types, params=params)
            for ids, types in inputs
        ]
        position = {request.request_id: i for i, request in enumerate(requests)}
        results: list[Any] = [None] * len(requests)
        # One caller drives the engine at a time: a step hands its results to whoever runs it.
        with self._engine_lock, tqdm(total=len(requests), disable=not show_progress_bar, unit="input") as bar:
            for request_id, output in self.engine.run(requests):
                results[position[request_id]] = output
                bar.update()
        return results


def _is_pair(item: object) -> bool:
    return isinstance(item, tuple) and len(item) == 2 and all(isinstance(text, str) for text in item)


def _to_numpy(output: RequestOutput) -> np.ndarray | dict[str, np.ndarray]:
    if isinstance(output, dict):
        return {name: tensor.numpy() for name, tensor in output.items()}
    return output.numpy()
