"""The plugin test kit itself: registered through pytest11, cheap to load, never autouse."""

from __future__ import annotations

import subprocess
import sys

import importlib_metadata
import pytest

from poolrunner.core.testing import conformance, pytest_plugin


def test_the_kit_is_a_pytest11_plugin():
    (entry_point,) = [ep for ep in importlib_metadata.entry_points(group="pytest11") if ep.name == "poolrunner"]
    assert entry_point.load() is pytest_plugin


def test_the_kit_has_no_autouse_fixtures():
    values = [*vars(pytest_plugin).values(), *vars(conformance.PoolingPluginConformance).values()]
    markers = [value._fixture_function_marker for value in values if hasattr(value, "_fixture_function_marker")]
    assert len(markers) >= 10  # the kit's own fixtures and the suite's, all found
    assert not [marker for marker in markers if marker.autouse]


def test_importing_the_kit_imports_neither_torch_nor_transformers():
    script = ("import sys, poolrunner.core.testing.pytest_plugin, poolrunner.core.testing.conformance; "
              "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_no_poolrunner_turns_the_kit_off(tmp_path):
    (tmp_path / "test_probe.py").write_text("def test_probe(poolrunner_runtime_factory):\n    pass\n")
    on = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    off = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:poolrunner",
                          str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert on.returncode == 0, on.stdout
    assert off.returncode == 1 and "fixture 'poolrunner_runtime_factory' not found" in off.stdout


def _lying_rows_plugin(rows: str):
    """A plugin whose pooler mean-pools but declares it reads only each request's first or last row."""
    import types

    from poolrunner.core import hookimpl
    from poolrunner.plugins.sequence_pooling.embed import EmbeddingPooler
    from poolrunner.plugins.sequence_pooling.methods import mean_pool

    class RowsClaimed(EmbeddingPooler):
        reads_rows = rows

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.method = mean_pool  # whatever the folder's pooling type: every row read

    plugin = types.ModuleType(f"lying_{rows}_rows")
    plugin.supported_tasks = hookimpl(lambda: frozenset({"embed"}))
    plugin.get_pooler = hookimpl(lambda model_config, task: RowsClaimed.from_model_config(model_config)
                                 if task == "embed" else None)
    return plugin


@pytest.mark.parametrize("rows", ["first", "last"])
def test_the_kit_catches_a_pooler_that_reads_more_than_the_rows_it_declares(poolrunner_tiny_model, rows):
    suite = conformance.PoolingPluginConformance()
    check = conformance.PoolingPluginConformance.test_outputs_equal_those_with_every_row_computed
    model = poolrunner_tiny_model()
    texts = ["A cat sat on the mat.", "Paris is the capital of France.", "ok"]
    with pytest.raises(AssertionError, match=r"outputs depend on rows other than those declared \(reads_rows\)"):
        check(suite, _lying_rows_plugin(rows), {"embed"}, {"embed": model}, texts, poolrunner_tiny_model)


def test_a_pooler_declaring_other_rows_fails_the_load(poolrunner_tiny_model):
    from poolrunner.core import ModelLoadError
    from poolrunner.core.testing.pytest_plugin import make_runtime

    with pytest.raises(ModelLoadError, match=r"^the 'embed' pooler _lying_rows_plugin.<locals>.RowsClaimed declares "
                                             r"reads_rows='middle'; it must be 'all', 'first' or 'last'$"):
        make_runtime([_lying_rows_plugin("middle")], model=poolrunner_tiny_model(), task="embed")


def _split_package_plugin(pooler_module: str):
    """A plugin whose entry point is ``splitpkg.hooks`` and whose pooler class lives in ``pooler_module``."""
    import types

    from poolrunner.core import hookimpl
    from poolrunner.plugins.sequence_pooling.embed import EmbeddingPooler

    pooler_class = type("SplitPooler", (EmbeddingPooler,), {"__module__": pooler_module})
    plugin = types.ModuleType("splitpkg.hooks")
    plugin.supported_tasks = hookimpl(lambda: frozenset({"embed"}))
    plugin.get_pooler = hookimpl(lambda model_config, task: pooler_class.from_model_config(model_config)
                                 if task == "embed" else None)
    return plugin


def test_the_kit_takes_a_pooler_from_another_module_of_the_plugins_package(poolrunner_tiny_model,
                                                                          poolrunner_hook_recorder):
    suite = conformance.PoolingPluginConformance()
    check = conformance.PoolingPluginConformance.test_pooled_outputs_have_the_documented_shape_and_dtype
    model, texts = poolrunner_tiny_model(), ["A cat sat on the mat.", "ok"]
    check(suite, _split_package_plugin("splitpkg.pooler"), {"embed"}, {"embed": model}, texts,
          poolrunner_hook_recorder, poolrunner_tiny_model)
    with pytest.raises(AssertionError, match=r"^task 'embed' was pooled by classes of \['otherpkg.pooler'\], not of "
                                             r"the plugin's package 'splitpkg': the kit checks the plugin's own"):
        check(suite, _split_package_plugin("otherpkg.pooler"), {"embed"}, {"embed": model}, texts,
              poolrunner_hook_recorder, poolrunner_tiny_model)
