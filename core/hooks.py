"""The plugin manager of one runtime, and the only code that calls its hooks.

``pm.hook.<name>()`` returns ``Any``; each method here gives the runner a typed, keyword-only
call and merges collect-all results by the rule the spec documents. Every call goes through
pluggy's own hook callers (``pm.hook.<name>``, ``pm.subset_hook_caller``), so hook wrappers and
``tryfirst`` / ``trylast`` act exactly as pluggy defines, per-plugin answers included. An
exception a plugin's implementation raises that is not poolrunner's own comes out as a
:class:`~poolrunner.core.errors.PluginHookError` naming that plugin (:meth:`Hooks._call`): one
faulty plugin can fail every request, and its traceback alone does not say whose it is.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from poolrunner.core.errors import PluginConflictError, PluginHookError, PoolrunnerError
from poolrunner.core.manager import PoolrunnerPluginManager, build_plugin_manager
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
    from poolrunner.core.types import LoraRequest, ModelConfig, PluginInfo, PoolingTask

# Forward keyword arguments the runner sets itself; no plugin may return them. Keep in sync
# with ModelRunner.forward (``poolrunner_layout`` is core.kernels.attention.LAYOUT_KWARG);
# tests/plugin_system checks every one of them.
RUNNER_INPUT_KEYS = frozenset({"input_ids", "position_ids", "attention_mask", "use_cache", "poolrunner_layout"})


class Hooks:
    """Owns one plugin manager and calls its hooks (as tox's ``Plugin`` owns its manager).

    :ivar manager: The plugin manager; read it (``plugin_infos``, ``add_hookcall_monitoring``),
        call hooks through the methods here.
    """

    def __init__(self, manager: PoolrunnerPluginManager) -> None:
        self.manager = manager
        self._hook = manager.hook

    @classmethod
    def build(
        cls, *, plugins: Sequence[object] = (), load_entrypoints: bool = True, disable: Collection[str] = (),
    ) -> Hooks:
        """The hooks of a fresh, frozen manager (:func:`~poolrunner.core.manager.build_plugin_manager`'s
        arguments and errors): a loaded runtime's plugin set is fixed."""
        manager = build_plugin_manager(plugins=plugins, load_entrypoints=load_entrypoints, disable=disable)
        manager.freeze()
        return cls(manager)

    def plugin_infos(self) -> list[PluginInfo]:
        """Every registered plugin, in registration order."""
        return self.manager.plugin_infos()

    def only_builtin(self, hook: str) -> bool:
        """Whether every plugin implementing ``hook`` ships with poolrunner."""
        return all(info.source == "builtin" for info in self.plugin_infos() if hook in info.hooks)

    def has_plugin(self, name: str) -> bool:
        """Whether a plugin is registered under ``name`` (a disabled one is not)."""
        return self.manager.has_plugin(name)

    def claim_model_folder(self, *, folder: Path, architecture: str) -> dict[str, str]:
        """Each claiming plugin's name and reason (every plugin asked on its own)."""
        answers = self._each("claim_model_folder", folder=folder, architecture=architecture)
        return {plugin: "; ".join(map(str, reasons)) for plugin, reasons in answers if reasons}

    def supported_tasks(self, *, model_config: ModelConfig) -> frozenset[PoolingTask]:
        results = self._call("supported_tasks", model_config=model_config)
        return frozenset(task for tasks in results for task in tasks)

    def tasks_by_plugin(self, *, model_config: ModelConfig) -> dict[str, frozenset[PoolingTask]]:
        """Each plugin's own answer to ``supported_tasks``, for error messages and listings."""
        answers = self._each("supported_tasks", call_order=False, model_config=model_config)
        return {plugin: frozenset(task for tasks in results for task in tasks) for plugin, results in answers}

    def get_pooler(self, *, model_config: ModelConfig, task: PoolingTask, model: nn.Module) -> Pooler | None:
        return self._call("get_pooler", model_config=model_config, task=task, model=model)

    def get_pooler_from(
        self, plugins: Collection[str], *, model_config: ModelConfig, task: PoolingTask, model: nn.Module
    ) -> Pooler | None:
        """``get_pooler`` asking only the named ``plugins`` (every wrapper kept)."""
        return self._call("get_pooler", model_config=model_config, task=task, model=model,
                          caller=self._caller("get_pooler", plugins))

    def request_options(self, *, model_config: ModelConfig) -> RequestOptions:
        """Every plugin's declared request options, each with its plugin's name.

        :raises PluginConflictError: when two plugins declare one name.
        """
        return RequestOptions(DeclaredOption(option, plugin)
                              for plugin, results in self._each("request_options", model_config=model_config)
                              for options in results for option in options)

    def implementers(self, hook_name: str) -> list[str]:
        """Names of the plugins answering ``hook_name`` (its implementations that are not
        wrappers), in call order."""
        impls = reversed(getattr(self._hook, hook_name).get_hookimpls())
        return list(dict.fromkeys(impl.plugin_name for impl in impls if not _is_wrapper(impl)))

    def _each(self, hook_name: str, *, call_order: bool = True, **arguments: Any) -> Iterator[tuple[str, list[Any]]]:
        """``(plugin name, results)`` for every plugin answering the collect-all hook
        ``hook_name``, each asked on its own through :meth:`_caller` (so every wrapper runs around
        each plugin's answer, once per plugin); in call order, else in registration order."""
        names = self.implementers(hook_name)
        for name in names if call_order else reversed(names):
            yield name, self._call(hook_name, caller=self._caller(hook_name, {name}), **arguments)

    def _caller(self, hook_name: str, plugins: Collection[str]) -> pluggy.HookCaller:
        """pluggy's caller of ``hook_name`` without the answers of the plugins not in ``plugins``;
        the plugins wrapping the hook stay, so their wrappers see and may change the result."""
        wrapping = {impl.plugin_name for impl in getattr(self._hook, hook_name).get_hookimpls() if _is_wrapper(impl)}
        others = [plugin for name, plugin in self.manager.list_name_plugin() if name not in {*plugins, *wrapping}]
        return self.manager.subset_hook_caller(hook_name, remove_plugins=others)

    def load_adapter(self, *, model: nn.Module, model_config: ModelConfig, lora: LoraRequest,
                     max_rank: int) -> str | None:
        return self._call("load_adapter", model=model, model_config=model_config, lora=lora, max_rank=max_rank)

    def unload_adapter(self, *, model: nn.Module, lora_id: int) -> bool | None:
        return self._call("unload_adapter", model=model, lora_id=lora_id)

    def add_request(self, *, state: RequestState, model_config: ModelConfig) -> None:
        self._call("add_request", state=state, model_config=model_config)

    def remove_request(self, *, state: RequestState) -> None:
        self._call("remove_request", state=state)

    def prepare_inputs(
        self, *, batch: InputBatch, model_config: ModelConfig
    ) -> dict[str, torch.Tensor]:
        merged: dict[str, torch.Tensor] = {}
        for result in self._call("prepare_inputs", batch=batch, model_config=model_config):
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
        return self._call("pool", pooler=pooler, hidden_states=hidden_states, metadata=metadata)

    def process_output(self, *, output: PoolerOutput, batch: InputBatch) -> OutputHandle:
        return self._call("process_output", output=output, batch=batch)

    def score_outputs(
        self, *, model_config: ModelConfig, task: PoolingTask, queries: Sequence[RequestOutput],
        documents: Sequence[RequestOutput], options: Mapping[str, Any],
    ) -> torch.Tensor | None:
        return self._call("score_outputs", model_config=model_config, task=task, queries=queries,
                          documents=documents, options=options)

    def _call(self, hook_name: str, *, caller: pluggy.HookCaller | None = None, **arguments: Any) -> Any:
        """``hook_name`` called through ``caller`` (default: every plugin's).

        :raises PluginHookError: for an exception that is not poolrunner's own raised in a
            plugin's implementation (the innermost one in its traceback), chained as its cause.
        """
        try:
            return (getattr(self._hook, hook_name) if caller is None else caller)(**arguments)
        except PoolrunnerError:
            raise  # poolrunner's own (a plugin refusing a request says so itself)
        except Exception as exc:
            name = self._raised_in(hook_name, exc)
            if name is None:
                raise
            raise PluginHookError(
                f"plugin {self.manager.plugin_info(name).describe()} raised in its {hook_name} hook: "
                f"{type(exc).__name__}: {exc}; fix it, or leave it out (disable_plugins, --disable-plugin "
                f"{name})") from exc

    def _raised_in(self, hook_name: str, exc: BaseException) -> str | None:
        """The plugin whose implementation of ``hook_name`` is the innermost in ``exc``'s
        traceback, unless it ships with poolrunner (a pooler a built-in ``pool`` calls is named
        by the runner instead); ``None`` when none is."""
        impls = {impl.function.__code__: impl.plugin_name for impl in getattr(self._hook, hook_name).get_hookimpls()}
        name, tb = None, exc.__traceback__
        while tb is not None:
            name = impls.get(tb.tb_frame.f_code, name)
            tb = tb.tb_next
        if name is None or self.manager.plugin_info(name).source == "builtin":
            return None
        return name


def _is_wrapper(impl: pluggy.HookImpl) -> bool:
    """A new-style (``wrapper=True``) or old-style (``hookwrapper=True``) wrapper."""
    return impl.wrapper or impl.hookwrapper
