"""The conformance suite every poolrunner plugin should pass.

Subclass :class:`PoolingPluginConformance` in a test module (name the subclass ``Test...``)
and override at least the ``plugin`` and ``claimed_tasks`` fixtures::

    import pytest
    import poolrunner_myplugin
    from poolrunner.core.testing.conformance import PoolingPluginConformance

    class TestMyPlugin(PoolingPluginConformance):
        @pytest.fixture
        def plugin(self):
            return poolrunner_myplugin

        @pytest.fixture
        def claimed_tasks(self):
            return {"embed"}

The fixtures of :mod:`poolrunner.core.testing.pytest_plugin` (the ``pytest11`` plugin) must be
active, which they are wherever poolrunner is installed. Torch is imported inside the tests only.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from poolrunner.core.plugin_api.hookspec import hookimpl
from poolrunner.core.testing.pytest_plugin import entry_point_name as installed_name
from poolrunner.core.testing.pytest_plugin import make_runtime, manager_options
from poolrunner.core.testing.pytest_plugin import plugin_name as registered_name

if TYPE_CHECKING:
    from poolrunner.core.types import ModelConfig, PoolingTask

OutputSpec = tuple[tuple[int | None, ...], str] | Mapping[str, tuple[tuple[int | None, ...], str]]
"""What one request's pooled output looks like: ``(shape, dtype name)``, ``None`` in a shape
matching any size; or, for a task with named outputs, one such pair per name."""


def builtin_output_spec(task: PoolingTask, model_config: ModelConfig, num_tokens: int) -> OutputSpec:
    """The documented output of a built-in task (see ``Runtime.encode``), all float32.

    :raises NotImplementedError: for a plugin-declared task.
    """
    labels = len(model_config.labels)
    token_weights = ((None,), "float32")  # BGE-M3's: every token but a BOS and an EOS
    specs: dict[str, OutputSpec] = {
        "embed": ((model_config.embedding_size,), "float32"),
        "classify": ((labels,), "float32"),
        "token_embed": ((num_tokens, model_config.hidden_size), "float32"),
        "token_classify": token_weights if model_config.token_classify_weights else ((num_tokens, labels), "float32"),
        "embed&token_classify": {"embedding": ((model_config.hidden_size,), "float32"),
                                 "token_weights": token_weights},
    }
    if task not in specs:
        raise NotImplementedError(
            f"task {task!r} is not built in: override output_spec() to say what its outputs look like"
        )
    return specs[task]


class PoolingPluginConformance:
    """Checks that a plugin registers, validates, is installed, serves what it claims with
    well-formed outputs, takes and checks the request options it declares, keeps no per-request
    state and imports without touching an accelerator."""

    # ---- fixtures to override ----

    @pytest.fixture
    def plugin(self) -> object:
        """The plugin object: the module (or instance) carrying your ``@hookimpl`` functions."""
        raise NotImplementedError("override the `plugin` fixture to return your plugin module")

    @pytest.fixture
    def claimed_tasks(self) -> set[str]:
        """Every task your ``supported_tasks`` can answer, over all models."""
        raise NotImplementedError("override the `claimed_tasks` fixture to return the tasks you serve")

    @pytest.fixture
    def entry_point_name(self, plugin: object) -> str | None:
        """Your name in the ``poolrunner.plugins`` entry-point group (default: the installed entry
        point that loads your module); ``None`` only for poolrunner's built-ins, which are found
        by module name."""
        return installed_name(plugin) or getattr(plugin, "__name__", "?").rsplit(".", 1)[-1]

    @pytest.fixture
    def task_models(self, claimed_tasks: set[str], poolrunner_tiny_model: Callable[..., Path]) -> dict[str, Path]:
        """A model folder on which each claimed task is served (default: a tiny ``BertModel``)."""
        return dict.fromkeys(claimed_tasks, poolrunner_tiny_model())

    @pytest.fixture
    def option_values(self) -> dict[str, Any]:
        """A valid value of each request option you declare (``request_options``) whose default
        is ``None``; a request runs with each option set (default: the option's own default)."""
        return {}

    @pytest.fixture
    def sample_texts(self) -> list[str]:
        """Inputs pooled by the output checks."""
        return ["A cat sat on the mat.", "Paris is the capital of France.", "ok"]

    def output_spec(self, task: PoolingTask, model_config: ModelConfig, num_tokens: int) -> OutputSpec:
        """The expected output of one request of ``num_tokens`` tokens; override for your own tasks."""
        return builtin_output_spec(task, model_config, num_tokens)

    # ---- helpers ----

    @pytest.fixture
    def plugin_name(self, plugin: object) -> str:
        return registered_name(plugin)

    @pytest.fixture
    def plugin_hooks(self, plugin: object) -> Callable[[], Any]:
        """``make() -> Hooks`` with core's defaults and ``plugin`` alone."""

        def make() -> Any:
            from poolrunner.core.hooks import Hooks

            return Hooks.build(**manager_options([plugin]))

        return make

    # ---- checks ----

    def test_registers_and_passes_hook_validation(self, plugin: object, plugin_name: str, plugin_hooks) -> None:
        pm = plugin_hooks().manager  # pluggy validated every hookimpl signature and check_pending passed
        assert pm.get_plugin(plugin_name) is plugin
        declared = {name for name in dir(plugin) if hasattr(getattr(plugin, name), "poolrunner_impl")}
        implemented = {caller.name for caller in pm.get_hookcallers(plugin) or ()}
        assert declared, f"{plugin_name} implements no hook"
        assert implemented == declared

    def test_entry_point_resolves_to_the_plugin(self, plugin: object, entry_point_name: str | None) -> None:
        import importlib_metadata

        from poolrunner.core.manager import DEFAULT_PLUGINS, ENTRY_POINT_GROUP

        if entry_point_name is None:
            assert plugin.__name__ in DEFAULT_PLUGINS, "only built-ins may have no entry point"
            return
        found = [ep for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == entry_point_name]
        assert len(found) == 1, (
            f"expected one {ENTRY_POINT_GROUP!r} entry point named {entry_point_name!r}, found {found}; "
            "is the distribution installed (pip install -e .)?"
        )
        assert found[0].load() is plugin

    def test_serves_exactly_the_claimed_tasks(self, plugin_name: str, claimed_tasks: set[str],
                                              task_models: dict[str, Path], plugin_hooks,
                                              poolrunner_tiny_model: Callable[..., Path]) -> None:
        """An empty ``claimed_tasks`` is right for a plugin that pools nothing (model state,
        output copies): it must then answer no task for any model."""
        assert set(task_models) == set(claimed_tasks)
        hooks = plugin_hooks()
        answered: set[str] = set()
        for path in {*task_models.values(), poolrunner_tiny_model()}:
            model_config, _ = _load(path, hooks)
            answered |= hooks.tasks_by_plugin(model_config=model_config).get(plugin_name, frozenset())
        for task, path in task_models.items():
            model_config, _ = _load(path, hooks)
            tasks = hooks.tasks_by_plugin(model_config=model_config).get(plugin_name, frozenset())
            assert task in tasks, f"{plugin_name} does not claim {task!r} for {path}"
        assert answered == set(claimed_tasks)

    def test_get_pooler_answers_only_claimed_tasks(self, plugin_name: str, claimed_tasks: set[str],
                                                   task_models: dict[str, Path], plugin_hooks,
                                                   poolrunner_tiny_model: Callable[..., Path]) -> None:
        """Return ``None`` for any task your ``supported_tasks`` did not claim for that model (a
        plain tiny BertModel included), so built-ins keep serving models that are not yours."""
        from poolrunner.core.types import POOLING_TASKS

        hooks = plugin_hooks()
        for path in {*task_models.values(), poolrunner_tiny_model()}:
            model_config, model = _load(path, hooks)
            answered = hooks.tasks_by_plugin(model_config=model_config).get(plugin_name, frozenset())
            assert answered <= set(claimed_tasks)
            for task in sorted({*POOLING_TASKS, *claimed_tasks} - answered):
                pooler = hooks.get_pooler_from({plugin_name}, model_config=model_config, task=task, model=model)
                assert pooler is None, f"{plugin_name} offers a pooler for unclaimed task {task!r} on {path}"

    def test_pooled_outputs_have_the_documented_shape_and_dtype(
        self, plugin: object, claimed_tasks: set[str], task_models: dict[str, Path], sample_texts: list[str],
        poolrunner_hook_recorder, poolrunner_tiny_model: Callable[..., Path],
    ) -> None:
        """Each claimed task through a runtime with this plugin alone; a plugin that claims none
        runs beside the built-ins on ``embed`` and must leave its outputs well-formed."""
        for task in sorted(claimed_tasks) or ["embed"]:
            runtime = make_runtime([plugin], model=task_models.get(task) or poolrunner_tiny_model(), task=task,
                                   builtins=not claimed_tasks)
            recorder = poolrunner_hook_recorder(runtime)
            prompts = runtime.inputs.encode(sample_texts)
            outputs = runtime.encode([list(ids) for ids in prompts], task=task)
            poolers = {type(call.kwargs["pooler"]).__module__ for call in recorder.getcalls("pool")}
            assert poolers, "the pool hook never ran"
            package = plugin.__name__.partition(".")[0]  # the distribution's package, any module of it
            if claimed_tasks:
                assert all(module.partition(".")[0] == package for module in poolers), (
                    f"task {task!r} was pooled by classes of {sorted(poolers)}, not of the plugin's package "
                    f"{package!r}: the kit checks the plugin's own poolers")
            assert len(outputs) == len(prompts)
            for ids, output in zip(prompts, outputs, strict=True):
                _check_output(task, output, self.output_spec(task, runtime.model_config, len(ids)))

    def test_outputs_equal_those_with_every_row_computed(
        self, plugin: object, claimed_tasks: set[str], task_models: dict[str, Path], sample_texts: list[str],
        poolrunner_tiny_model: Callable[..., Path],
    ) -> None:
        """A pooler that declares ``reads_rows`` (``"first"`` or ``"last"``) is handed, in steps
        where every pooler reads the same rows, a last layer computed on those rows only (BERT-code
        and Llama-code models; the other rows zero): its outputs must equal those it gives when
        every row is computed (as when a plugin of its own implements ``pool``)."""
        for task in sorted(claimed_tasks):
            path = task_models.get(task) or poolrunner_tiny_model()
            read_rows = make_runtime([plugin], model=path, task=task)
            every_row = make_runtime([plugin, _EveryRow()], model=path, task=task)
            batch = [list(ids) for ids in read_rows.inputs.encode(sample_texts)]
            for got, expected in zip(read_rows.encode(batch, task=task), every_row.encode(batch, task=task),
                                     strict=True):
                _assert_close(task, got, expected)

    def test_declared_request_options_are_taken_and_checked(
        self, plugin: object, plugin_name: str, claimed_tasks: set[str], task_models: dict[str, Path],
        option_values: dict[str, Any], sample_texts: list[str], plugin_hooks,
    ) -> None:
        """Each option you declare is for tasks you claim; a request of its task runs with a valid
        value (well-formed output), and a value of the wrong type is refused naming your plugin."""
        from poolrunner.core import InvalidRequestError

        hooks = plugin_hooks()
        for task, path in sorted(task_models.items()):
            model_config, _ = _load(path, hooks)
            declared = [e.option for e in hooks.request_options(model_config=model_config) if e.plugin == plugin_name]
            for option in declared:
                assert option.tasks <= set(claimed_tasks), f"option {option.name!r} is for unclaimed tasks"
            mine = [option for option in declared if task in option.tasks]
            if not mine:
                continue
            runtime = make_runtime([plugin], model=path, task=task, builtins=not claimed_tasks)
            ids = list(runtime.inputs.encode(sample_texts[:1])[0])
            for option in mine:
                value = option_values.get(option.name, option.default)
                assert value is not None, f"give a valid {option.name!r} in the option_values fixture"
                [output] = runtime.encode([ids], task=task, **{option.name: value})
                _check_output(task, output, self.output_spec(task, runtime.model_config, len(ids)))
                wrong = _WRONG_TYPE[option.type]
                with pytest.raises(InvalidRequestError, match=f"option {option.name}=.* \\(plugin '{plugin_name}'\\)"):
                    runtime.encode([ids], task=task, **{option.name: wrong})

    def test_request_lifecycle_leaves_no_state(self, claimed_tasks: set[str], task_models: dict[str, Path],
                                               plugin_name: str, plugin_hooks,
                                               poolrunner_tiny_model: Callable[..., Path]) -> None:
        """add_request, prepare_inputs, process_output, then remove_request twice: nothing is left."""
        import torch

        from poolrunner.core import InputBatch, PoolingParams, PoolingRequest, RequestState

        hooks = plugin_hooks()
        pm = hooks.manager
        implemented = {caller.name for caller in pm.get_hookcallers(pm.get_plugin(plugin_name)) or ()}
        for task in sorted(claimed_tasks) or ["embed"]:
            model_config, _ = _load(task_models.get(task) or poolrunner_tiny_model(), hooks)
            types = (0, 0, 1, 1) if model_config.type_vocab_size >= 2 else None
            states = [
                RequestState(request=PoolingRequest(request_id=f"conformance-{i}", prompt_token_ids=ids,
                                                    token_type_ids=types, params=PoolingParams(task=task)))
                for i, ids in enumerate([(101, 1037, 4937, 102), (101, 2748, 2003, 102)])
            ]
            only_plugin = [plugin_name]
            for state in states:
                pm.subset_hook_caller("add_request", _others(pm, only_plugin))(state=state, model_config=model_config)
            batch = InputBatch.build(states, [state.num_tokens for state in states], torch.device("cpu"))
            if "prepare_inputs" in implemented:
                for extra in pm.subset_hook_caller("prepare_inputs", _others(pm, only_plugin))(
                        batch=batch, model_config=model_config):
                    for key, tensor in (extra or {}).items():
                        assert tensor.shape[0] == batch.num_tokens, f"prepare_inputs[{key!r}]: {tensor.shape}"
            if "process_output" in implemented:
                output = [torch.ones(3), torch.zeros(2)]
                handle = pm.subset_hook_caller("process_output", _others(pm, only_plugin))(output=output, batch=batch)
                assert [t.tolist() for t in handle.get_output()] == [t.tolist() for t in output]
                with pytest.raises(RuntimeError):
                    handle.get_output()
            for state in states:
                hooks.remove_request(state=state)
                assert plugin_name not in state.plugin_data, f"remove_request left {state.plugin_data}"
                hooks.remove_request(state=state)  # a second remove is harmless
                assert state.plugin_data == {}
        never_added = RequestState(request=PoolingRequest(request_id="never-added", prompt_token_ids=[101],
                                                          params=PoolingParams(task="embed")))
        hooks.remove_request(state=never_added)
        assert never_added.plugin_data == {}

    def test_import_initialises_no_accelerator(self, plugin: object) -> None:
        """Importing the plugin (in a fresh interpreter) must not initialise CUDA."""
        script = textwrap.dedent(f"""
            import importlib, os, torch
            before = dict(os.environ)
            def refuse(*args, **kwargs):
                raise SystemExit("importing the plugin initialised CUDA")
            torch.cuda._lazy_init = refuse
            torch.cuda.init = refuse
            importlib.import_module({plugin.__name__!r})
            assert not torch.cuda.is_initialized(), "CUDA is initialised"
            changed = sorted(k for k in set(before) | set(os.environ)
                             if "CUDA" in k and before.get(k) != os.environ.get(k))
            assert not changed, f"import changed {{changed}}"
        """)
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr


class _EveryRow:
    """A plugin of the test's own implementing ``pool`` (passing it through): the runtime then
    computes every row of the last layer (``Hooks.only_builtin("pool")``)."""

    @hookimpl(wrapper=True)
    def pool(self) -> Any:
        return (yield)


def _assert_close(task: str, got: Any, expected: Any) -> None:
    """Equal to float32 rounding (the products' row blocks differ), part by part for named outputs."""
    import numpy as np

    if isinstance(expected, Mapping):
        assert isinstance(got, Mapping) and set(got) == set(expected), (task, type(got))
        for name in expected:
            _assert_close(f"{task}[{name}]", got[name], expected[name])
        return
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64), rtol=1e-5,
                               atol=1e-5,
                               err_msg=f"task {task!r}: outputs depend on rows other than those declared (reads_rows)")


_WRONG_TYPE: dict[type, Any] = {int: "1", float: "1.0", bool: 1, str: 1}
"""A value of another type for each option type, which every declared option must refuse."""


def _others(pm: Any, keep: list[str]) -> list[object]:
    return [plugin for name, plugin in pm.list_name_plugin() if name not in keep]


_LOADED: dict[tuple[Path, tuple[str, ...]], Any] = {}


def _load(path: Path, hooks: Any) -> tuple[ModelConfig, Any]:
    """``(ModelConfig, model)`` of a folder, as a runtime with ``hooks``' plugins builds them on
    the CPU (cached per folder and plugin set)."""
    import torch

    from poolrunner.core.config import ModelOverrides
    from poolrunner.core.loading import read_model
    from poolrunner.core.model import loader

    path = Path(path)
    key = (path, tuple(sorted(name for name, _ in hooks.manager.list_name_plugin())))
    if key not in _LOADED:
        hf_config, _, model_config = read_model(path, hooks, ModelOverrides())
        _LOADED[key] = model_config, loader.load_model(path, hf_config, torch.float32, torch.device("cpu"))
    return _LOADED[key]


def _check_output(task: str, output: Any, spec: OutputSpec) -> None:
    if isinstance(spec, Mapping):
        assert isinstance(output, Mapping) and set(output) == set(spec), (task, type(output))
        for name, part in spec.items():
            _check_output(f"{task}[{name}]", output[name], part)
        return
    shape, dtype = spec
    assert str(output.dtype) == dtype, f"{task}: dtype {output.dtype}, expected {dtype}"
    assert len(output.shape) == len(shape) and all(
        want is None or got == want for got, want in zip(output.shape, shape, strict=True)
    ), f"{task}: shape {tuple(output.shape)}, expected {shape}"
