"""Plugins registered through a real ``poolrunner.plugins`` entry point (fixtures/ distributions)."""

from __future__ import annotations

import sys

import importlib_metadata
import numpy as np
import pluggy
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

import poolrunner
from poolrunner.core import (
    ENTRY_POINT_GROUP,
    PluginConflictError,
    PluginInfo,
    PluginLoadError,
    Pooler,
    build_plugin_manager,
)
from tests.plugin_system.builtin_plugins import BUILTIN_PLUGINS, pooling_builtins

TEXTS = ["A cat sat on the mat.", "Entry points are discovered through importlib.metadata.", "Hi"]


def entry_point(name: str) -> importlib_metadata.EntryPoint:
    (ep,) = importlib_metadata.entry_points(group=ENTRY_POINT_GROUP, name=name)
    return ep


def test_fixture_distribution_is_discovered_like_an_installed_one(fixture_distributions):
    dist = fixture_distributions["poolrunner-testplugin"]
    with dist.on_sys_path():
        ep = entry_point("testplugin")
        assert (ep.name, ep.value, ep.group) == ("testplugin", "poolrunner_testplugin", ENTRY_POINT_GROUP)
        assert (ep.dist.name, ep.dist.version) == ("poolrunner-testplugin", "0.1.0")
        assert importlib_metadata.version("poolrunner-testplugin") == "0.1.0"
        module = ep.load()
        assert module is sys.modules["poolrunner_testplugin"]
    # Leaving the fixture undoes everything: no distribution, no entry point, no module.
    assert not importlib_metadata.entry_points(group=ENTRY_POINT_GROUP, name="testplugin")
    with pytest.raises(importlib_metadata.PackageNotFoundError):
        importlib_metadata.version("poolrunner-testplugin")
    assert "poolrunner_testplugin" not in sys.modules


def test_entrypoint_plugin_is_registered_under_its_entry_point_name(testplugin_dist, installed_entry_points):
    pm = build_plugin_manager(disable=installed_entry_points)
    plugin = pm.get_plugin("testplugin")
    assert plugin is entry_point("testplugin").load() is sys.modules["poolrunner_testplugin"]
    assert pm.plugin_info("testplugin") == PluginInfo(
        name="testplugin", source="entrypoint", dist="poolrunner-testplugin", version="0.1.0",
        hooks=("get_pooler", "supported_tasks"),
    )
    # The same hooks answer through pluggy: the entry-point plugin's get_pooler is called first,
    # before every built-in one (built-in poolers are trylast defaults).
    impls = pm.hook.get_pooler.get_hookimpls()
    builtin_impls = build_plugin_manager(load_entrypoints=False).hook.get_pooler.get_hookimpls()
    assert [impl.plugin_name for impl in impls] == [*(impl.plugin_name for impl in builtin_impls), "testplugin"]
    assert all(impl.trylast for impl in impls[:-1]) and not impls[-1].trylast


# ---- 6. A third-party pooler wins over the built-in one ----


@pytest.fixture(scope="module")
def reference_cls(default_model_path) -> np.ndarray:
    """``last_hidden_state[:, 0]`` of the default model, computed with transformers alone."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModel.from_pretrained(default_model_path).eval()
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.inference_mode():
        return model(**batch).last_hidden_state[:, 0].float().numpy()


def test_entrypoint_pooler_wins_over_the_builtin(testplugin_dist, installed_entry_points, reference_cls,
                                                 default_runtime, poolrunner_hook_recorder):
    runtime = poolrunner.Runtime(disable_plugins=installed_entry_points, dtype="float32")
    calls = poolrunner_hook_recorder(runtime)
    vectors = runtime.embed(TEXTS)
    (pooler,) = {call.kwargs["pooler"] for call in calls.getcalls("pool")}  # the one that ran
    assert type(pooler).__module__ == "poolrunner_testplugin" and type(pooler).__name__ == "ClsPooler"
    assert isinstance(pooler, Pooler)

    assert vectors.shape == (3, 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(vectors, reference_cls, rtol=1e-5, atol=1e-5)
    norms = np.linalg.norm(vectors, axis=1)
    assert np.all(np.abs(norms - 1.0) > 0.5), norms  # CLS is not normalized
    # The built-in (MEAN, normalized) answers in a runtime without the plugin.
    baseline = default_runtime.embed(TEXTS)
    np.testing.assert_allclose(np.linalg.norm(baseline, axis=1), 1.0, atol=1e-5)
    assert not np.allclose(vectors, baseline, atol=1e-2)


def test_entrypoint_plugin_alone_serves_embed_without_builtin(testplugin_dist, installed_entry_points,
                                                              reference_cls):
    disabled = pooling_builtins()
    runtime = poolrunner.Runtime(disable_plugins=[*disabled, *installed_entry_points], dtype="float32")
    # core and token_type_ids stay (they pool nothing); the entry point is the only pooling plugin.
    assert [info.name for info in runtime.plugin_manager.plugin_infos()] == [
        *(name for name in BUILTIN_PLUGINS if name not in disabled), "testplugin"]
    assert [impl.plugin_name for impl in runtime.plugin_manager.hook.get_pooler.get_hookimpls()] == ["testplugin"]
    assert runtime.task == "embed"
    np.testing.assert_allclose(runtime.embed(TEXTS), reference_cls, rtol=1e-5, atol=1e-5)


def test_two_runtimes_with_and_without_the_entrypoint_plugin(testplugin_dist, installed_entry_points,
                                                             default_runtime, reference_cls):
    with_plugin = poolrunner.Runtime(disable_plugins=installed_entry_points, dtype="float32")
    without = poolrunner.Runtime(disable_plugins=["testplugin", *installed_entry_points], dtype="float32")
    assert with_plugin.plugin_manager.has_plugin("testplugin")
    assert not without.plugin_manager.has_plugin("testplugin")
    np.testing.assert_allclose(with_plugin.embed(TEXTS), reference_cls, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(without.embed(TEXTS), default_runtime.embed(TEXTS), atol=1e-6)


# ---- 3. A broken entry-point plugin ----


BROKEN_MESSAGE = (
    "plugin 'broken' (poolrunner-brokenplugin 0.2.0, entry point 'poolrunner_brokenplugin' in group "
    "'poolrunner.plugins') failed to import: ModuleNotFoundError: No module named "
    "'poolrunner_testfixture_missing_dependency'"
)


def test_broken_entrypoint_plugin_fails_the_build(brokenplugin_dist, installed_entry_points):
    with pytest.raises(PluginLoadError) as excinfo:
        build_plugin_manager(disable=installed_entry_points)
    assert str(excinfo.value) == BROKEN_MESSAGE
    assert isinstance(excinfo.value.__cause__, ModuleNotFoundError)
    with pytest.raises(PluginLoadError, match=r"^plugin 'broken' \(poolrunner-brokenplugin 0\.2\.0, "):
        poolrunner.Runtime(disable_plugins=installed_entry_points, dtype="float32")


def test_disabling_the_broken_plugin_lets_the_build_succeed(brokenplugin_dist, installed_entry_points,
                                                            default_runtime):
    pm = build_plugin_manager(disable=["broken", *installed_entry_points])
    assert [info.name for info in pm.plugin_infos()] == list(BUILTIN_PLUGINS)
    assert "poolrunner_brokenplugin" not in sys.modules  # disabled plugins are never imported
    runtime = poolrunner.Runtime(disable_plugins=["broken", *installed_entry_points], dtype="float32")
    np.testing.assert_allclose(runtime.embed("still works"), default_runtime.embed("still works"), atol=1e-6)


# ---- 4. A misspelled hook in an entry-point plugin ----


def test_misspelled_hook_in_entrypoint_plugin_names_plugin_distribution_and_hook(
    typoplugin_dist, installed_entry_points
):
    with pytest.raises(PluginLoadError) as excinfo:
        build_plugin_manager(disable=installed_entry_points)
    assert str(excinfo.value).startswith(
        "plugin typo (poolrunner-typoplugin 0.3.0) is invalid: unknown hook 'prepare_input' in plugin "
        "<module 'poolrunner_typoplugin'"
    )
    assert isinstance(excinfo.value.__cause__, pluggy.PluginValidationError)
    assert build_plugin_manager(disable=["typo", *installed_entry_points]).has_plugin("typo") is False


# ---- 5. Entry-point name conflicts ----


def test_entrypoint_plugin_and_code_plugin_with_one_name_conflict(testplugin_dist, installed_entry_points):
    class testplugin:  # noqa: N801  # registered under its class name, like the entry point
        pass

    with pytest.raises(PluginConflictError) as excinfo:
        build_plugin_manager(plugins=[testplugin()], disable=installed_entry_points)
    assert str(excinfo.value) == (
        "two plugins are named 'testplugin': testplugin (poolrunner-testplugin 0.1.0) and "
        "testplugin (programmatic); uninstall or disable one of them"
    )


def test_two_distributions_with_one_entry_point_name_conflict(testplugin_dist, installed_entry_points,
                                                              tmp_path, monkeypatch):
    """pluggy's own loader would silently skip the second; poolrunner refuses."""
    fork = tmp_path / "poolrunner_testplugin_fork-9.9.0.dist-info"
    fork.mkdir()
    (fork / "METADATA").write_text("Metadata-Version: 2.1\nName: poolrunner-testplugin-fork\nVersion: 9.9.0\n")
    (fork / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\ntestplugin = poolrunner_testplugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert len(importlib_metadata.entry_points(group=ENTRY_POINT_GROUP, name="testplugin")) == 2

    with pytest.raises(PluginConflictError) as excinfo:
        build_plugin_manager(disable=installed_entry_points)
    message = str(excinfo.value)
    assert message.startswith("two plugins are named 'testplugin': ")
    assert "testplugin (poolrunner-testplugin 0.1.0)" in message
    assert "testplugin (poolrunner-testplugin-fork 9.9.0)" in message
