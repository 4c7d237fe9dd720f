"""The built-in ``token_type_ids`` plugin, hook by hook, on the default model (BERT, type_vocab_size 2).

Raw requests run through the serving loop (``tests.helpers.run_requests``) of a built-ins-only
runtime, plus a ``ModelSpy`` that hands over the loaded model. The ``log`` fixture watches its
hook calls through ``pm.add_hookcall_monitoring``; the ``forwarded`` fixture records the keyword
arguments that reach the backbone's ``forward``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import attrs
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

import poolrunner
from poolrunner.core import InputBatch, InvalidRequestError, PoolingParams, PoolingRequest, RequestState
from poolrunner.core.engine.buckets import bucket_num_tokens
from poolrunner.plugins import token_type_ids as plugin
from poolrunner.plugins.token_type_ids import NAME, compress
from tests.helpers import ModelSpy, assert_engine_empty, run_requests

EMBED = PoolingParams(task="embed")


def request(request_id: str, num_tokens: int, types: tuple[int, ...] | None = None) -> PoolingRequest:
    """``[CLS] 2000 2001 ... [SEP]`` with ``num_tokens`` tokens, and optional token types."""
    ids = [101, *range(2000, 2000 + num_tokens - 2), 102]
    return PoolingRequest(request_id=request_id, prompt_token_ids=ids, token_type_ids=types, params=EMBED)


def message(request_id: str, types: list[int]) -> str:
    return (f"request {request_id!r}: token_type_ids must be zeros followed by ones (query, then document), "
            f"got {types!r}")


@dataclass
class HookLog:
    added: dict[str, RequestState] = field(default_factory=dict)  # as add_request received them
    stored: dict[str, dict[str, Any]] = field(default_factory=dict)  # plugin_data once add_request returned
    removed: list[str] = field(default_factory=list)  # remove_request calls, in order
    prepared: list[list[Any]] = field(default_factory=list)  # the collected results of each prepare_inputs


@pytest.fixture(scope="module")
def spy() -> ModelSpy:
    return ModelSpy()


@pytest.fixture(scope="module")
def runtime(spy) -> poolrunner.Runtime:
    """The default model with the built-in plugins and the spy (which implements get_pooler alone);
    ``pixel_values`` and ``lora``, the other model-state built-ins (images, adapters), are left out
    so that this one is alone."""
    runtime = poolrunner.Runtime(plugins=[spy], load_entrypoints=False, dtype="float32",
                                 disable_plugins=["pixel_values", "lora"])
    assert runtime.model_config.type_vocab_size == 2
    impls = runtime.plugin_manager.hook.prepare_inputs.get_hookimpls()
    assert [impl.plugin_name for impl in impls] == [NAME]  # the only one
    return runtime


@pytest.fixture
def log(runtime) -> Iterator[HookLog]:
    recorded = HookLog()

    def before(hook_name, hook_impls, kwargs):
        if hook_name == "add_request":
            recorded.added[kwargs["state"].request_id] = kwargs["state"]
        elif hook_name == "remove_request":
            recorded.removed.append(kwargs["state"].request_id)

    def after(outcome, hook_name, hook_impls, kwargs):
        if hook_name == "add_request" and outcome.exception is None:
            recorded.stored[kwargs["state"].request_id] = dict(kwargs["state"].plugin_data)
        elif hook_name == "prepare_inputs":
            recorded.prepared.append(outcome.get_result())

    undo = runtime.plugin_manager.add_hookcall_monitoring(before, after)
    yield recorded
    undo()


@pytest.fixture
def forwarded(runtime, spy, monkeypatch) -> list[dict[str, Any]]:
    """The keyword arguments of every backbone forward during the test."""
    backbone = spy.model.base_model
    original = backbone.forward
    seen: list[dict[str, Any]] = []

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(backbone, "forward", spy)
    return seen


# ---- compression: one integer per request ----


@pytest.mark.parametrize(("types", "start"), [
    ((0, 0, 0, 1, 1), 3),  # zeros then ones: where the ones start
    ((0, 1), 1),
    ((0, 0, 0), 3),  # all zeros: the length
    ((0,), 1),
    ((1, 1, 1), 0),  # all ones: 0
    ((1,), 0),
])
def test_compress_gives_where_the_ones_start(types, start):
    assert compress("r", types) == start


@pytest.mark.parametrize("types", [(0, 1, 0), (1, 0), (1, 1, 0, 1), (0, 2), (0, 0, -1)])
def test_compress_rejects_anything_but_zeros_then_ones(types):
    with pytest.raises(InvalidRequestError) as excinfo:
        compress("r", types)
    assert str(excinfo.value) == message("r", list(types))


def test_compress_message_shows_at_most_120_characters_of_the_types():
    types = (0, 1, 0) + (1,) * 100
    with pytest.raises(InvalidRequestError) as excinfo:
        compress("long", types)
    shown = "[0, 1, 0, " + "1, " * 36 + "1,"  # the repr, cut after 120 characters
    assert len(shown) == 120
    assert str(excinfo.value) == (
        "request 'long': token_type_ids must be zeros followed by ones (query, then document), got " + shown
    )


# ---- add_request stores the start; remove_request clears it ----


def test_add_request_stores_the_start_and_remove_request_clears_it(runtime, log):
    requests = [request("pair", 6, (0, 0, 0, 1, 1, 1)), request("zeros", 4, (0,) * 4),
                request("ones", 5, (1,) * 5), request("plain", 3)]
    outputs = run_requests(runtime, requests)

    assert sorted(outputs) == ["ones", "pair", "plain", "zeros"]
    assert all(output.shape == (384,) for output in outputs.values())
    assert log.stored == {"pair": {NAME: 3}, "zeros": {NAME: 4}, "ones": {NAME: 0}, "plain": {}}
    assert sorted(log.removed) == ["ones", "pair", "plain", "zeros"]  # each once, after finishing
    assert all(NAME not in state.plugin_data for state in log.added.values())
    assert_engine_empty(runtime)


def test_an_invalid_pattern_is_rejected_and_the_runtime_serves_on(runtime, log):
    good = request("good", 5, (0, 0, 1, 1, 1))
    before = run_requests(runtime, [good])["good"]

    with pytest.raises(InvalidRequestError) as excinfo:
        run_requests(runtime, [request("first", 4, (0, 0, 1, 1)), request("bad", 3, (0, 1, 0))])
    assert str(excinfo.value) == message("bad", [0, 1, 0])
    assert list(log.added) == ["good", "first", "bad"]
    assert "bad" not in log.stored and log.stored["first"] == {NAME: 2}
    # bad leaves when its add_request fails, first when the loop aborts what it admitted of the call.
    assert log.removed == ["good", "bad", "first"]
    assert len(log.prepared) == 1  # the first run's only step; the failed run never ran one
    assert all(NAME not in state.plugin_data for state in log.added.values())
    assert_engine_empty(runtime)

    # The same runtime serves the next request, and the same id gets the same result.
    after = run_requests(runtime, [good])["good"]
    assert log.stored["good"] == {NAME: 2}
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert_engine_empty(runtime)


# ---- prepare_inputs expands the starts for the scheduled tokens ----


def test_prepare_inputs_gives_every_token_its_type_in_a_mixed_batch(runtime, log, forwarded):
    requests = [request("pair", 6, (0, 0, 0, 1, 1, 1)), request("plain", 5), request("ones", 4, (1,) * 4),
                request("zeros", 3, (0,) * 3), request("late", 4, (0, 1, 1, 1))]
    outputs = run_requests(runtime, requests)
    assert sorted(outputs) == ["late", "ones", "pair", "plain", "zeros"]

    types = [[0, 0, 0, 1, 1, 1], [0] * 5, [1] * 4, [0] * 3, [0, 1, 1, 1]]  # packing order
    expected = torch.tensor(sum(types, []), dtype=torch.int64)
    assert len(forwarded) == 1  # one step for all five
    given = forwarded[0]["token_type_ids"]
    assert given.dtype == torch.int64 and given.device.type == runtime.device.type
    # The runner adds the batch dimension, runs the requests sorted by length (stable) and, on
    # the CPU, pads the step to a bucket with type 0.
    padded = bucket_num_tokens(22) if runtime.device.type == "cpu" else 22
    assert given.shape == (1, padded)
    by_length = torch.tensor(sum(sorted(types, key=len), []), dtype=torch.int64)
    assert torch.equal(given[0].cpu(), F.pad(by_length, (0, padded - 22)))
    # The hook's own result is that packed tensor, and it is the only one.
    (result,) = log.prepared[0]
    assert list(result) == ["token_type_ids"] and torch.equal(result["token_type_ids"].cpu(), expected)
    assert_engine_empty(runtime)


def test_prepare_inputs_returns_nothing_when_no_request_has_types(runtime, log, forwarded):
    outputs = run_requests(runtime, [request("a", 5), request("b", 7)])
    assert sorted(outputs) == ["a", "b"]
    assert log.prepared == [[]]  # no plugin returned anything
    assert len(forwarded) == 1 and "token_type_ids" not in forwarded[0]  # the model's default (zeros)
    assert log.stored == {"a": {}, "b": {}}


# ---- the types reach the model: parity with transformers ----


@pytest.fixture(scope="module")
def pair(default_model_path) -> tuple[list[int], list[int]]:
    """A (query, document) pair as BERT's tokenizer encodes it: ids and token types."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    encoded = tokenizer("How tall is the Eiffel Tower?", "The tower is 330 metres tall.")
    ids, types = encoded["input_ids"], encoded["token_type_ids"]
    start = types.index(1)
    assert 0 < start < len(types) and types == [0] * start + [1] * (len(types) - start)
    return ids, types


@pytest.fixture(scope="module")
def reference_embeddings(default_model_path, pair) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean-pooled, normalized ``AutoModel`` output with the pair's types, and with all zeros."""
    ids, types = pair
    model = AutoModel.from_pretrained(default_model_path).eval()
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        typed = model(input_ids=input_ids, token_type_ids=torch.tensor([types])).last_hidden_state[0]
        zeros = model(input_ids=input_ids, token_type_ids=torch.zeros_like(input_ids)).last_hidden_state[0]
    return F.normalize(typed.mean(0), dim=-1), F.normalize(zeros.mean(0), dim=-1)


def test_given_types_reach_the_model(runtime, pair, reference_embeddings):
    assert (runtime.model_config.pooling_type, runtime.model_config.normalize) == ("MEAN", True)
    ids, types = pair
    typed_reference, zeros_reference = reference_embeddings
    outputs = run_requests(runtime, [
        PoolingRequest(request_id="typed", prompt_token_ids=ids, token_type_ids=types, params=EMBED),
        PoolingRequest(request_id="untyped", prompt_token_ids=ids, params=EMBED),
    ])
    typed, untyped = outputs["typed"].cpu(), outputs["untyped"].cpu()
    tolerance = 1e-5 if runtime.dtype == torch.float32 else 2e-2  # half precision on CUDA
    torch.testing.assert_close(typed, typed_reference, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(untyped, zeros_reference, rtol=tolerance, atol=tolerance)
    assert not np.allclose(typed.numpy(), untyped.numpy(), atol=1e-3)  # the types changed the vector
    assert_engine_empty(runtime)


# ---- models without token types ----


def test_models_without_token_types_accept_only_type_zero(runtime):
    """The hooks called directly with the default model's config, as if it had no token types."""
    no_types = attrs.evolve(runtime.model_config, type_vocab_size=1)
    state = RequestState(request=request("paired", 4, (0, 0, 1, 1)))
    with pytest.raises(InvalidRequestError) as excinfo:
        plugin.add_request(state=state, model_config=no_types)
    assert str(excinfo.value) == (
        f"request 'paired' has token type 1, but model {no_types.name} (BertModel) embeds no token types "
        "(type_vocab_size 1)"
    )
    assert state.plugin_data == {}

    zeros = RequestState(request=request("zeros", 4, (0,) * 4))
    plugin.add_request(state=zeros, model_config=no_types)
    assert zeros.plugin_data == {NAME: 4}
    batch = InputBatch.build([zeros], [4], torch.device("cpu"))
    assert plugin.prepare_inputs(batch=batch, model_config=no_types) is None  # nothing to pass such a model
    assert torch.equal(plugin.prepare_inputs(batch=batch, model_config=runtime.model_config)["token_type_ids"],
                       torch.zeros(4, dtype=torch.int64))
    plugin.remove_request(state=zeros)
    plugin.remove_request(state=zeros)  # idempotent
    assert zeros.plugin_data == {}
