"""Typed facade over ``pm.hook``: the only code that calls hooks.

``pm.hook.<name>()`` returns ``Any``; each method here gives the runner a typed, keyword-only
call and merges collect-all results by the rule the spec documents.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from poolrunner.core.errors import PluginConflictError
from poolrunner.core.plugin_api.options import DeclaredOption, RequestOptions

if TYPE_CHECKING:
    from pathlib import Path

    import pluggy
    import torch
    from torch import nn

    from poolrunner.core.plugin_api.batch import InputBatch, PoolingMetadata
    from poolrunner.core.plugin_api.output import OutputHandle, RequestOutput
    from poolrunner.core.plugin_api.pooler import Pooler, PoolerOutput
    from poolrunner.core.plugin_api.request import RequestState
    from poolrunner.core.types import ModelConfig, PoolingTask

# Forward keyword arguments the runner sets itself; no plugin may return them. Keep in sync
# with ModelRunner.forward (``poolrunner_layout`` is core.kernels.attention.LAYOUT_KWARG);
# tests/plugin_system checks every one of them.
RUNNER_INPUT_KEYS = frozenset({"input_ids", "position_ids", "attention_mask", "use_cache", "poolrunner_layout"})


class Hooks:
    """Calls the hooks of one plugin manager."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self._pm = pm
        self._hook = pm.hook

    def claim_model_folder(self, *, folder: Path, architecture: str) -> dict[str, str]:
        """Each claiming plugin's name and reason (every implementation asked on its own)."""
        return {plugin: str(reason) for plugin, reason in
                self._each("claim_model_folder", folder=folder, architecture=architecture) if reason is not None}

    def supported_tasks(self, *, model_config: ModelConfig) -> frozenset[PoolingTask]:
        results = self._hook.supported_tasks(model_config=model_config)
        return frozenset(task for tasks in results for task in tasks)

    def tasks_by_plugin(self, *, model_config: ModelConfig) -> dict[str, frozenset[PoolingTask]]:
        """Each plugin's own answer to ``supported_tasks``, for error messages and listings."""
        answers = self._each("supported_tasks", call_order=False, model_config=model_config)
        return {plugin: frozenset(tasks or ()) for plugin, tasks in answers}

    def get_pooler(self, *, model_config: ModelConfig, task: PoolingTask, model: nn.Module) -> Pooler | None:
        return self._hook.get_pooler(model_config=model_config, task=task, model=model)

    def get_pooler_from(
        self, plugins: Collection[str], *, model_config: ModelConfig, task: PoolingTask, model: nn.Module
    ) -> Pooler | None:
        """``get_pooler`` asking only the named ``plugins``."""
        others = [p for name, p in self._pm.list_name_plugin() if name not in plugins]
        caller = self._pm.subset_hook_caller("get_pooler", remove_plugins=others)
        return caller(model_config=model_config, task=task, model=model)

    def request_options(self, *, model_config: ModelConfig) -> RequestOptions:
        """Every plugin's declared request options, each with its plugin's name.

        :raises PluginConflictError: when two plugins declare one name.
        """
        return RequestOptions(DeclaredOption(option, plugin)
                              for plugin, options in self._each("request_options", model_config=model_config)
                              for option in options or ())

    def _each(self, hook_name: str, *, call_order: bool = True, **arguments: Any) -> Iterator[tuple[str, Any]]:
        """``(plugin name, answer)`` of every implementation of ``hook_name``, each asked on its
        own with the arguments it names, in call order (else in registration order)."""
        impls = getattr(self._hook, hook_name).get_hookimpls()
        for impl in reversed(impls) if call_order else impls:
            yield impl.plugin_name, impl.function(**{name: arguments[name] for name in impl.argnames})

    def implementers(self, hook_name: str) -> list[str]:
        """Names of the plugins implementing ``hook_name``, in call order."""
        return [impl.plugin_name for impl in reversed(getattr(self._hook, hook_name).get_hookimpls())]

    def add_request(self, *, state: RequestState, model_config: ModelConfig) -> None:
        self._hook.add_request(state=state, model_config=model_config)

    def remove_request(self, *, state: RequestState) -> None:
        self._hook.remove_request(state=state)

    def prepare_inputs(
        self, *, batch: InputBatch, model_config: ModelConfig
    ) -> dict[str, torch.Tensor]:
        merged: dict[str, torch.Tensor] = {}
        for result in self._hook.prepare_inputs(batch=batch, model_config=model_config):
            if not isinstance(result, Mapping):
                raise TypeError(f"prepare_inputs returned {type(result).__name__}, not a mapping")
            for key, value in result.items():
                if key in RUNNER_INPUT_KEYS or key in merged:
                    raise PluginConflictError(
                        f"prepare_inputs: two sources set the model input {key!r} (the runner "
                        f"sets {sorted(RUNNER_INPUT_KEYS)}; plugins implementing this hook: "
                        f"{self.implementers('prepare_inputs')}); disable one of them"
                    )
                merged[key] = value
        return merged

    def pool(
        self, *, pooler: Pooler, hidden_states: torch.Tensor, metadata: PoolingMetadata
    ) -> PoolerOutput:
        return self._hook.pool(pooler=pooler, hidden_states=hidden_states, metadata=metadata)

    def process_output(self, *, output: PoolerOutput, batch: InputBatch) -> OutputHandle:
        return self._hook.process_output(output=output, batch=batch)

    def score_outputs(
        self, *, model_config: ModelConfig, task: PoolingTask, queries: Sequence[RequestOutput],
        documents: Sequence[RequestOutput], options: Mapping[str, Any],
    ) -> torch.Tensor | None:
        return self._hook.score_outputs(model_config=model_config, task=task, queries=queries, documents=documents,
                                        options=options)
