"""Meta-tests: the hook specs stay documented and tested, and the import contracts hold."""

from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from poolrunner.core.hooks import Hooks
from poolrunner.core.plugin_api import hookspec

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"

SPECS = {
    name: function
    for name, function in vars(hookspec).items()
    if inspect.isfunction(function) and hasattr(function, f"{hookspec.PROJECT_NAME}_spec")
}
FIRSTRESULT = {"get_pooler", "pool", "process_output", "score_outputs", "load_adapter", "unload_adapter"}


def test_the_spec_module_declares_the_documented_hooks():
    assert set(SPECS) == {"claim_model_folder", "supported_tasks", "get_pooler", "request_options", "add_request",
                          "remove_request",
                          "prepare_inputs", "pool", "process_output", "score_outputs", "load_adapter",
                          "unload_adapter"}
    for name, function in SPECS.items():
        options = getattr(function, f"{hookspec.PROJECT_NAME}_spec")
        assert options["firstresult"] is (name in FIRSTRESULT), name
        assert options["historic"] is False, name  # request and step hooks are never historic


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_spec_is_fully_documented(name):
    function = SPECS[name]
    doc = inspect.getdoc(function)
    assert doc, f"hook {name} has no docstring"
    for argument in inspect.signature(function).parameters:
        assert re.search(rf"^:param {argument}: \S", doc, re.MULTILINE), f"{name}: no ':param {argument}:'"
    documented = set(re.findall(r"^:param (\w+):", doc, re.MULTILINE))
    assert documented == set(inspect.signature(function).parameters), f"{name}: stale :param entries"
    assert re.search(r"^:returns: \S", doc, re.MULTILINE), f"{name}: no ':returns:'"
    assert re.search(r"^\.\. versionadded:: \d+\.\d+", doc, re.MULTILINE), f"{name}: no '.. versionadded::'"
    assert inspect.signature(function).return_annotation is not inspect.Signature.empty, name


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_spec_has_a_keyword_only_facade_method(name):
    method = getattr(Hooks, name)
    parameters = list(inspect.signature(method).parameters.values())[1:]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters), name
    assert [p.name for p in parameters] == list(inspect.signature(SPECS[name]).parameters), name


def test_every_hook_has_a_test_hook_function():
    defined = set()
    for path in TESTS.rglob("*.py"):
        if "fixtures" in path.relative_to(TESTS).parts:
            continue
        defined |= set(re.findall(r"^\s*(?:async\s+)?def test_hook_(\w+)\(", path.read_text(), re.MULTILINE))
    missing = sorted(set(SPECS) - defined)
    assert not missing, f"no test_hook_<name> function in tests/ for: {missing}"


# ---- 9. import-linter contracts ----


def _conventional_layout(root: Path) -> Path:
    """Copy the sources into the layout the import package has once installed.

    The repository maps core/_root, core/ and plugins/ onto poolrunner, poolrunner.core and
    poolrunner.plugins (setuptools package-dir); grimp finds a package's modules by walking its
    directory, so run against a copy where the folders nest as the packages do.
    """
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    package = root / "poolrunner"
    shutil.copytree(REPO / "core" / "_root", package, ignore=ignore)
    shutil.copytree(REPO / "core", package / "core", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "_root"))
    shutil.copytree(REPO / "plugins", package / "plugins", ignore=ignore)
    return root


def _lint_imports(pythonpath: Path) -> subprocess.CompletedProcess[str]:
    executable = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run(
        [str(executable), "--no-cache", "--no-logo", "pyproject.toml"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )


def test_import_linter_contracts_are_kept(tmp_path):
    result = _lint_imports(_conventional_layout(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    kept = re.search(r"Contracts: (\d+) kept, 0 broken\.", result.stdout)
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert kept and int(kept.group(1)) == len(declared) >= 7, result.stdout


def test_import_linter_catches_a_plugin_importing_core_internals(tmp_path):
    """The contract is not vacuous: a direct import of the engine from a built-in breaks it."""
    root = _conventional_layout(tmp_path)
    module = root / "poolrunner" / "plugins" / "sequence_pooling" / "__init__.py"
    module.write_text(module.read_text() + "\nimport poolrunner.core.engine.engine  # noqa\n")
    result = _lint_imports(root)
    assert result.returncode == 1
    assert "built-in plugins use only the public poolrunner.core API BROKEN" in result.stdout
    assert "poolrunner.plugins.sequence_pooling -> poolrunner.core.engine.engine" in result.stdout


@pytest.mark.parametrize(("module", "contract"), [
    ("core/server/app.py", "the engine is private: only the load sequence and the runtime import it BROKEN"),
    ("core/plugin_api/hookspec.py",
     "the plugin API (hook specs, per-step objects) never reaches into the engine BROKEN"),
    ("core/kernels/attention.py",
     "the kernels never import the engine, the runtime, the server or the CLI BROKEN"),
])
def test_import_linter_keeps_the_engine_private(tmp_path, module, contract):
    """Only the load sequence and the runtime import the engine; the plugin API and the kernels never do."""
    root = _conventional_layout(tmp_path)
    path = root / "poolrunner" / module
    path.write_text(path.read_text() + "\nimport poolrunner.core.engine.scheduler  # noqa\n")
    result = _lint_imports(root)
    assert result.returncode == 1
    assert contract in result.stdout


def test_every_package_folder_is_in_the_distribution():
    """A wheel holds only the packages pyproject lists: a new folder must be listed there."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    roots = {"core/_root": "poolrunner", "core": "poolrunner.core", "plugins": "poolrunner.plugins"}
    found = set()
    for folder, package in roots.items():
        for init in (REPO / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO / folder)
            if folder == "core" and relative.parts[:1] == ("_root",):
                continue
            found.add(".".join([package, *relative.parts]))
    assert found == listed
