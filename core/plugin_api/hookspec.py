"""Hook specifications for poolrunner plugins.

The runner (:mod:`poolrunner.core.engine`) calls these through the typed facade in
:mod:`poolrunner.core.hooks`, always with keyword arguments. Implement them with
:data:`poolrunner.core.hookimpl`; request only the arguments you use.

A request's life::

    load        claim_model_folder -> supported_tasks -> get_pooler   once per runtime
                request_options                             once per runtime
    admit       add_request                                 once per request
    each step   prepare_inputs -> model -> pool -> process_output
    leave       remove_request                              finished or aborted
    adapters    load_adapter / unload_adapter               at start and on load_lora / unload_lora
    score       score_outputs                               per Runtime.score call (plugin tasks)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # keep this module import-cheap: type-only imports
    from pathlib import Path

    import torch
    from torch import nn

    from poolrunner.core.plugin_api.batch import InputBatch, PoolingMetadata
    from poolrunner.core.plugin_api.options import RequestOption
    from poolrunner.core.plugin_api.output import OutputHandle, RequestOutput
    from poolrunner.core.plugin_api.pooler import Pooler, PoolerOutput
    from poolrunner.core.plugin_api.request import RequestState
    from poolrunner.core.types import LoraRequest, ModelConfig, PoolingTask

PROJECT_NAME = "poolrunner"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marks a plugin's hook implementations; re-exported as ``poolrunner.core.hookimpl``."""

# ---- Load-time hooks: called once per runtime, before any request is accepted. ----


@hookspec
def claim_model_folder(folder: Path, architecture: str) -> str | None:
    """Claim ``folder`` if it holds a model in a format only this plugin runs.

    Called once at load, before the model's configuration is built. A claimed folder is served
    only this plugin's tasks, with its pooler, and core skips its own reading of the folder's
    pipeline (e.g. a sentence-transformers ``SparseEncoder`` folder for a SPLADE plugin, a PyLate
    folder for a ColBERT plugin). Claim only a format you alone know, never a plain backbone.
    Every plugin is asked; two claims fail the load with
    :class:`~poolrunner.core.errors.PluginConflictError`. Read ``modules.json`` with
    :func:`poolrunner.core.read_modules`.

    :param folder: The local model folder.
    :param architecture: ``config.json``'s ``architectures[0]`` (the config class name if none).
    :returns: What in the folder makes it yours, for messages (``"modules.json lists
        sentence_transformers.sparse_encoder.models.SpladePooling"``), or ``None``.

    .. versionadded:: 0.1
    """


@hookspec
def supported_tasks(model_config: ModelConfig) -> Iterable[PoolingTask]:
    """Name the tasks this plugin can serve for ``model_config``.

    Called once at load. Results are collected from every plugin and joined; the runtime then
    intersects that union with ``model_config.model_tasks`` (what the model itself can do).
    A requested task outside the intersection fails the load with
    :class:`~poolrunner.core.errors.UnsupportedTaskError`.

    :param model_config: Frozen description of the loaded model.
    :returns: The tasks served, possibly empty.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def get_pooler(model_config: ModelConfig, task: PoolingTask, model: nn.Module) -> Pooler | None:
    """Return the pooler that computes ``task`` for ``model_config``.

    Called once at load, after the weights are loaded. Stops at the first non-``None`` result
    (pluggy ``firstresult``). Built-in implementations are ``trylast``, so an installed plugin
    that returns a pooler takes precedence; if two installed plugins both answer, the load
    fails with :class:`~poolrunner.core.errors.PluginConflictError` unless the runtime names
    one (``pooler_plugin``). Return ``None``, and do not raise, for tasks or models you do not
    handle.

    :param model_config: Frozen description of the loaded model.
    :param task: The task the runtime serves.
    :param model: The loaded transformers model, head included, in eval mode on its device;
        a pooler may reuse its head modules (a classifier, an LM head).
    :returns: A :class:`~poolrunner.core.plugin_api.pooler.Pooler`, or ``None`` to let the next plugin answer.

    .. versionadded:: 0.1
    """


@hookspec
def request_options(model_config: ModelConfig) -> Iterable[RequestOption]:
    """Declare the request options your tasks take beyond the core ones (SPLADE's ``top_k``).

    Called once at load. Results are collected from every plugin; two plugins declaring one
    name fail the load with :class:`~poolrunner.core.errors.PluginConflictError`. A declared
    option is taken by ``Runtime.encode(..., NAME=VALUE)``, ``poolrunner encode --option
    NAME=VALUE`` and as a body field of ``/pooling`` (shown in the OpenAPI schema); it is
    checked against its type and rule, defaults are filled in, and the pooler reads it from
    ``params.extra_kwargs`` (``None`` when no option is set or defaulted: read
    ``(params.extra_kwargs or {}).get(NAME)``). A request setting an option its task does not
    take, or an unknown one, is refused naming the option and the plugin.

    :param model_config: Frozen description of the loaded model.
    :returns: :class:`~poolrunner.core.plugin_api.options.RequestOption` objects, possibly none.

    .. versionadded:: 0.1
    """


# ---- Request hooks: called as a request enters and leaves the engine. ----


@hookspec
def add_request(state: RequestState, model_config: ModelConfig) -> None:
    """Set up per-request state when a request is admitted.

    Called once per request, after its parameters were checked and before it is first
    scheduled. Results are ignored; every implementation is called. Keep per-request data in
    ``state.plugin_data[<your plugin name>]``. Raising rejects the request: the engine then
    calls ``remove_request`` for it and re-raises (raise
    :class:`~poolrunner.core.errors.InvalidRequestError` for bad input).

    :param state: The request and its runner-owned state.
    :param model_config: Frozen description of the loaded model.
    :returns: Nothing.

    .. versionadded:: 0.1
    """


@hookspec
def remove_request(state: RequestState) -> None:
    """Drop every per-request state when a request leaves the engine.

    Called once per request when it finished **or** was aborted or rejected, so a request id
    reused later never sees stale data. Implementations must be idempotent: calling twice
    is harmless. Every implementation is called.

    :param state: The request and its runner-owned state.
    :returns: Nothing.

    .. versionadded:: 0.1
    """


# ---- Step hooks: called for every forward pass. ----


@hookspec
def prepare_inputs(batch: InputBatch, model_config: ModelConfig) -> Mapping[str, torch.Tensor] | None:
    """Contribute extra keyword arguments to this step's model forward.

    Called every step, before the forward pass. Results are collected from every plugin and
    merged; a key returned by two plugins (or one the runner sets itself: ``input_ids``,
    ``position_ids``, ``use_cache``, ``poolrunner_layout``) raises
    :class:`~poolrunner.core.errors.PluginConflictError`. Tensors are packed like
    ``batch.input_ids``: shape ``[num_tokens]``, on ``batch.device``; the runner adds the
    leading batch dimension.

    :param batch: The packed requests of this step.
    :param model_config: Frozen description of the loaded model.
    :returns: A mapping of forward keyword arguments, or ``None``.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def pool(
    pooler: Pooler, hidden_states: torch.Tensor, metadata: PoolingMetadata
) -> PoolerOutput | None:
    """Turn one step's hidden states into per-request results.

    Called every step, after the forward pass. Stops at the first non-``None`` result. Core's
    default is ``trylast`` and calls ``pooler(hidden_states, metadata)``; implement this hook to
    override pooling or, with ``wrapper=True``, to wrap it (timing, post-processing).

    :param pooler: The runtime's pooler, as chosen by ``get_pooler``.
    :param hidden_states: ``[num_tokens, hidden_size]`` in the model's dtype, packed: the whole
        prompt of every request that finished this step (earlier chunks included).
    :param metadata: Which rows belong to which request, and each request's params.
    :returns: One result per request in packing order, or ``None``.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def process_output(output: PoolerOutput, batch: InputBatch) -> OutputHandle | None:
    """Start moving a step's results to the CPU.

    Called every step, after ``pool``. Stops at the first non-``None`` result. Core's default is
    ``trylast`` and copies synchronously; a plugin may start non-blocking copies and return a
    handle whose ``get_output()`` waits for them. ``get_output()`` is called exactly once.

    :param output: The step's pooled results, on the model's device: one per request that
        finished this step (a request prefilled in chunks finishes with its last chunk).
    :param batch: The packed requests of this step.
    :returns: An :class:`~poolrunner.core.plugin_api.output.OutputHandle`, or ``None``.

    .. versionadded:: 0.1
    """


# ---- Adapter hooks: called when a runtime loads or unloads a LoRA adapter. ----


@hookspec(firstresult=True)
def load_adapter(model: nn.Module, model_config: ModelConfig, lora: LoraRequest, max_rank: int) -> str | None:
    """Load the LoRA adapter folder ``lora.path`` into ``model`` under ``lora.lora_id``.

    Called by the runtime at start for each of ``lora_modules`` and by ``Runtime.load_lora``,
    never while a step runs. Stops at the first non-``None`` result (pluggy ``firstresult``);
    if every plugin returns ``None``, the runtime refuses the adapter. From then on the engine
    requests whose ``params.lora_id`` is ``lora.lora_id`` must compute what PEFT computes with
    this adapter active, and every other request what the base model computes, in one step. The
    base weights stay shared.

    :param model: The loaded transformers model, head included, in eval mode on its device.
    :param model_config: Frozen description of the loaded model.
    :param lora: The adapter's name, number and folder.
    :param max_rank: The largest rank served (``max_lora_rank``).
    :returns: A one-line description for logs (``"rank 8 on 12 modules"``), or ``None`` when
        this plugin does not load adapters.
    :raises ModelLoadError: for a folder refused, naming the file, the field or the tensor.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def unload_adapter(model: nn.Module, lora_id: int) -> bool | None:
    """Drop the adapter loaded as ``lora_id`` from ``model``.

    Called by ``Runtime.unload_lora`` once no request in the engine uses it. Stops at the first
    non-``None`` result.

    :param model: The model :func:`load_adapter` loaded it into.
    :param lora_id: Its number.
    :returns: ``True`` when it was dropped, ``None`` when this plugin does not load adapters.

    .. versionadded:: 0.1
    """


# ---- Scoring hooks: called by Runtime.score for tasks core cannot score itself. ----


@hookspec(firstresult=True)
def score_outputs(
    model_config: ModelConfig, task: PoolingTask, queries: Sequence[RequestOutput],
    documents: Sequence[RequestOutput], options: Mapping[str, Any],
) -> torch.Tensor | None:
    """Score (query, document) pairs from their pooled outputs.

    Called by ``Runtime.score`` (and so ``rerank``) when the runtime's task is neither ``embed``
    (core scores the cosine) nor a one-label ``classify`` (a cross-encoder): each text has been
    pooled once for the runtime's task, and pair ``i`` is ``(queries[i], documents[i])``.
    Stops at the first non-``None`` result (pluggy ``firstresult``); if every plugin returns
    ``None``, ``score`` raises :class:`~poolrunner.core.errors.UnsupportedTaskError`. Return
    ``None``, and do not raise, for tasks or models you do not score.

    :param model_config: Frozen description of the loaded model.
    :param task: The runtime's task, which produced the outputs.
    :param queries: One pooled output per pair, on the CPU, as the ``pool`` hook produced it
        (a tensor, or a dict of named tensors).
    :param documents: One pooled output per pair, same length and order as ``queries``.
    :param options: The score call's request options for ``task`` (``Runtime.score(...,
        NAME=VALUE)``), checked and with every declared default filled in, as the pooler saw
        them in ``params.extra_kwargs``; empty when the task takes none. Per-call scoring
        settings (BGE-M3's mode weights) are read here. An implementation may leave this
        argument out (pluggy passes only the arguments it names).
    :returns: ``[num_pairs]`` float32 scores, higher meaning more relevant, or ``None``.

    .. versionadded:: 0.1
    """
