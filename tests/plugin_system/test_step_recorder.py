"""The test kit's step recorder, against schedules known in advance: a causal model's prompts cut
into budget-size windows (first come, first served), an encoder's over-budget prompt run whole."""

from __future__ import annotations

import asyncio

import pytest

import poolrunner
from poolrunner import InvalidRequestError, PoolingParams, PoolingRequest
from poolrunner.core.testing.steps import Chunk, record_steps

BUDGET = 10


@pytest.fixture(scope="module")
def chunked(make_decoder_folder):
    return poolrunner.Runtime(make_decoder_folder("llama"), dtype="float32", load_entrypoints=False,
                              max_num_batched_tokens=BUDGET)


def test_a_causal_models_prompts_run_in_budget_windows(chunked):
    with record_steps(chunked) as log:
        chunked.embed([list(range(3, 15)), list(range(20, 25)), list(range(30, 38))])  # 12, 5 and 8 tokens
    first, second, third = log.admitted
    assert [step.request_ids for step in log.steps] == [(first,), (first, second, third), (third,)]
    assert [step.num_scheduled_tokens for step in log.steps] == [(10,), (2, 5, 3), (5,)]
    assert log.steps[1].chunks == (Chunk(first, "embed", 10, 12, True), Chunk(second, "embed", 0, 5, True),
                                   Chunk(third, "embed", 0, 3, False))
    assert [(chunk.span, chunk.finished) for chunk in log.chunks(first)] == [((0, 10), False), ((10, 12), True)]
    assert [chunk.span for chunk in log.chunks(third)] == [(0, 3), (3, 8)]
    assert [step.num_tokens for step in log.steps] == [10, 10, 5]
    assert log.left == [first, second, third] and not log.in_flight


def test_an_encoders_over_budget_prompt_runs_whole_and_alone(model_path):
    encoder = poolrunner.Runtime(model_path, dtype="float32", load_entrypoints=False, max_num_batched_tokens=BUDGET)
    with record_steps(encoder) as log:
        encoder.embed([[101] + [2000] * 14 + [102], [101, 2001, 102]])
    long, short = log.admitted
    assert [step.chunks for step in log.steps] == [(Chunk(long, "embed", 0, 16, True),),
                                                   (Chunk(short, "embed", 0, 3, True),)]


def test_a_refused_request_is_seen_entering_and_leaving(chunked):
    params = PoolingParams(task="embed")
    good = PoolingRequest(request_id="good", prompt_token_ids=[3, 4, 5], params=params)
    twice = PoolingRequest(request_id="good", prompt_token_ids=[6, 7], params=params)
    with chunked.serving() as serving, record_steps(chunked) as log:
        with pytest.raises(InvalidRequestError, match="already in flight"):
            asyncio.run(serving.run([good, twice]))
    assert (log.admitted, log.left, log.steps, log.in_flight) == (["good"], ["good"], [], [])


def test_the_log_stops_at_the_end_of_the_block_and_the_fixture_records_until_the_test_ends(
        chunked, poolrunner_step_recorder):
    with record_steps(chunked) as log:
        chunked.embed([[3, 4, 5]])
    chunked.embed([[3, 4, 5]])
    assert len(log.steps) == 1
    whole_test = poolrunner_step_recorder(chunked)
    chunked.embed([[3, 4, 5], [6, 7]])
    assert [step.num_scheduled_tokens for step in whole_test.steps] == [(3, 2)]
    whole_test.clear()
    assert not whole_test.steps and not whole_test.admitted
