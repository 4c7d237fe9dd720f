"""One loaded model serves every task its head and the plugins allow, chosen per request.

Requests of different tasks share a step (one forward pass; each task's pooler pools its own
requests), and each answer equals what a runtime loaded for that task alone gives. ``task=`` at
load still restricts a runtime to one task.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from poolrunner import InvalidRequestError, Runtime
from poolrunner.core.testing.server import ServerThread
from poolrunner.core.testing.steps import record_steps
from tests.helpers import run_requests

TEXTS = ["A cat sat on the mat.", "Pooling models return vectors.", "Short", "Dogs bark at night in the park."]


@pytest.fixture(scope="module")
def multi():
    return Runtime(dtype="float32", load_entrypoints=False)


@pytest.fixture(scope="module")
def alone():
    return {task: Runtime(dtype="float32", load_entrypoints=False, task=task) for task in ("embed", "token_embed")}


def test_the_default_model_serves_embed_and_token_embed(multi, alone):
    assert (multi.task, multi.supported_tasks) == ("embed", {"embed", "token_embed"})
    assert {task: rt.supported_tasks for task, rt in alone.items()} == {
        "embed": {"embed"}, "token_embed": {"token_embed"}}


def test_tasks_share_a_step_and_equal_single_task_runtimes(multi, alone):
    requests = [
        request
        for i, text in enumerate(TEXTS)
        for request in multi.frontend.prepare([text], multi.frontend.params("embed" if i % 2 else "token_embed"))
    ]
    with record_steps(multi) as log:
        outputs = run_requests(multi, requests)
    steps = [[chunk.task for chunk in step.chunks] for step in log.steps]
    assert steps == [["token_embed", "embed", "token_embed", "embed"]]  # one step, both tasks
    for i, (text, request) in enumerate(zip(TEXTS, requests, strict=True)):
        task = request.params.task
        expected = alone[task].encode([text], task=task)[0]
        np.testing.assert_allclose(outputs[request.request_id].numpy(), expected, atol=1e-6, err_msg=f"{i} {task}")


def test_the_api_takes_the_task_per_call(multi, alone):
    np.testing.assert_allclose(multi.embed(TEXTS), alone["embed"].embed(TEXTS), atol=1e-6)
    for got, expected in zip(multi.encode(TEXTS, task="token_embed"), alone["token_embed"].encode(TEXTS),
                             strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-6)


def test_a_task_named_at_load_is_the_only_one_served(alone):
    with pytest.raises(InvalidRequestError, match=(
            r"^this runtime serves tasks \['embed'\], not 'token_embed': it was loaded for 'embed' alone; load it "
            r"without a task to serve every task the model supports, or with task='token_embed' "
            r"\(Runtime\(\.\.\., task=\.\.\.\), --task\)$")):
        alone["embed"].encode(TEXTS, task="token_embed")
    assert alone["embed"].embed(TEXTS).shape == (4, 384)  # still serving


def test_pooling_over_http_takes_the_task(multi, alone):
    with ServerThread(multi) as server:
        tokens = httpx.post(f"{server.url}/pooling", json={"input": TEXTS, "task": "token_embed"}).json()["data"]
        vectors = httpx.post(f"{server.url}/v1/embeddings", json={"input": TEXTS}).json()["data"]
    for item, expected in zip(tokens, alone["token_embed"].encode(TEXTS), strict=True):
        np.testing.assert_allclose(np.array(item["data"], dtype=np.float32), expected, atol=1e-6)
    np.testing.assert_allclose(np.array([item["embedding"] for item in vectors], dtype=np.float32),
                               alone["embed"].embed(TEXTS), atol=1e-6)
