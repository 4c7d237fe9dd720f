"""Load-time choices: which plugin a folder needs, which task the runtime serves and which
plugin's pooler computes it."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from poolrunner.core.errors import ModelLoadError, PluginConflictError, UnsupportedTaskError
from poolrunner.core.hooks import Hooks
from poolrunner.core.model.plugin_requirements import unclaimed_format
from poolrunner.core.model.tasks import default_task
from poolrunner.core.plugin_api.pooler import Pooler
from poolrunner.core.types import POOLING_TASKS, ModelConfig, PoolingTask, RequiredPlugin

_REMEDY = "Pick a supported task, or install a plugin that serves it (see `poolrunner plugins --all`)."


def resolve_task(hooks: Hooks, model_config: ModelConfig, requested: PoolingTask | None) -> PoolingTask:
    """The requested task, or the model's default, checked against what is served.

    See :func:`served_tasks` for what is served.

    :raises UnsupportedTaskError: naming the task, the supported tasks, the plugins and the remedy.
    :raises ModelLoadError: if the folder declares a plugin that is not registered.
    """
    supported = served_tasks(hooks, model_config)
    task = requested or default_task(model_config.architecture, supported)
    if task is not None and task in supported:
        return task
    served = hooks.tasks_by_plugin(model_config=model_config)
    plugins = ", ".join(
        f"{info.describe()} serves {sorted(served.get(info.name, ()))}"
        for info in hooks.plugin_infos() if {"supported_tasks", "get_pooler"} & set(info.hooks)
    )
    asked = f"task {requested!r}" if requested else "any task"
    raise UnsupportedTaskError(
        f"model {model_config.name!r} ({model_config.architecture}) does not support {asked}. "
        f"Supported: {sorted(supported)}. The model itself can do {sorted(model_config.model_tasks)}; "
        f"pooling plugins: {plugins or 'none'}. {_REMEDY}", task=requested,
    )


def required_plugin(hooks: Hooks, folder: Path, architecture: str) -> RequiredPlugin | None:
    """The plugin ``folder`` must be served by: the one plugin that claims it
    (``claim_model_folder``), else, for a known format no installed plugin claimed, the plugin
    :data:`~poolrunner.core.model.plugin_requirements.FOLDER_FORMATS` names (its absence then
    fails the load with the install command); ``None`` for an ordinary folder.

    :raises PluginConflictError: if several plugins claim the folder.
    """
    claims = hooks.claim_model_folder(folder=folder, architecture=architecture)
    if len(claims) > 1:
        raise PluginConflictError(
            f"plugins {sorted(claims)} all claim the model folder {folder} "
            f"({'; '.join(f'{name}: {reason}' for name, reason in sorted(claims.items()))}); disable all but one"
        )
    if not claims:
        return unclaimed_format(folder, architecture)
    (name, reason), = claims.items()
    dist = next((info.dist for info in hooks.plugin_infos() if info.name == name and info.dist), name)
    return RequiredPlugin(name=name, dist=dist, reason=reason)


def served_tasks(hooks: Hooks, model_config: ModelConfig) -> frozenset[PoolingTask]:
    """The tasks a runtime can serve for ``model_config``.

    A built-in task is served when the model can do it (``model_config.model_tasks``) and a
    plugin claims it; a plugin-declared task (outside :data:`POOLING_TASKS`) when a plugin
    claims it, the plugin having judged the model itself. A folder that declares the plugin it
    needs (``model_config.required_plugin``) is served only that plugin's tasks.

    :raises ModelLoadError: naming the missing distribution and how to install it.
    """
    required = model_config.required_plugin
    if required is not None:
        if not hooks.has_plugin(required.name):
            raise ModelLoadError(
                f"model {model_config.name!r} needs the {required.name!r} plugin ({required.reason}), "
                f"which is not installed or is disabled: pip install {required.dist}"
            )
        return hooks.tasks_by_plugin(model_config=model_config).get(required.name, frozenset())
    claimed = hooks.supported_tasks(model_config=model_config)
    return (model_config.model_tasks | (claimed - set(POOLING_TASKS))) & claimed


def select_pooler(
    hooks: Hooks, model_config: ModelConfig, task: PoolingTask, model: nn.Module, pooler_plugin: str | None,
) -> Pooler:
    """The pooler for ``task``: from ``pooler_plugin`` when named (by default the plugin the
    model folder requires), else from the single non-built-in plugin that answers, else from
    the built-ins.

    :raises PluginConflictError: if several non-built-in plugins answer and none is named.
    :raises UnsupportedTaskError: if no plugin (or not the named one) returns a pooler.
    """
    args = {"model_config": model_config, "task": task, "model": model}
    if pooler_plugin is None and model_config.required_plugin is not None:
        pooler_plugin = model_config.required_plugin.name
    if pooler_plugin is not None:
        if not hooks.has_plugin(pooler_plugin):
            raise UnsupportedTaskError(f"pooler_plugin {pooler_plugin!r} is not a registered plugin")
        pooler = hooks.get_pooler_from({pooler_plugin}, **args)
        if pooler is None:
            raise UnsupportedTaskError(f"plugin {pooler_plugin!r} returned no pooler for task {task!r}")
        return pooler
    builtin = {info.name for info in hooks.plugin_infos() if info.source == "builtin"}
    answers = {}
    for name in hooks.implementers("get_pooler"):
        if name not in builtin and (offered := hooks.get_pooler_from({name}, **args)) is not None:
            answers[name] = offered
    if len(answers) > 1:
        raise PluginConflictError(
            f"plugins {sorted(answers)} all offer a pooler for task {task!r}; choose one with "
            "pooler_plugin=<name> or disable the others"
        )
    pooler = next(iter(answers.values()), None) or hooks.get_pooler_from(builtin, **args)
    if pooler is None:
        raise UnsupportedTaskError(f"no plugin returned a pooler for task {task!r} of model {model_config.name}")
    return pooler
