"""Shared fixtures of the plugin-system tests.

The distributions under ``fixtures/`` are made visible to ``importlib_metadata`` without pip:
each gets a ``<name>-<version>.dist-info`` folder next to a copy of its package in a temporary
directory, and a test puts that directory on ``sys.path`` only while it runs. Entry-point
discovery then goes through the real ``importlib_metadata.entry_points`` path.
"""

from __future__ import annotations

import contextlib
import importlib
import shutil
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import importlib_metadata
import pytest

import poolrunner
from poolrunner.core import ENTRY_POINT_GROUP
from tests.plugin_system.builtin_plugins import BUILTIN_PLUGINS

FIXTURES = Path(__file__).parent / "fixtures"


@dataclass(frozen=True)
class FixtureDistribution:
    """A test distribution laid out as an installed one under ``site``."""

    name: str
    version: str
    module: str
    entry_point: str  # its single name in the poolrunner.plugins group
    site: Path

    @contextlib.contextmanager
    def on_sys_path(self) -> Iterator[FixtureDistribution]:
        """Make the distribution importable and discoverable, then undo it completely."""
        sys.path.insert(0, str(self.site))
        importlib.invalidate_caches()
        try:
            yield self
        finally:
            sys.path.remove(str(self.site))
            for name in [m for m in sys.modules if m == self.module or m.startswith(self.module + ".")]:
                del sys.modules[name]
            importlib.invalidate_caches()


def _materialize(source: Path, site: Path) -> FixtureDistribution:
    project = tomllib.loads((source / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    entry_points = project["entry-points"][ENTRY_POINT_GROUP]
    (entry_point, target), = entry_points.items()
    module = target.split(":")[0]
    shutil.copytree(source / "src" / module, site / module)
    dist_info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: {project['description']}\n"
    )
    (dist_info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{entry_point} = {target}\n")
    return FixtureDistribution(name=name, version=version, module=module, entry_point=entry_point, site=site)


@pytest.fixture(scope="session")
def fixture_distributions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FixtureDistribution]:
    """Every distribution under ``fixtures/``, by distribution name, each in its own site dir."""
    dists = {}
    for source in sorted(p for p in FIXTURES.iterdir() if (p / "pyproject.toml").is_file()):
        dist = _materialize(source, tmp_path_factory.mktemp(source.name))
        dists[dist.name] = dist
    assert set(dists) == {"poolrunner-testplugin", "poolrunner-brokenplugin", "poolrunner-typoplugin"}
    return dists


@pytest.fixture
def testplugin_dist(fixture_distributions: dict[str, FixtureDistribution]) -> Iterator[FixtureDistribution]:
    """``poolrunner-testplugin`` (entry point ``testplugin``): embed = unnormalized CLS."""
    with fixture_distributions["poolrunner-testplugin"].on_sys_path() as dist:
        yield dist


@pytest.fixture
def brokenplugin_dist(fixture_distributions: dict[str, FixtureDistribution]) -> Iterator[FixtureDistribution]:
    """``poolrunner-brokenplugin`` (entry point ``broken``): raises ModuleNotFoundError on import."""
    with fixture_distributions["poolrunner-brokenplugin"].on_sys_path() as dist:
        yield dist


@pytest.fixture
def typoplugin_dist(fixture_distributions: dict[str, FixtureDistribution]) -> Iterator[FixtureDistribution]:
    """``poolrunner-typoplugin`` (entry point ``typo``): implements the misspelled ``prepare_input``."""
    with fixture_distributions["poolrunner-typoplugin"].on_sys_path() as dist:
        yield dist


@pytest.fixture(scope="session")
def installed_entry_points() -> frozenset[str]:
    """Entry-point plugins installed in the environment itself (contrib plugins, say).

    Tests that load entry points disable these, so that they see only the fixture plugins.
    """
    return frozenset(ep.name for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP))


@pytest.fixture(scope="session")
def default_runtime() -> poolrunner.Runtime:
    """The default model with built-in plugins only: the baseline other runtimes compare to."""
    runtime = poolrunner.Runtime(load_entrypoints=False, dtype="float32")
    names = [info.name for info in runtime.plugin_manager.plugin_infos()]
    assert names == list(BUILTIN_PLUGINS)  # no entry point, no code-passed plugin
    return runtime


@pytest.fixture(scope="session")
def default_model_path(default_runtime: poolrunner.Runtime) -> str:
    return default_runtime.model_config.path
