"""The plugin manager: built per runtime, one registration path, disabling, validation, names."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import importlib_metadata
import pluggy
import pytest

import poolrunner
from poolrunner.core import (
    PluginConflictError,
    PluginInfo,
    PluginLoadError,
    UnsupportedTaskError,
    build_plugin_manager,
    hookimpl,
)
from poolrunner.core.hooks import Hooks
from poolrunner.core.manager import PoolrunnerPluginManager
from tests.plugin_system.builtin_plugins import (
    BUILTIN_PLUGINS,
    DISABLEABLE_BUILTINS,
    builtin_infos,
    describe_pooling_builtins,
    pooling_builtins,
)

POOLRUNNER_VERSION = importlib_metadata.version("poolrunner")


class ClaimsTokenEmbed:
    @hookimpl
    def supported_tasks(self):
        return {"token_embed"}


class ClaimsTokenClassify:
    """Claims ``token_classify`` (which the default BertModel cannot do)."""

    @hookimpl
    def supported_tasks(self):
        return {"token_classify"}


class CountsRequests:
    def __init__(self) -> None:
        self.admitted: list[str] = []

    @hookimpl
    def add_request(self, state):
        self.admitted.append(state.request_id)


def names(pm: PoolrunnerPluginManager) -> list[str]:
    return [info.name for info in pm.plugin_infos()]


# ---- 0. The built-ins, pinned once ----


def test_the_builtin_plugins_are_pinned(default_runtime):
    """The one test that names every built-in, its hooks and its tasks: adding, removing or
    reordering a built-in must be noticed here. Other tests take them from ``builtin_plugins``."""
    assert BUILTIN_PLUGINS == ("core", "token_type_ids", "pixel_values", "lora", "sequence_pooling",
                               "token_pooling", "async_output")
    assert DISABLEABLE_BUILTINS == ("token_type_ids", "pixel_values", "lora", "sequence_pooling", "token_pooling",
                                    "async_output")
    pm = build_plugin_manager(load_entrypoints=False)
    assert pm.plugin_infos() == builtin_infos() == [
        PluginInfo(name="core", source="builtin", dist="poolrunner", version=POOLRUNNER_VERSION,
                   hooks=("pool", "process_output")),
        PluginInfo(name="token_type_ids", source="builtin", dist="poolrunner", version=POOLRUNNER_VERSION,
                   hooks=("add_request", "prepare_inputs", "remove_request")),
        PluginInfo(name="pixel_values", source="builtin", dist="poolrunner", version=POOLRUNNER_VERSION,
                   hooks=("add_request", "prepare_inputs", "remove_request")),
        PluginInfo(name="lora", source="builtin", dist="poolrunner", version=POOLRUNNER_VERSION,
                   hooks=("add_request", "load_adapter", "pool", "prepare_inputs", "remove_request",
                          "unload_adapter")),
        PluginInfo(name="sequence_pooling", source="builtin", dist="poolrunner",
                   version=POOLRUNNER_VERSION, hooks=("get_pooler", "supported_tasks")),
        PluginInfo(name="token_pooling", source="builtin", dist="poolrunner",
                   version=POOLRUNNER_VERSION, hooks=("get_pooler", "supported_tasks")),
        PluginInfo(name="async_output", source="builtin", dist="poolrunner",
                   version=POOLRUNNER_VERSION, hooks=("process_output",)),
    ]
    assert pooling_builtins() == ["sequence_pooling", "token_pooling"]
    model_config = default_runtime.model_config
    assert Hooks(pm).tasks_by_plugin(model_config=model_config) == {
        "sequence_pooling": {"embed", "classify"},
        "token_pooling": {"token_embed", "token_classify", "embed&token_classify"},
    }
    assert describe_pooling_builtins(model_config) == (
        f"sequence_pooling (poolrunner {POOLRUNNER_VERSION}) serves ['classify', 'embed'], "
        f"token_pooling (poolrunner {POOLRUNNER_VERSION}) serves "
        "['embed&token_classify', 'token_classify', 'token_embed']"
    )
    # Built-in poolers are defaults (trylast), called in registration order.
    impls = pm.hook.get_pooler.get_hookimpls()
    assert [(impl.plugin_name, impl.trylast) for impl in reversed(impls)] == [
        ("sequence_pooling", True), ("token_pooling", True)]
    # The async output handle answers before core's synchronous (trylast) default.
    impls = pm.hook.process_output.get_hookimpls()
    assert [(impl.plugin_name, impl.trylast) for impl in reversed(impls)] == [
        ("async_output", False), ("core", True)]


# ---- 1. One manager per runtime, none at import time ----


def test_each_build_returns_an_independent_manager():
    a, b = ClaimsTokenEmbed(), ClaimsTokenClassify()
    pm_a = build_plugin_manager(plugins=[a], load_entrypoints=False)
    pm_b = build_plugin_manager(plugins=[b], load_entrypoints=False)

    assert pm_a is not pm_b and pm_a.hook is not pm_b.hook
    assert names(pm_a) == [*BUILTIN_PLUGINS, "ClaimsTokenEmbed"]
    assert names(pm_b) == [*BUILTIN_PLUGINS, "ClaimsTokenClassify"]
    assert pm_a.get_plugin("ClaimsTokenEmbed") is a and not pm_a.is_registered(b)
    assert pm_b.get_plugin("ClaimsTokenClassify") is b and not pm_b.is_registered(a)
    # The built-in module object is shared, but each manager has its own registration of it.
    assert pm_a.get_plugin("sequence_pooling") is pm_b.get_plugin("sequence_pooling")
    model_config = None  # supported_tasks of these plugins ignores the argument
    answers_a = Hooks(pm_a).tasks_by_plugin(model_config=model_config)
    answers_b = Hooks(pm_b).tasks_by_plugin(model_config=model_config)
    assert answers_a.pop("ClaimsTokenEmbed") == {"token_embed"} and "ClaimsTokenClassify" not in answers_a
    assert answers_b.pop("ClaimsTokenClassify") == {"token_classify"} and "ClaimsTokenEmbed" not in answers_b
    builtin_answers = Hooks(build_plugin_manager(load_entrypoints=False)).tasks_by_plugin(model_config=model_config)
    assert answers_a == answers_b == builtin_answers and set(builtin_answers) == set(pooling_builtins())
    # Unregistering from one manager leaves the other untouched.
    pm_a.unregister(name="sequence_pooling")
    assert pm_b.has_plugin("sequence_pooling")


def test_two_runtimes_in_one_process_do_not_share_plugins():
    first, second = CountsRequests(), CountsRequests()
    runtime_1 = poolrunner.Runtime(plugins=[first], load_entrypoints=False, dtype="float32")
    runtime_2 = poolrunner.Runtime(plugins=[second], load_entrypoints=False, dtype="float32")

    assert runtime_1.plugin_manager is not runtime_2.plugin_manager
    assert runtime_1.plugin_manager.get_plugin("CountsRequests") is first
    assert runtime_2.plugin_manager.get_plugin("CountsRequests") is second
    runtime_1.embed(["one", "two"])
    assert (len(first.admitted), len(second.admitted)) == (2, 0)
    runtime_2.embed("three")
    assert (len(first.admitted), len(second.admitted)) == (2, 1)


def test_importing_poolrunner_builds_no_manager_and_loads_no_entry_point(fixture_distributions):
    """In a fresh interpreter with a plugin installed: import creates no manager and imports
    neither built-ins nor entry points; only build_plugin_manager() does."""
    dist = fixture_distributions["poolrunner-testplugin"]
    script = """
import gc, sys
import pluggy
import poolrunner
managers = [o for o in gc.get_objects() if isinstance(o, pluggy.PluginManager)]
assert managers == [], managers
assert "poolrunner_testplugin" not in sys.modules
assert "poolrunner.plugins.sequence_pooling" not in sys.modules
pm = poolrunner.build_plugin_manager()
assert pm.get_plugin("testplugin") is sys.modules["poolrunner_testplugin"]
assert "poolrunner.plugins.sequence_pooling" in sys.modules
print("fresh-import-ok")
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(dist.site), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "fresh-import-ok"


# ---- 2. One registration path; disabling by name ----


def test_builtins_entrypoints_and_code_plugins_share_one_registration_path(
    monkeypatch, testplugin_dist, installed_entry_points
):
    registered: list[tuple[str, str]] = []
    original = PoolrunnerPluginManager.register_plugin

    def spy(self, plugin, name, *, source, dist=None, version=None):
        registered.append((name, source))
        return original(self, plugin, name, source=source, dist=dist, version=version)

    builtins = builtin_infos()  # before the spy: it would record this build too
    monkeypatch.setattr(PoolrunnerPluginManager, "register_plugin", spy)
    extra = ClaimsTokenEmbed()
    pm = build_plugin_manager(plugins=[extra], disable=installed_entry_points)

    assert registered == [*((name, "builtin") for name in BUILTIN_PLUGINS),
                          ("testplugin", "entrypoint"), ("ClaimsTokenEmbed", "programmatic")]
    assert [info.name for info in builtins] == list(BUILTIN_PLUGINS)
    assert all((info.source, info.dist, info.version) == ("builtin", "poolrunner", POOLRUNNER_VERSION)
               for info in builtins)
    assert pm.plugin_infos() == [
        *builtins,
        PluginInfo(name="testplugin", source="entrypoint", dist="poolrunner-testplugin",
                   version="0.1.0", hooks=("get_pooler", "supported_tasks")),
        PluginInfo(name="ClaimsTokenEmbed", source="programmatic", hooks=("supported_tasks",)),
    ]


def test_builtins_are_present_without_entry_points(testplugin_dist):
    pm = build_plugin_manager(load_entrypoints=False)
    assert names(pm) == list(BUILTIN_PLUGINS)
    assert not pm.has_plugin("testplugin")
    assert "poolrunner_testplugin" not in sys.modules


@pytest.mark.parametrize("disabled", [*DISABLEABLE_BUILTINS, "ClaimsTokenEmbed"])
def test_any_plugin_can_be_disabled_by_name(disabled):
    pm = build_plugin_manager(plugins=[ClaimsTokenEmbed()], load_entrypoints=False, disable=[disabled])
    assert pm.is_blocked(disabled)
    everything = [*BUILTIN_PLUGINS, "ClaimsTokenEmbed"]
    assert names(pm) == [name for name in everything if name != disabled]  # only that one is left out


def test_disabled_entrypoint_plugin_is_never_imported(testplugin_dist, installed_entry_points):
    pm = build_plugin_manager(disable=["testplugin", *installed_entry_points])
    assert names(pm) == list(BUILTIN_PLUGINS)
    assert "poolrunner_testplugin" not in sys.modules


def test_disabling_an_unknown_name_is_a_value_error_listing_known_names():
    with pytest.raises(ValueError) as excinfo:
        build_plugin_manager(plugins=[ClaimsTokenEmbed()], load_entrypoints=False,
                             disable=["sequence_pooling", "sequence-pooling", "nope"])
    # Known: every built-in but core, and the code-passed plugin, sorted.
    assert str(excinfo.value) == (
        "cannot disable unknown plugin(s) ['nope', 'sequence-pooling']; "
        f"known plugins: {sorted([*DISABLEABLE_BUILTINS, 'ClaimsTokenEmbed'])}"
    )


def test_disabling_an_unknown_name_lists_entrypoint_plugins_too(testplugin_dist, installed_entry_points):
    with pytest.raises(ValueError, match=r"known plugins: \[.*'testplugin'") as excinfo:
        build_plugin_manager(disable=["nope", *installed_entry_points])
    assert "cannot disable unknown plugin(s) ['nope']" in str(excinfo.value)


def test_runtime_rejects_an_unknown_disabled_name():
    with pytest.raises(ValueError) as excinfo:
        poolrunner.Runtime(load_entrypoints=False, disable_plugins=["nope"], dtype="float32")
    assert str(excinfo.value) == (
        f"cannot disable unknown plugin(s) ['nope']; known plugins: {sorted(DISABLEABLE_BUILTINS)}"
    )


REMEDY = "Pick a supported task, or install a plugin that serves it (see `poolrunner plugins --all`)."


def test_runtime_without_sequence_pooling_does_not_embed(default_runtime, default_model_path):
    """sequence_pooling is the only built-in serving embed; the other pooling built-ins stay."""
    with pytest.raises(UnsupportedTaskError) as excinfo:
        poolrunner.Runtime(task="embed", load_entrypoints=False, disable_plugins=["sequence_pooling"], dtype="float32")
    assert str(excinfo.value) == (
        f"model {default_model_path!r} (BertModel) does not support task 'embed'. Supported: ['token_embed']. "
        "The model itself can do ['embed', 'token_embed']; pooling plugins: "
        f"{describe_pooling_builtins(default_runtime.model_config, without=['sequence_pooling'])}. " + REMEDY
    )


def test_runtime_without_pooling_builtins_supports_no_task(default_model_path):
    disabled = pooling_builtins()
    with pytest.raises(UnsupportedTaskError) as excinfo:
        poolrunner.Runtime(task="embed", load_entrypoints=False, disable_plugins=disabled, dtype="float32")
    assert str(excinfo.value) == (
        f"model {default_model_path!r} (BertModel) does not support task 'embed'. Supported: []. "
        "The model itself can do ['embed', 'token_embed']; pooling plugins: none. " + REMEDY
    )
    with pytest.raises(UnsupportedTaskError) as excinfo:
        poolrunner.Runtime(load_entrypoints=False, disable_plugins=disabled, dtype="float32")
    assert str(excinfo.value) == (
        f"model {default_model_path!r} (BertModel) does not support any task. Supported: []. "
        "The model itself can do ['embed', 'token_embed']; pooling plugins: none. " + REMEDY
    )


# ---- 4. Hook validation at build time ----


class MisspelledHook:
    @hookimpl
    def prepare_input(self, batch):  # the spec is prepare_inputs
        return None


class UnknownArgument:
    @hookimpl
    def prepare_inputs(self, batch, attention_mask):  # attention_mask is not a spec argument
        return None


def test_misspelled_hook_fails_the_build_naming_plugin_and_hook():
    with pytest.raises(PluginLoadError) as excinfo:
        build_plugin_manager(plugins=[MisspelledHook()], load_entrypoints=False)
    message = str(excinfo.value)
    assert message.startswith(
        "plugin MisspelledHook (programmatic) is invalid: unknown hook 'prepare_input' in plugin "
    )
    assert isinstance(excinfo.value.__cause__, pluggy.PluginValidationError)


def test_hookimpl_argument_missing_from_the_spec_fails_the_build():
    with pytest.raises(PluginLoadError) as excinfo:
        build_plugin_manager(plugins=[UnknownArgument()], load_entrypoints=False)
    message = str(excinfo.value)
    assert message.startswith("plugin UnknownArgument (programmatic) is invalid: ")
    assert "for hook 'prepare_inputs'" in message
    assert "Argument(s) {'attention_mask'} are declared in the hookimpl but can not be found in the hookspec" in message
    assert isinstance(excinfo.value.__cause__, pluggy.PluginValidationError)


def test_an_entry_point_plugin_with_a_wrong_hook_argument_is_named_by_its_distribution():
    """As ``load_entrypoints`` registers it: the message names the distribution to fix or
    disable, never "programmatic"."""
    pm = PoolrunnerPluginManager()
    with pytest.raises(PluginLoadError) as excinfo:
        pm.register_plugin(UnknownArgument(), "badarg", source="entrypoint", dist="poolrunner-badarg", version="1.0")
    assert str(excinfo.value).startswith("plugin badarg (poolrunner-badarg 1.0) is invalid: ")
    assert not pm.has_plugin("badarg") and pm.plugin_infos() == []


def test_disabling_an_invalid_plugin_lets_the_build_succeed():
    pm = build_plugin_manager(plugins=[MisspelledHook(), UnknownArgument()], load_entrypoints=False,
                              disable=["MisspelledHook", "UnknownArgument"])
    assert names(pm) == list(BUILTIN_PLUGINS)


# ---- 5. Name conflicts ----


def test_two_plugins_with_the_same_name_conflict():
    with pytest.raises(PluginConflictError) as excinfo:
        build_plugin_manager(plugins=[ClaimsTokenEmbed(), ClaimsTokenEmbed()], load_entrypoints=False)
    assert str(excinfo.value) == (
        "two plugins are named 'ClaimsTokenEmbed': ClaimsTokenEmbed (programmatic) and "
        "ClaimsTokenEmbed (programmatic); uninstall or disable one of them"
    )


def test_a_plugin_named_like_a_builtin_conflicts_with_it():
    impostor = types.ModuleType("thirdparty.sequence_pooling")
    with pytest.raises(PluginConflictError) as excinfo:
        build_plugin_manager(plugins=[impostor], load_entrypoints=False)
    assert str(excinfo.value) == (
        f"two plugins are named 'sequence_pooling': sequence_pooling (poolrunner {POOLRUNNER_VERSION}) "
        "and sequence_pooling (programmatic); uninstall or disable one of them"
    )
    # Disabling the name leaves both out; the build then succeeds.
    pm = build_plugin_manager(plugins=[impostor], load_entrypoints=False, disable=["sequence_pooling"])
    assert names(pm) == [name for name in BUILTIN_PLUGINS if name != "sequence_pooling"]
    assert not pm.is_registered(impostor)


def test_core_defaults_cannot_be_disabled():
    with pytest.raises(ValueError, match=r"^the 'core' plugin holds core's defaults and cannot be disabled$"):
        build_plugin_manager(load_entrypoints=False, disable=["core"])


def test_a_built_runtime_has_a_fixed_plugin_set(default_runtime):
    class Late:
        @poolrunner.hookimpl
        def add_request(self, state):
            raise AssertionError("must never be called")

    pm = default_runtime.plugin_manager
    with pytest.raises(RuntimeError, match="plugin set is fixed once built"):
        pm.register(Late(), "late")
    with pytest.raises(RuntimeError, match="plugin set is fixed once built"):
        pm.unregister(name="sequence_pooling")
    assert default_runtime.embed("still serving").shape == (384,)
