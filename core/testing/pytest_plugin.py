"""poolrunner's pytest plugin: fixtures for testing poolrunner plugins.

Registered through the ``pytest11`` entry point, so it loads in every pytest run of an
environment where poolrunner is installed. It therefore defines **no autouse fixtures** and
imports torch and transformers only inside fixtures; ``pytest -p no:poolrunner`` turns it off.

Fixtures:

- ``poolrunner_tiny_model``: ``make(architecture="BertModel", **config) -> Path``, a seeded tiny
  model folder (cached per session and arguments).
- ``poolrunner_tiny_folder``: ``make(family="bert", head="model", **options) -> Path``, a seeded
  tiny folder of a model family and head (``tiny_models.tiny_model_folder``; cached likewise).
- ``poolrunner_runtime_factory``: ``make(plugins, *, model=None, builtins=False, **kwargs) ->
  Runtime``, a CPU runtime with only the given plugins (entry points are not loaded).
- ``poolrunner_hook_recorder``: ``record(runtime) -> HookRecorder``; ``.getcalls("pool")``.
- ``poolrunner_step_recorder``: ``record(runtime) -> StepLog``: which requests ran in which engine
  step, how many tokens of each, which chunk (:mod:`poolrunner.core.testing.steps`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from attrs import define, field

if TYPE_CHECKING:
    from poolrunner.core.runtime import Runtime
    from poolrunner.core.testing.steps import StepLog


@define(frozen=True)
class HookCall:
    """One recorded hook call: its name, keyword arguments and result (``None`` if it raised)."""

    name: str
    kwargs: dict[str, Any] = field(eq=False)
    result: Any = field(eq=False, default=None)


@define
class HookRecorder:
    """Hook calls of one plugin manager, in call order (like pytester's ``HookRecorder``)."""

    calls: list[HookCall] = field(factory=list)

    def getcalls(self, name: str) -> list[HookCall]:
        """The recorded calls of hook ``name``."""
        return [call for call in self.calls if call.name == name]

    def clear(self) -> None:
        self.calls.clear()


def entry_point_name(plugin: object) -> str | None:
    """The name of the installed ``poolrunner.plugins`` entry point that loads ``plugin``."""
    import importlib_metadata

    from poolrunner.core.manager import ENTRY_POINT_GROUP

    module = getattr(plugin, "__name__", None)
    return next((ep.name for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)
                 if ep.value.split(":")[0] == module), None)


def plugin_name(plugin: object) -> str:
    """The name ``plugin`` registers under: its entry point's when installed (as a runtime
    loads it), else the last part of its module name."""
    name = getattr(plugin, "__name__", None)
    if not isinstance(name, str):
        return type(plugin).__name__
    return entry_point_name(plugin) or name.rsplit(".", 1)[-1]


def builtin_names() -> list[str]:
    """The built-in plugins a runtime registers besides core's defaults."""
    from poolrunner.core.manager import DEFAULT_PLUGINS

    return [module.rsplit(".", 1)[-1] for module in DEFAULT_PLUGINS]


def manager_options(plugins: Sequence[object], *, builtins: bool = False) -> dict[str, Any]:
    """Keyword arguments of ``build_plugin_manager`` (and ``Runtime``) that register ``plugins``
    and, unless ``builtins``, no other built-in.

    An installed plugin is loaded through its entry point, exactly as in production, and every
    other entry point is left out; a built-in passed in ``plugins`` stays the built-in it is;
    anything else is passed in code.
    """
    import importlib_metadata

    from poolrunner.core.manager import ENTRY_POINT_GROUP

    installed = {entry_point_name(plugin) for plugin in plugins} - {None}
    builtin = set(builtin_names())
    wanted = {plugin_name(plugin) for plugin in plugins}
    others = [ep.name for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name not in installed]
    disable = (others if installed else []) + ([] if builtins else sorted(builtin - wanted))
    in_code = [plugin for plugin in plugins if plugin_name(plugin) not in builtin | installed]
    return {"plugins": in_code, "load_entrypoints": bool(installed), "disable": disable}


def make_runtime(plugins: Sequence[object], *, model: str | Path | None, builtins: bool = False,
                 **kwargs: Any) -> Runtime:
    """A CPU runtime with ``plugins`` and, unless ``builtins``, no other built-in plugin (see
    :func:`manager_options`); other installed plugins stay out. float32 unless ``dtype`` is given,
    so outputs compare exactly with a reference."""
    from poolrunner.core.config import RuntimeConfig
    from poolrunner.core.runtime import Runtime

    kwargs.setdefault("dtype", "float32")
    options = manager_options(plugins, builtins=builtins)
    config = RuntimeConfig.from_options(model, load_entrypoints=options["load_entrypoints"],
                                        disable_plugins=options["disable"], device="cpu", **kwargs)
    return Runtime.from_config(config, plugins=options["plugins"])


@pytest.fixture(scope="session")
def poolrunner_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make(architecture="BertModel", *, seed=0, **config) -> Path``: a tiny model folder.

    Folders are cached per session by their arguments; treat them as read-only.
    """
    from poolrunner.core.testing.tiny_models import write_tiny_model

    made: dict[str, Path] = {}

    def make(architecture: str = "BertModel", *, seed: int = 0, **config: Any) -> Path:
        key = json.dumps([architecture, seed, config], sort_keys=True)
        if key not in made:
            made[key] = write_tiny_model(tmp_path_factory.mktemp(architecture), architecture, seed=seed, **config)
        return made[key]

    return make


@pytest.fixture(scope="session")
def poolrunner_tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make(family="bert", head="model", *, variant="multiclass", seed=0, append_eos=False) ->
    Path``: :func:`~poolrunner.core.testing.tiny_models.tiny_model_folder` (BERT, RoBERTa,
    XLM-RoBERTa, Llama, Qwen2, Qwen3, GPT-2; ``model``, ``sequence``, ``token``, ``masked_lm``,
    ``causal_lm`` heads), whose inputs are words ``w0 .. w994``.

    Folders are cached per session by their arguments; treat them as read-only.
    """
    from poolrunner.core.testing.tiny_models import tiny_model_folder

    made: dict[str, Path] = {}

    def make(family: str = "bert", head: str = "model", **options: Any) -> Path:
        key = json.dumps([family, head, options], sort_keys=True)
        if key not in made:
            made[key] = tiny_model_folder(tmp_path_factory.mktemp(f"{family}_{head}"), family, head, **options)
        return made[key]

    return make


@pytest.fixture
def poolrunner_runtime_factory(poolrunner_tiny_model: Callable[..., Path]) -> Callable[..., Runtime]:
    """``make(plugins, *, model=None, builtins=False, **runtime_kwargs) -> Runtime``.

    ``model=None`` is a tiny random ``BertModel``; ``builtins=True`` keeps every built-in.
    """

    def make(plugins: Sequence[object] = (), *, model: str | Path | None = None, builtins: bool = False,
             **kwargs: Any) -> Runtime:
        return make_runtime(plugins, model=model or poolrunner_tiny_model(), builtins=builtins, **kwargs)

    return make


@pytest.fixture
def poolrunner_hook_recorder() -> Iterator[Callable[[Runtime], HookRecorder]]:
    """``record(runtime) -> HookRecorder``: records every hook call of that runtime until the
    test ends (``pm.add_hookcall_monitoring``)."""
    undo: list[Callable[[], None]] = []

    def record(runtime: Runtime) -> HookRecorder:
        recorder = HookRecorder()

        def before(_name: str, _impls: Any, _kwargs: dict[str, Any]) -> None:
            pass

        def after(outcome: Any, name: str, _impls: Any, kwargs: dict[str, Any]) -> None:
            result = None if outcome.exception is not None else outcome.get_result()
            recorder.calls.append(HookCall(name, dict(kwargs), result))

        undo.append(runtime.plugin_manager.add_hookcall_monitoring(before, after))
        return recorder

    yield record
    for step in reversed(undo):
        step()


@pytest.fixture
def poolrunner_step_recorder() -> Iterator[Callable[[Runtime], StepLog]]:
    """``record(runtime) -> StepLog``: records that runtime's engine steps until the test ends
    (:func:`poolrunner.core.testing.steps.record_steps`)."""
    from poolrunner.core.testing.steps import record_steps

    with contextlib.ExitStack() as stack:
        yield lambda runtime: stack.enter_context(record_steps(runtime))
