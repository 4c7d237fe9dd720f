"""Plugin request options (the ``request_options`` hook): declared once, taken by the Python API
and ``/pooling``, checked, defaults filled in, read by the pooler from ``extra_kwargs``.

A code-passed plugin declares the task ``head_mean``: the mean of a prompt's first ``first``
hidden states (all when unset), times ``scale`` (default 1.0). References come from transformers
on the same weights (``hf_hidden``).
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

import poolrunner
from poolrunner.core import (
    InvalidRequestError,
    ModelConfig,
    PluginConflictError,
    Pooler,
    PoolingMetadata,
    PoolingParams,
    RequestOption,
    hookimpl,
)
from poolrunner.core.server import create_app
from poolrunner.core.testing.server import ServerThread

TASK = "head_mean"
TEXTS = ["A cat sat on the mat.", "Paris is the capital and largest city of France."]


def _positive(value: float) -> str | None:
    return None if value > 0 else "must be greater than 0"


FIRST = RequestOption(name="first", type=int, tasks={TASK}, check=lambda v: None if v >= 1 else "must be at least 1",
                      help="Average only the first N tokens.")
SCALE = RequestOption(name="scale", type=float, tasks={TASK}, default=1.0, check=_positive,
                      help="Multiply the mean by this factor.")


class HeadMeanPooler(Pooler):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict] = []

    def get_supported_tasks(self) -> frozenset[str]:
        return frozenset({TASK})

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
        outputs = []
        rows = torch.split(hidden_states, metadata.prompt_lens.tolist())
        for request_rows, params in zip(rows, metadata.pooling_params, strict=True):
            options = dict(params.extra_kwargs)
            self.seen.append(options)
            outputs.append(request_rows[: options.get("first")].float().mean(0) * options["scale"])
        return outputs


class HeadMean:
    def __init__(self) -> None:
        self.pooler = HeadMeanPooler()

    @hookimpl
    def supported_tasks(self) -> frozenset[str]:
        return frozenset({TASK})

    @hookimpl
    def request_options(self, model_config: ModelConfig) -> list[RequestOption]:
        return [FIRST, SCALE]

    @hookimpl
    def get_pooler(self, task: str) -> Pooler | None:
        return self.pooler if task == TASK else None


@pytest.fixture(scope="module")
def head_mean():
    plugin = HeadMean()
    return plugin, poolrunner.Runtime(plugins=[plugin], load_entrypoints=False, dtype="float32")


def reference(hf_hidden, ids: list[int], first: int | None = None, scale: float = 1.0) -> np.ndarray:
    states, _ = hf_hidden([ids])
    return (states[0, : first or len(ids)].mean(0) * scale).numpy()


def test_hook_request_options(head_mean, hf_hidden):
    plugin, runtime = head_mean
    assert {"embed", TASK} <= runtime.supported_tasks  # the plugin task beside the built-in ones
    ids = list(runtime.inputs.encode([TEXTS[1]])[0])
    plugin.pooler.seen.clear()
    [scaled], [plain] = runtime.encode(TEXTS[1], task=TASK, first=3, scale=0.5), runtime.encode(TEXTS[1], task=TASK)
    assert plugin.pooler.seen == [{"first": 3, "scale": 0.5}, {"scale": 1.0}]  # the default filled in
    np.testing.assert_allclose(scaled, reference(hf_hidden, ids, first=3, scale=0.5), atol=1e-5)
    np.testing.assert_allclose(plain, reference(hf_hidden, ids), atol=1e-5)
    assert runtime.frontend.params("embed").extra_kwargs is None  # embed takes no plugin option


def test_none_is_an_option_left_out(head_mean, hf_hidden):
    plugin, runtime = head_mean
    plugin.pooler.seen.clear()
    [output] = runtime.encode(TEXTS[0], task=TASK, first=None, scale=None)
    assert plugin.pooler.seen == [{"scale": 1.0}]  # as if neither were given: the default fills in
    np.testing.assert_allclose(output, reference(hf_hidden, list(runtime.inputs.encode([TEXTS[0]])[0])), atol=1e-5)


def test_an_int_is_taken_for_a_float_option(head_mean, hf_hidden):
    _, runtime = head_mean
    ids = list(runtime.inputs.encode([TEXTS[0]])[0])
    [output] = runtime.encode(TEXTS[0], task=TASK, scale=2)
    np.testing.assert_allclose(output, reference(hf_hidden, ids, scale=2.0), atol=1e-5)


@pytest.mark.parametrize(("options", "message"), [
    ({"first": 0}, "option first=0 (plugin 'HeadMean') must be at least 1"),
    ({"first": 2.0}, "option first=2.0 (plugin 'HeadMean') must be an integer"),
    ({"first": True}, "option first=True (plugin 'HeadMean') must be an integer"),
    ({"scale": -1.0}, "option scale=-1.0 (plugin 'HeadMean') must be greater than 0"),
    ({"scale": "2"}, "option scale='2' (plugin 'HeadMean') must be a number"),
    ({"firsts": 2}, "unknown option 'firsts' for task 'head_mean'; it takes ['first', 'scale']"),
])
def test_a_bad_option_is_refused_and_the_runtime_still_serves(head_mean, hf_hidden, options, message):
    _, runtime = head_mean
    with pytest.raises(InvalidRequestError) as caught:
        runtime.encode(TEXTS, task=TASK, **options)
    assert str(caught.value) == message
    [output] = runtime.encode(TEXTS[0], task=TASK, first=2)
    np.testing.assert_allclose(output, reference(hf_hidden, list(runtime.inputs.encode([TEXTS[0]])[0]), first=2),
                               atol=1e-5)


def test_an_option_of_another_task_is_refused(head_mean):
    _, runtime = head_mean
    with pytest.raises(InvalidRequestError) as caught:
        runtime.encode(TEXTS[0], task="embed", scale=2.0)
    assert str(caught.value) == "option 'scale' (plugin 'HeadMean') applies to tasks ['head_mean'], not 'embed'"
    with pytest.raises(InvalidRequestError) as caught:
        runtime.encode(TEXTS[0], task="embed", scales=2.0)
    assert str(caught.value) == "unknown option 'scales' for task 'embed'; it takes no plugin options"


def test_pooling_takes_options_as_body_fields_equal_to_the_api(head_mean):
    _, runtime = head_mean
    expected = runtime.encode(TEXTS, task=TASK, first=4, scale=3.0)
    with ServerThread(runtime) as server:
        answer = httpx.post(f"{server.url}/pooling", json={"input": TEXTS, "task": TASK, "first": 4, "scale": 3.0})
        assert answer.status_code == 200, answer.text
        for item, want in zip(answer.json()["data"], expected, strict=True):
            np.testing.assert_array_equal(np.array(item["data"], dtype=np.float32), want)
        refused = httpx.post(f"{server.url}/pooling", json={"input": TEXTS, "task": TASK, "scale": 0})
        assert refused.status_code == 400
        assert refused.json()["error"]["message"] == "option scale=0 (plugin 'HeadMean') must be greater than 0"
        mistyped = httpx.post(f"{server.url}/pooling", json={"input": TEXTS, "task": TASK, "first": "4"})
        assert mistyped.status_code == 400
        assert mistyped.json()["error"]["message"] == "option first='4' (plugin 'HeadMean') must be an integer"
        assert mistyped.json()["error"]["param"] == "first"
        schema = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]["PoolingHttpRequest"]
        assert schema["properties"]["scale"]["description"] == (
            "Multiply the mean by this factor. Plugin 'HeadMean'; tasks ['head_mean']; default 1.0.")
        again = httpx.post(f"{server.url}/pooling", json={"input": TEXTS, "task": TASK, "first": 4, "scale": 3.0})
        np.testing.assert_array_equal(np.array(again.json()["data"][0]["data"], dtype=np.float32), expected[0])


def test_every_option_body_shows_the_options_in_its_app_only(head_mean, runtime):
    """/pooling's, /score's and the rerank routes' bodies have a field per option of the app's models;
    another app of the same process, whose model declares none, shows none."""
    def body_schemas(app) -> dict[str, dict]:
        spec = app.openapi()
        refs = {path: spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                for path in ("/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")}
        return {path: spec["components"]["schemas"][ref.rsplit("/", 1)[1]] for path, ref in refs.items()}

    for path, schema in body_schemas(create_app(head_mean[1])).items():
        assert {"first", "scale"} <= schema["properties"].keys(), path
        assert schema["properties"]["first"]["type"] == "integer"
    for path, schema in body_schemas(create_app(runtime)).items():
        assert not {"first", "scale"} & schema["properties"].keys(), path


def test_two_plugins_declaring_one_name_fail_the_load():
    class Other:
        @hookimpl
        def request_options(self) -> list[RequestOption]:
            return [RequestOption(name="scale", type=float, tasks={"embed"}, help="Another scale.")]

    with pytest.raises(PluginConflictError) as caught:
        poolrunner.Runtime(plugins=[HeadMean(), Other()], load_entrypoints=False, dtype="float32")
    assert str(caught.value) == (
        "plugins 'HeadMean' and 'Other' both declare the request option 'scale'; disable one of them")


@pytest.mark.parametrize(("fields", "message"), [
    ({"name": "dimensions"}, "request option 'dimensions' would shadow a core request field"),
    ({"name": "Top-K"}, "a request option's name must be a lowercase identifier (at most 64 characters), "
                        "got 'Top-K'"),
    ({"default": 0}, "request option 'first': its default 0 must be at least 1"),
    ({"default": "3"}, "request option 'first': its default '3' must be an integer"),
])
def test_a_bad_declaration_is_refused(fields, message):
    declaration = {"name": "first", "type": int, "tasks": {TASK}, "help": "h",
                   "check": lambda v: None if v >= 1 else "must be at least 1", **fields}
    with pytest.raises(ValueError) as caught:
        RequestOption(**declaration)
    assert str(caught.value).startswith(message)


def test_extra_kwargs_are_read_only_and_out_of_given():
    params = PoolingParams(task=TASK, extra_kwargs={"scale": 2.0})
    with pytest.raises(TypeError):
        params.extra_kwargs["scale"] = 3.0  # type: ignore[index]
    assert params.given() == frozenset() and hash(params) == hash(PoolingParams(task=TASK, extra_kwargs={"s": 1}))
