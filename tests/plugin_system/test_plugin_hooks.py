"""The request and step hooks on a real runtime (default model): calls, order, state, conflicts.

One runtime serves the module. Its plugins are switched on and off through attributes, and the
``calls`` fixture records every hook call through ``pm.add_hookcall_monitoring``; a ``ModelSpy``
hands over the pooler and the backbone the runtime loaded. Raw requests run through its serving
loop (``tests.helpers.run_requests``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import poolrunner
from poolrunner.core import (
    InvalidRequestError,
    PluginConflictError,
    PluginHookError,
    PoolingParams,
    PoolingRequest,
    hookimpl,
)
from poolrunner.core.hooks import RUNNER_INPUT_KEYS
from poolrunner.core.plugin_api.output import SyncOutputHandle
from tests.helpers import ModelSpy, assert_engine_empty, run_requests
from tests.plugin_system.builtin_plugins import builtins_implementing

TEXTS = ["first request", "the second one is a little longer", "third", "fourth request here", "fifth"]


class RejectedByPlugin(Exception):
    pass


class CountingHandle:
    """An output handle that counts ``get_output`` calls."""

    def __init__(self, output: Any) -> None:
        self.output = [row.cpu() for row in output]
        self.calls = 0

    def get_output(self) -> list[torch.Tensor]:
        self.calls += 1
        return self.output


class Recorder:
    """Keeps per-request data, sees it in prepare_inputs, and can reject, fail or take over output."""

    KEY = "Recorder"

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.reject: set[str] = set()
        self.fail_pool = False
        self.count_output = False
        self.token_type_ids: int | None = None  # return token_type_ids filled with this value
        self.data: dict[str, dict[str, Any]] = {}  # request id -> the dict put in plugin_data
        self.seen_in_prepare: list[list[Any]] = []
        self.handles: list[CountingHandle] = []
        self.removed: list[str] = []

    @hookimpl
    def add_request(self, state):
        if state.request_id in self.reject:
            raise RejectedByPlugin(f"Recorder rejects {state.request_id}")
        state.plugin_data[self.KEY] = self.data[state.request_id] = {"id": state.request_id}

    @hookimpl
    def prepare_inputs(self, batch):
        self.seen_in_prepare.append([state.plugin_data.get(self.KEY) for state in batch.requests])
        if self.token_type_ids is None:
            return None
        return {"token_type_ids": torch.full((batch.num_tokens,), self.token_type_ids, dtype=torch.int64,
                                             device=batch.device)}

    @hookimpl
    def pool(self):
        if self.fail_pool:
            raise RuntimeError("pool failed on purpose")
        return None  # not overriding: the next implementation (core's default) answers

    @hookimpl
    def process_output(self, output):
        if not self.count_output:
            return None
        handle = CountingHandle(output)
        self.handles.append(handle)
        return handle

    @hookimpl
    def remove_request(self, state):
        state.plugin_data.pop(self.KEY, None)  # idempotent
        self.removed.append(state.request_id)


class Conflicter:
    """Returns one forward input, named by ``key``, when ``key`` is set."""

    def __init__(self) -> None:
        self.key: str | None = None

    @hookimpl
    def prepare_inputs(self, batch):
        if self.key is None:
            return None
        return {self.key: torch.zeros(batch.num_tokens, dtype=torch.int64, device=batch.device)}


class Scaler:
    """A ``pool`` wrapper that multiplies whatever pooling returned."""

    def __init__(self) -> None:
        self.factor = 1.0
        self.wrapped = 0

    @hookimpl(wrapper=True)
    def pool(self):
        result = yield
        self.wrapped += 1
        return result if self.factor == 1.0 else result * self.factor


@pytest.fixture(scope="module")
def plugins() -> tuple[Recorder, Conflicter, Scaler]:
    return Recorder(), Conflicter(), Scaler()


@pytest.fixture(scope="module")
def spy() -> ModelSpy:
    return ModelSpy()


@pytest.fixture(scope="module")
def runtime(plugins, spy) -> poolrunner.Runtime:
    # max_num_seqs=2: five requests take three steps.
    return poolrunner.Runtime(plugins=[*plugins, spy], load_entrypoints=False, max_num_seqs=2, dtype="float32")


@pytest.fixture
def recorder(plugins) -> Iterator[Recorder]:
    recorder, conflicter, scaler = plugins
    recorder.reset()
    conflicter.key = None
    scaler.factor, scaler.wrapped = 1.0, 0
    yield recorder
    recorder.reset()
    conflicter.key = None
    scaler.factor = 1.0


@pytest.fixture
def calls(runtime, recorder) -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """Every hook call of ``runtime`` during the test, as ``(hook name, kwargs)``."""
    recorded: list[tuple[str, dict[str, Any]]] = []
    undo = runtime.plugin_manager.add_hookcall_monitoring(
        lambda hook_name, hook_impls, kwargs: recorded.append((hook_name, dict(kwargs))),
        lambda outcome, hook_name, hook_impls, kwargs: None,
    )
    yield recorded
    undo()


@pytest.fixture(scope="module")
def baseline(default_runtime) -> np.ndarray:
    return default_runtime.embed(TEXTS)


def kwargs_of(calls, hook: str) -> list[dict[str, Any]]:
    return [kwargs for name, kwargs in calls if name == hook]


def request(request_id: str, num_tokens: int = 5) -> PoolingRequest:
    return PoolingRequest(request_id=request_id, prompt_token_ids=[101, *range(2000, 2000 + num_tokens - 2), 102],
                          params=PoolingParams(task="embed"))


def test_runtime_with_idle_plugins_matches_the_default(runtime, recorder, baseline):
    np.testing.assert_allclose(runtime.embed(TEXTS), baseline, atol=1e-5)


# ---- one test per hook (the meta-test in test_plugin_meta.py requires them) ----


def test_hook_add_request(runtime, recorder, calls):
    runtime.embed(TEXTS)
    added = [kwargs["state"].request_id for kwargs in kwargs_of(calls, "add_request")]
    assert len(added) == 5 and len(set(added)) == 5  # once per request
    assert all(kwargs["model_config"] is runtime.model_config for kwargs in kwargs_of(calls, "add_request"))
    assert list(recorder.data) == added
    # add_request of every request runs before the first step (run() admits all first).
    first_step = next(i for i, (name, _) in enumerate(calls) if name == "prepare_inputs")
    assert all(name == "add_request" for name, _ in calls[:first_step])


def test_hook_prepare_inputs(runtime, recorder, calls, baseline):
    runtime.embed(TEXTS)
    steps = kwargs_of(calls, "prepare_inputs")
    assert len(steps) == 3  # 5 requests, at most 2 per step
    assert [kwargs["batch"].num_reqs for kwargs in steps] == [2, 2, 1]
    assert all(kwargs["model_config"] is runtime.model_config for kwargs in steps)
    # What add_request put in plugin_data is what prepare_inputs sees, per request, in order.
    for kwargs, seen in zip(steps, recorder.seen_in_prepare, strict=True):
        ids = [state.request_id for state in kwargs["batch"].requests]
        assert [data["id"] for data in seen] == ids
        assert all(data is recorder.data[i] for data, i in zip(seen, ids, strict=True))


def test_prepare_inputs_results_reach_the_model(runtime, recorder, baseline):
    recorder.token_type_ids = 0  # BERT's implicit default: same vectors
    np.testing.assert_allclose(runtime.embed(TEXTS), baseline, atol=1e-5)
    recorder.token_type_ids = 1  # segment B embeddings: different vectors
    changed = runtime.embed(TEXTS)
    assert not np.allclose(changed, baseline, atol=1e-3)
    np.testing.assert_allclose(np.linalg.norm(changed, axis=1), 1.0, atol=1e-5)


def test_hook_pool(runtime, recorder, calls, plugins, spy, baseline):
    _, _, scaler = plugins
    scaler.factor = 2.0
    vectors = runtime.embed(TEXTS)
    pools = kwargs_of(calls, "pool")
    assert len(pools) == 3 and scaler.wrapped == 3  # once per step, wrapper included
    steps = [[s.request_id for s in kwargs["batch"].requests] for kwargs in kwargs_of(calls, "prepare_inputs")]
    assert [list(kwargs["metadata"].request_ids) for kwargs in pools] == steps
    assert all(kwargs["pooler"] is spy.poolers[runtime.task] for kwargs in pools)  # the one loaded
    assert all(kwargs["hidden_states"].shape[1] == 384 for kwargs in pools)
    np.testing.assert_allclose(vectors, 2.0 * baseline, atol=1e-5)  # the wrapper changed the result


def test_hook_process_output(runtime, recorder, calls, baseline):
    recorder.count_output = True
    vectors = runtime.embed(TEXTS)
    assert len(kwargs_of(calls, "process_output")) == 3
    assert len(recorder.handles) == 3  # the plugin's handle replaced core's, every step
    assert [handle.calls for handle in recorder.handles] == [1, 1, 1]  # get_output exactly once
    np.testing.assert_allclose(vectors, baseline, atol=1e-5)


def test_core_output_handle_gives_its_output_once():
    handle = SyncOutputHandle(torch.ones(2, 3))
    assert [row.tolist() for row in handle.get_output()] == [[1.0, 1.0, 1.0]] * 2
    with pytest.raises(RuntimeError, match=r"^get_output\(\) was already called on this handle$"):
        handle.get_output()


def test_hook_remove_request(runtime, recorder, calls):
    runtime.embed(TEXTS)
    removed = [kwargs["state"].request_id for kwargs in kwargs_of(calls, "remove_request")]
    added = [kwargs["state"].request_id for kwargs in kwargs_of(calls, "add_request")]
    assert sorted(removed) == sorted(added) and len(removed) == 5  # once per request
    # Each request leaves only after the step that pooled it.
    for request_id in added:
        pooled_at = next(i for i, (name, kw) in enumerate(calls)
                         if name == "pool" and request_id in kw["metadata"].request_ids)
        removed_at = next(i for i, (name, kw) in enumerate(calls)
                          if name == "remove_request" and kw["state"].request_id == request_id)
        assert removed_at > pooled_at
    assert all(data and not kwargs["state"].plugin_data for kwargs, data in
               zip(kwargs_of(calls, "remove_request"), recorder.data.values(), strict=True))  # plugin_data cleared
    assert_engine_empty(runtime)


def test_load_time_hooks_are_not_called_per_request(runtime, recorder, calls):
    runtime.embed(TEXTS)
    assert {name for name, _ in calls} == {"add_request", "prepare_inputs", "pool", "process_output",
                                            "remove_request"}


# ---- rejected, aborted and failed requests still leave through remove_request ----


def test_request_rejected_by_a_plugin_is_removed(runtime, recorder, calls):
    recorder.reject = {"r1"}
    with pytest.raises(PluginHookError) as caught:  # named, as every exception of a plugin's that is not poolrunner's
        run_requests(runtime, [request("r0"), request("r1"), request("r2")])
    assert str(caught.value) == ("plugin Recorder (programmatic) raised in its add_request hook: RejectedByPlugin: "
                                 "Recorder rejects r1; fix it, or leave it out (disable_plugins, --disable-plugin "
                                 "Recorder)")
    assert isinstance(caught.value.__cause__, RejectedByPlugin)
    assert [kw["state"].request_id for kw in kwargs_of(calls, "add_request")] == ["r0", "r1"]
    # r1 is released when its add_request fails, r0 when the loop aborts what it admitted of the call.
    assert recorder.removed == ["r1", "r0"]
    assert kwargs_of(calls, "prepare_inputs") == [] and kwargs_of(calls, "pool") == []
    assert_engine_empty(runtime)


def test_request_refused_before_admission_never_reaches_plugins(runtime, recorder, calls):
    too_long = request("long", num_tokens=runtime.model_config.max_model_len + 1)
    with pytest.raises(InvalidRequestError, match=r"^request 'long' has 257 tokens, more than the maximum of 256"):
        run_requests(runtime, [too_long])
    assert calls == [] and recorder.removed == []
    assert_engine_empty(runtime)


def test_failed_step_removes_every_request_and_the_runtime_recovers(runtime, recorder, calls, baseline):
    recorder.fail_pool = True
    with pytest.raises(PluginHookError, match=r"^plugin Recorder \(programmatic\) raised in its pool hook: "
                                              r"RuntimeError: pool failed on purpose; "):
        runtime.embed(TEXTS)
    # The failing step's whole prompts ran again in halves down to single requests, which failed
    # on their own; the call then raised, and every request left the engine exactly once.
    assert [len(call["metadata"].request_ids) for call in kwargs_of(calls, "pool")][-1] == 1
    assert sorted(recorder.removed) == sorted(recorder.data) and len(recorder.removed) == 5
    assert_engine_empty(runtime)
    recorder.fail_pool = False
    np.testing.assert_allclose(runtime.embed(TEXTS), baseline, atol=1e-5)


# ---- 5. prepare_inputs conflicts ----


def test_two_plugins_returning_one_key_conflict_at_the_first_step(runtime, recorder, plugins, calls, baseline):
    _, conflicter, _ = plugins
    recorder.token_type_ids = 0
    conflicter.key = "token_type_ids"
    with pytest.raises(PluginConflictError) as excinfo:
        runtime.embed(TEXTS)
    # Every implementer is named, in call order: the built-ins (token_type_ids, which returned
    # nothing here: no request has types) are listed last, as they were registered first.
    builtins = builtins_implementing("prepare_inputs")
    assert "token_type_ids" in builtins
    implementers = ["Conflicter", "Recorder", *reversed(builtins)]
    assert str(excinfo.value) == (
        "prepare_inputs: two sources set the model input 'token_type_ids' (the runner sets "
        f"{sorted(RUNNER_INPUT_KEYS)}; plugins implementing this hook: {implementers}); disable one of them"
    )
    assert len(kwargs_of(calls, "prepare_inputs")) == 1 and kwargs_of(calls, "pool") == []
    assert len(recorder.removed) == 5
    assert_engine_empty(runtime)
    # Once the conflicting plugin stops returning the key, the same runtime serves again.
    conflicter.key = None
    np.testing.assert_allclose(runtime.embed(TEXTS), baseline, atol=1e-5)


def test_every_forward_input_the_runner_sets_is_reserved(runtime, recorder, plugins, spy, monkeypatch):
    """Spy on the backbone: whatever the runner passes itself, a plugin may not return."""
    _, conflicter, _ = plugins
    backbone = spy.model.base_model
    forward = backbone.forward
    passed: set[str] = set()

    def recording(**kwargs):
        passed.update(kwargs)
        return forward(**kwargs)

    monkeypatch.setattr(backbone, "forward", recording)
    runtime.embed("x")
    assert passed == RUNNER_INPUT_KEYS
    for key in sorted(passed):
        conflicter.key = key
        with pytest.raises(PluginConflictError, match=rf"^prepare_inputs: two sources set the model input '{key}' "):
            runtime.embed("x")
        assert_engine_empty(runtime)
