"""Hook wrappers (``@hookimpl(wrapper=True)``) act as pluggy defines, also around the hooks core
asks each plugin on its own (``supported_tasks``, ``request_options``, ``claim_model_folder``)
and around ``get_pooler`` asked of one plugin at a time: the wrapper sees each answer and may
change it."""

from __future__ import annotations

from typing import Any

import poolrunner
from poolrunner.core import ModelConfig, RequestOption, build_plugin_manager, hookimpl
from poolrunner.core.hooks import Hooks
from tests.plugin_system.builtin_plugins import pooling_builtins

TASK = "head_first"
FIRST = RequestOption(name="first", type=int, tasks={TASK}, help="Use the first N tokens.")
SCALE = RequestOption(name="scale", type=float, tasks={TASK}, default=1.0, help="Multiply by this factor.")


class DeclaresOptions:
    """Claims ``head_first`` and declares two request options for it."""

    @hookimpl
    def supported_tasks(self) -> set[str]:
        return {TASK, "token_classify"}

    @hookimpl
    def request_options(self, model_config: ModelConfig) -> list[RequestOption]:
        return [FIRST, SCALE]


class Narrows:
    """Wraps the per-plugin hooks: records each answer, drops ``scale`` and ``token_classify``."""

    def __init__(self) -> None:
        self.seen: dict[str, list[Any]] = {"request_options": [], "supported_tasks": []}

    @hookimpl(wrapper=True)
    def request_options(self, model_config: ModelConfig):
        answers = yield
        self.seen["request_options"].append(answers)
        return [[option for option in options if option.name != "scale"] for options in answers]

    @hookimpl(wrapper=True)
    def supported_tasks(self):
        answers = yield
        self.seen["supported_tasks"].append(answers)
        return [set(tasks) - {"token_classify"} for tasks in answers]


def test_a_wrapper_sees_and_changes_each_plugins_answer(default_runtime):
    model_config = default_runtime.model_config
    narrows = Narrows()
    hooks = Hooks(build_plugin_manager(plugins=[DeclaresOptions(), narrows], load_entrypoints=False,
                                       disable=pooling_builtins()))

    declared = hooks.request_options(model_config=model_config)
    assert [(entry.option, entry.plugin) for entry in declared] == [(FIRST, "DeclaresOptions")]
    assert [[FIRST, SCALE]] in narrows.seen["request_options"]  # the plugin's own answer, alone

    assert hooks.tasks_by_plugin(model_config=model_config)["DeclaresOptions"] == {TASK}
    assert [{TASK, "token_classify"}] in narrows.seen["supported_tasks"]
    assert "Narrows" not in hooks.tasks_by_plugin(model_config=model_config)  # a wrapper gives no answer
    assert hooks.supported_tasks(model_config=model_config) >= {TASK}
    assert "token_classify" not in hooks.supported_tasks(model_config=model_config)


class ClaimsEverything:
    @hookimpl
    def claim_model_folder(self, folder, architecture) -> str:
        return "every folder is mine"


class Unclaims:
    """Wraps ``claim_model_folder``: withdraws every claim."""

    @hookimpl(wrapper=True)
    def claim_model_folder(self, folder, architecture):
        claims = yield
        assert claims == ["every folder is mine"]
        return []


def test_a_wrapper_can_withdraw_a_folder_claim(default_model_path):
    plain = Hooks(build_plugin_manager(plugins=[ClaimsEverything()], load_entrypoints=False))
    wrapped = Hooks(build_plugin_manager(plugins=[ClaimsEverything(), Unclaims()], load_entrypoints=False))
    folder = default_model_path
    assert plain.claim_model_folder(folder=folder, architecture="BertModel") == {
        "ClaimsEverything": "every folder is mine"}
    assert wrapped.claim_model_folder(folder=folder, architecture="BertModel") == {}


class WatchesPoolers:
    """Wraps ``get_pooler``: records which pooler each task got."""

    def __init__(self) -> None:
        self.poolers: list[tuple[str, str]] = []

    @hookimpl(wrapper=True)
    def get_pooler(self, task: str):
        pooler = yield
        self.poolers.append((task, type(pooler).__name__))
        return pooler


def test_a_get_pooler_wrapper_runs_at_load():
    """Core asks the built-ins' ``get_pooler`` apart from other plugins'; the wrapper stays around it."""
    watcher = WatchesPoolers()
    runtime = poolrunner.Runtime(plugins=[watcher], load_entrypoints=False, dtype="float32", task="embed")
    assert watcher.poolers == [("embed", "EmbeddingPooler")]
    assert runtime.plugin_manager.get_plugin("WatchesPoolers") is watcher
