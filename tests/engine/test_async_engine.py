"""Async scheduling: results independent of the mode, the AsyncOutputHandle contract,
cancellation at every point of a request's life, and a CPU-side finished mask.

References are sentence-transformers (default model) and transformers (tiny decoder), never
poolrunner's own output.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

import poolrunner
from poolrunner.core import PoolingParams, PoolingRequest, hookimpl
from poolrunner.core.plugin_api.batch import InputBatch
from poolrunner.core.plugin_api.request import RequestState
from poolrunner.plugins.async_output.handle import AsyncOutputHandle
from tests.helpers import MIN_COSINE, cosine_rows

BUDGET = 10
ATOL = 1e-4  # fp32 hidden states of the tiny decoder, per element


def prompt(n: int, seed: int) -> list[int]:
    """``<s>`` then ``n - 1`` random ids of the tiny decoders' word vocabulary (3..999)."""
    rng = random.Random(seed)
    return [1, *(rng.randrange(3, 1000) for _ in range(n - 1))]


def token_request(request_id: str, ids: Sequence[int]) -> PoolingRequest:
    return PoolingRequest(request_id=request_id, prompt_token_ids=list(ids),
                          params=PoolingParams(task="token_embed"))


def assert_rows_close(got: Any, expected: np.ndarray, what: str) -> None:
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == expected.shape, (what, got.shape, expected.shape)
    assert np.abs(got - expected).max() <= ATOL, f"{what}: max abs deviation {np.abs(got - expected).max():.3g}"
    assert cosine_rows(got, expected).min() >= MIN_COSINE, what


def record_pipeline(monkeypatch: pytest.MonkeyPatch, engine: Any) -> list[tuple[str, int]]:
    """Wrap ``engine._launch``/``engine._collect`` (this instance only) to log ``(kind, step)``."""
    events: list[tuple[str, int]] = []
    launch, collect = engine._launch, engine._collect
    launched: list[Any] = []  # kept alive, so that no two steps share an id()

    def launching() -> Any:
        inflight = launch()
        if inflight is not None:
            launched.append(inflight)
            events.append(("launch", len(launched) - 1))
        return inflight

    def collecting(inflight: Any) -> Any:
        events.append(("collect", next(k for k, x in enumerate(launched) if x is inflight)))
        return collect(inflight)

    monkeypatch.setattr(engine, "_launch", launching)
    monkeypatch.setattr(engine, "_collect", collecting)
    return events


def overlapped(events: list[tuple[str, int]]) -> bool:
    """A step was launched before the previous step's results were collected."""
    return any(events[i:i + 3] == [("launch", k), ("launch", k + 1), ("collect", k)]
               for i in range(len(events)) for k in [events[i][1]])


def assert_every_step_collected_once_in_order(events: list[tuple[str, int]]) -> None:
    launched = [k for kind, k in events if kind == "launch"]
    collected = [k for kind, k in events if kind == "collect"]
    assert launched == list(range(len(launched)))
    assert collected == launched
    for kind, k in events:  # never collected before launched
        if kind == "collect":
            assert events.index(("launch", k)) < events.index(("collect", k))


# --------------------------------------------------------------------------- 1. mode independence


@pytest.mark.parametrize("async_mode", [True, False], ids=["async", "sync"])
def test_default_model_matches_sentence_transformers_in_both_modes(
    async_mode, task_runtime, st_model, lee_docs, monkeypatch
):
    rt = task_runtime(None, async_scheduling=async_mode, max_num_seqs=4)
    assert rt._engine.async_scheduling is async_mode
    events = record_pipeline(monkeypatch, rt._engine)
    got = rt.embed(lee_docs)
    expected = st_model.encode(lee_docs, convert_to_numpy=True)
    assert got.shape == expected.shape == (50, 384)
    assert cosine_rows(got, expected).min() >= MIN_COSINE  # in input order
    assert_every_step_collected_once_in_order(events)
    assert len([e for e in events if e[0] == "launch"]) == 13  # ceil(50 / 4) steps
    if async_mode:
        assert overlapped(events), events
    else:
        assert events == [(kind, k) for k in range(13) for kind in ("launch", "collect")]
    assert not rt._engine.requests and not rt._engine.scheduler.has_unfinished()


@pytest.mark.parametrize("async_mode", [True, False], ids=["async", "sync"])
def test_the_serving_loop_launches_ahead_when_async_scheduling_is_on(
    async_mode, task_runtime, st_model, lee_docs, monkeypatch
):
    """The server's path (Runtime.serving): with async scheduling each step is launched before the
    last one is collected, as in the offline API, and the answers stay sentence-transformers'."""
    rt = task_runtime(None, async_scheduling=async_mode, max_num_seqs=4)
    events = record_pipeline(monkeypatch, rt._engine)
    requests = rt.frontend.prepare(lee_docs[:20], rt.frontend.params("embed"))
    with rt.serving() as serving:
        outputs = asyncio.run(serving.run(requests))
    expected = st_model.encode(lee_docs[:20], convert_to_numpy=True)
    assert cosine_rows(np.stack([output.numpy() for output in outputs]), expected).min() >= MIN_COSINE
    assert_every_step_collected_once_in_order(events)
    assert overlapped(events) is async_mode, events
    assert not rt._engine.requests and not rt._engine.scheduler.has_unfinished()


def test_chunked_decoder_async_matches_transformers_per_token(
    make_decoder_folder, task_runtime, token_reference, monkeypatch
):
    folder = make_decoder_folder("llama", "model")
    ref = token_reference(folder)
    rt = task_runtime(folder, "token_embed", async_scheduling=True, max_num_batched_tokens=BUDGET)
    events = record_pipeline(monkeypatch, rt._engine)
    prompts = [prompt(55, 1), prompt(56, 2), prompt(57, 3)]
    out = rt.encode(prompts)
    for i, (ids, got) in enumerate(zip(prompts, out, strict=True)):
        assert_rows_close(got, ref.alone(ids), f"prompt {i} ({len(ids)} tokens)")
    assert_every_step_collected_once_in_order(events)
    assert len([e for e in events if e[0] == "launch"]) == 17  # ceil(168 / 10)
    assert overlapped(events), events
    assert not rt._engine.runner.kv_caches and not rt._engine.runner.partial_hidden


# --------------------------------------------------------------------------- 2. AsyncOutputHandle


CPU = torch.device("cpu")


def test_handle_can_be_read_once_only():
    handle = AsyncOutputHandle(torch.ones(2, 3), CPU)
    assert len(handle.get_output()) == 2
    with pytest.raises(RuntimeError) as info:
        handle.get_output()
    assert str(info.value) == "get_output() was already called on this handle"


def test_handle_fast_path_owns_its_storage():
    source = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    expected = source.clone()
    handle = AsyncOutputHandle(source, CPU)
    source.fill_(-1.0)  # the next step overwrites the buffer before the results are read
    rows = handle.get_output()
    assert len(rows) == 3
    for got, want in zip(rows, expected, strict=True):
        assert got.shape == (4,)
        assert torch.equal(got, want)
        assert got.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()


def test_handle_heterogeneous_outputs_keep_shapes_and_own_storage():
    ragged = [torch.randn(5, 8), torch.randn(2, 8), torch.randn(8)]
    named = [{"embedding": torch.randn(8), "token_weights": torch.randn(n)} for n in (3, 7)]
    expected_ragged = [t.clone() for t in ragged]
    expected_named = [{k: v.clone() for k, v in row.items()} for row in named]
    ragged_handle = AsyncOutputHandle(ragged, CPU)
    named_handle = AsyncOutputHandle(named, CPU)
    for t in ragged:
        t.zero_()
    for row in named:
        for t in row.values():
            t.zero_()
    got_ragged = ragged_handle.get_output()
    assert [t.shape for t in got_ragged] == [(5, 8), (2, 8), (8,)]
    assert all(torch.equal(g, e) for g, e in zip(got_ragged, expected_ragged, strict=True))
    got_named = named_handle.get_output()
    assert len(got_named) == 2
    for got, want in zip(got_named, expected_named, strict=True):
        assert set(got) == {"embedding", "token_weights"}
        for name in want:
            assert got[name].shape == want[name].shape
            assert torch.equal(got[name], want[name])


def test_builtin_plugin_returns_an_async_output_handle(task_runtime):
    rt = task_runtime(None, async_scheduling=True, max_num_seqs=4)
    state = RequestState(request=PoolingRequest(request_id="h", prompt_token_ids=[101, 2000, 102],
                                                params=PoolingParams(task="embed")))
    batch = InputBatch.build([state], [3], rt.device)
    output = torch.randn(1, 384)
    handle = rt.plugin_manager.hook.process_output(output=output, batch=batch)
    assert type(handle).__name__ == "AsyncOutputHandle"
    (row,) = handle.get_output()
    assert torch.equal(row, output[0])


# --------------------------------------------------------------------------- 3. cancellation


class Recorder:
    """Logs every ``remove_request`` by request id."""

    def __init__(self) -> None:
        self.removed: list[str] = []

    @hookimpl
    def remove_request(self, state):
        self.removed.append(state.request_id)


def assert_clean(rt: Any) -> None:
    engine = rt._engine
    assert not engine.requests
    assert not engine.runner.kv_caches
    assert not engine.runner.partial_hidden
    assert not engine.scheduler.has_unfinished()
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.fixture(scope="module")
def decoder_runtimes(make_decoder_folder) -> dict[bool, tuple[Any, Recorder]]:
    folder = make_decoder_folder("llama", "model")
    out = {}
    for mode in (True, False):
        recorder = Recorder()
        rt = poolrunner.Runtime(folder, task="token_embed", dtype="float32", max_num_batched_tokens=BUDGET,
                                async_scheduling=mode, plugins=[recorder])
        out[mode] = (rt, recorder)
    return out


@pytest.mark.parametrize("async_mode", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("where", ["waiting", "mid_prefill", "finished_uncollected"])
def test_abort_leaves_nothing_behind(async_mode, where, decoder_runtimes, make_decoder_folder, token_reference):
    rt, recorder = decoder_runtimes[async_mode]
    engine = rt._engine
    ref = token_reference(make_decoder_folder("llama", "model"))
    rid = f"abort-{where}"
    recorder.removed.clear()
    if where == "waiting":
        engine.add_request(token_request(rid, prompt(20, 11)))
        assert engine.scheduler.has_unfinished()
        engine.abort_request(rid)
    elif where == "mid_prefill":
        engine.add_request(token_request(rid, prompt(57, 12)))
        if async_mode:
            inflight = engine._launch()
            assert inflight.finished == () and inflight.handle is None
        else:
            assert engine.step() == []
        assert rid in engine.runner.kv_caches and rid in engine.runner.partial_hidden
        assert engine.requests[rid].num_computed_tokens == BUDGET
        engine.abort_request(rid)
        if async_mode:
            assert engine._collect(inflight) == []
    else:
        engine.add_request(token_request(rid, prompt(7, 13)))
        if async_mode:
            inflight = engine._launch()  # finishes the request; results still on their way
            assert [s.request_id for s in inflight.finished] == [rid]
            engine.abort_request(rid)
            assert engine._collect(inflight) == []  # nothing for an aborted request
        else:
            (result,) = engine.step()  # sync: collected at once; a late abort is a no-op
            assert result[0] == rid
            assert_rows_close(result[1], ref.alone(prompt(7, 13)), rid)
            engine.abort_request(rid)
    assert_clean(rt)
    assert recorder.removed == [rid]
    engine.abort_request(rid)  # twice: harmless
    engine.abort_request("never-seen")
    assert recorder.removed == [rid]
    assert_clean(rt)

    # The same id (and another) serve normally afterwards: no stale cache under the reused id.
    prompts = {rid: prompt(33, 21), "after": prompt(12, 22)}
    got = dict(engine.run([token_request(i, p) for i, p in prompts.items()]))
    assert set(got) == set(prompts)
    for i, p in prompts.items():
        assert_rows_close(got[i], ref.alone(p), i)
    assert sorted(recorder.removed) == sorted([rid, rid, "after"])
    assert_clean(rt)


def test_abort_while_async_run_is_pipelined(decoder_runtimes, make_decoder_folder, token_reference):
    """Aborting a request from inside the ``run`` loop (between yields) drops it cleanly while
    the other requests of the call still finish correctly."""
    rt, recorder = decoder_runtimes[True]
    engine = rt._engine
    ref = token_reference(make_decoder_folder("llama", "model"))
    recorder.removed.clear()
    prompts = {"short": prompt(4, 31), "long": prompt(45, 32), "tail": prompt(9, 33)}
    got = {}
    for request_id, output in engine.run([token_request(i, p) for i, p in prompts.items()]):
        got[request_id] = output
        if request_id == "short":
            assert "long" in engine.requests  # still in prefill
            engine.abort_request("long")
    assert set(got) == {"short", "tail"}
    for i in got:
        assert_rows_close(got[i], ref.alone(prompts[i]), i)
    assert sorted(recorder.removed) == ["long", "short", "tail"]
    assert_clean(rt)


# --------------------------------------------------------------------------- 4. CPU finished mask


@pytest.mark.parametrize("async_mode", [True, False], ids=["async", "sync"])
def test_finishing_is_decided_from_lengths(async_mode, decoder_runtimes, make_decoder_folder, token_reference,
                                           monkeypatch):
    rt, _ = decoder_runtimes[async_mode]
    runner = rt._engine.runner
    ref = token_reference(make_decoder_folder("llama", "model"))
    steps: list[tuple[list[int], list[str], bool]] = []
    execute = runner.execute

    def recording(batch):
        before = [s.num_computed_tokens for s in batch.requests]
        finished, handle = execute(batch)
        steps.append((before, [s.request_id for s in finished], handle is not None))
        return finished, handle

    monkeypatch.setattr(runner, "execute", recording)
    ids = prompt(25, 41)
    (result,) = list(rt._engine.run([token_request("mask", ids)]))
    assert steps == [([0], [], False), ([10], [], False), ([20], ["mask"], True)]
    assert result[0] == "mask"
    assert_rows_close(result[1], ref.alone(ids), "mask")
    assert_clean(rt)
