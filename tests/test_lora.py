"""LoRA adapters per request against PEFT, the independent reference: each adapter's outputs equal
``PeftModel.from_pretrained(base, folder)``'s (float32, 1e-4), mixed in one step with other
adapters and the base model; bad folders are refused naming the field or tensor, and the
runtime serves the next request."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from poolrunner import Runtime
from poolrunner.core import InvalidRequestError, LoraRequest, ModelLoadError, hookimpl
from poolrunner.core.frontend.requests import ClassifyRequest, EncodeRequest
from poolrunner.core.testing.steps import record_steps
from poolrunner.core.testing.tiny_models import tiny_model_folder

peft = pytest.importorskip("peft")  # the test extra installs it; a missing reference is not a pass
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer  # noqa: E402

# PEFT 0.21 reads transformers' deprecated is_gradient_checkpointing: the reference's warning, not ours.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

TEXTS = ["w1 w2 w3 w4 w5", "w7 w8", "w10 w11 w12 w13 w14 w15 w16 w17"]
ATOL = 1e-4


def make_adapter(base_folder: Path, folder: Path, config: LoraConfig, *, auto=AutoModel, seed: int = 0) -> Path:
    """A PEFT adapter of ``base_folder`` with every trainable tensor redrawn (PEFT starts B at 0,
    which would make every adapter the base model)."""
    model = get_peft_model(auto.from_pretrained(base_folder), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.requires_grad:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
                assert "lora_" in name or "modules_to_save" in name, name
    model.save_pretrained(folder)
    return folder


def peft_hidden(base_folder: Path, adapter: Path | None, texts: list[str], auto=AutoModel):
    """PEFT's (or, with no adapter, transformers') outputs for each text on its own."""
    model = auto.from_pretrained(base_folder).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    tokenizer = AutoTokenizer.from_pretrained(base_folder)
    with torch.inference_mode():
        return [model(**tokenizer(text, return_tensors="pt")) for text in texts]


def planned(task: str, texts: list[str], lora: str | None):
    """The request a runtime method builds for ``task``, run below as one engine call so that
    requests of several adapters share its steps."""
    if task == "classify":
        return ClassifyRequest.of(inputs=texts, lora=lora)
    return EncodeRequest.of(inputs=texts, task=task, lora=lora)


def run_together(runtime: Runtime, requests: list) -> list:
    """Run engine requests of several adapters as one submission to the serving loop."""
    with runtime.serving() as serving:
        return asyncio.run(serving.run(requests))


def normalized(vector: torch.Tensor) -> np.ndarray:
    return torch.nn.functional.normalize(vector, dim=-1).numpy()


ENCODER_ADAPTERS = {
    "names": LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"]),
    "regex": LoraConfig(r=8, lora_alpha=16, use_rslora=True, target_modules=r".*\.(key|dense)"),
    "all": LoraConfig(r=2, lora_alpha=4, lora_dropout=0.1, target_modules=["query", "key", "value", "dense"]),
}


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-bert")
    base = tiny_model_folder(root / "base", "bert", "model")
    adapters = {name: make_adapter(base, root / name, config, seed=i)
                for i, (name, config) in enumerate(ENCODER_ADAPTERS.items())}
    runtime = Runtime(base, dtype="float32", lora_modules=adapters, max_loras=4, max_lora_rank=8)
    return base, adapters, runtime


@pytest.mark.parametrize("name", [None, *ENCODER_ADAPTERS])
def test_encoder_adapter_equals_peft(bert, name):
    base, adapters, runtime = bert
    reference = peft_hidden(base, adapters.get(name), TEXTS)
    embeddings = runtime.embed(TEXTS, lora=name)
    tokens = runtime.encode(TEXTS, task="token_embed", lora=name)
    for i, output in enumerate(reference):
        hidden = output.last_hidden_state[0]
        np.testing.assert_allclose(embeddings[i], normalized(hidden[0]), atol=ATOL)  # CLS, normalized
        np.testing.assert_allclose(tokens[i], hidden.numpy(), atol=ATOL)
    if name is not None:  # the adapter changes the answer: the test can tell them apart
        assert not np.allclose(embeddings, runtime.embed(TEXTS), atol=1e-3)


def test_three_adapters_and_base_in_one_step(bert):
    base, adapters, runtime = bert
    names = [None, *ENCODER_ADAPTERS]
    requests = [request for name in names for request in runtime.frontend.plan(
        planned("token_embed", TEXTS, name)).requests]
    with record_steps(runtime) as log:
        outputs = run_together(runtime, requests)  # one submission: the four groups share steps
    assert [len(step.chunks) for step in log.steps] == [len(requests)]
    for k, name in enumerate(names):
        reference = peft_hidden(base, adapters.get(name), TEXTS)
        for i, output in enumerate(reference):
            np.testing.assert_allclose(outputs[k * len(TEXTS) + i].numpy(), output.last_hidden_state[0].numpy(),
                                       atol=ATOL)


def test_classify_with_modules_to_save_head(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-classify")
    base = tiny_model_folder(root / "base", "bert", "sequence")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value", "dense"], task_type="SEQ_CLS")
    adapter = make_adapter(base, root / "cls", config, auto=AutoModelForSequenceClassification)
    assert "base_model.model.classifier.weight" in load_file(adapter / "adapter_model.safetensors")
    runtime = Runtime(base, dtype="float32", lora_modules={"cls": adapter})
    mixed = runtime.frontend.plan(planned("classify", TEXTS, "cls")).requests
    mixed += runtime.frontend.plan(planned("classify", TEXTS, None)).requests
    outputs = run_together(runtime, mixed)
    for k, folder in enumerate([adapter, None]):
        reference = peft_hidden(base, folder, TEXTS, auto=AutoModelForSequenceClassification)
        for i, output in enumerate(reference):
            np.testing.assert_allclose(outputs[k * len(TEXTS) + i].numpy(), output.logits[0].softmax(-1).numpy(),
                                       atol=ATOL)
    results = runtime.classify(TEXTS, lora="cls")
    np.testing.assert_allclose([r.probs for r in results], [o.numpy() for o in outputs[:len(TEXTS)]], atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decoder_adapter_equals_peft(tmp_path_factory, family):
    root = tmp_path_factory.mktemp(f"lora-{family}")
    base = tiny_model_folder(root / "base", family, "model")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = {"a": make_adapter(base, root / "a", LoraConfig(r=4, lora_alpha=8, target_modules=targets)),
                "b": make_adapter(base, root / "b", LoraConfig(r=8, lora_alpha=8, target_modules=targets[:4]), seed=1)}
    runtime = Runtime(base, dtype="float32", lora_modules=adapters)
    requests = [request for name in ["a", None, "b"]
                for request in runtime.frontend.plan(planned("embed", TEXTS, name)).requests]
    outputs = run_together(runtime, requests)
    for k, name in enumerate(["a", None, "b"]):
        for i, output in enumerate(peft_hidden(base, adapters.get(name), TEXTS)):
            np.testing.assert_allclose(outputs[k * len(TEXTS) + i].numpy(), normalized(output.last_hidden_state[0, -1]),
                                       atol=ATOL)  # LAST, normalized


def _edit_config(folder: Path, **changes) -> Path:
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return folder


def test_bad_adapters_are_refused_and_the_runtime_serves_on(bert, tmp_path):
    base, adapters, runtime = bert
    good = make_adapter(base, tmp_path / "good", LoraConfig(r=4, lora_alpha=8, target_modules=["query"]))
    cases = {
        "dora": (make_adapter(base, tmp_path / "dora", LoraConfig(r=4, target_modules=["query"], use_dora=True)),
                 "adapter_config.json: use_dora True is not served"),
        "bias": (_edit_config(make_adapter(base, tmp_path / "bias", LoraConfig(r=4, target_modules=["query"])),
                              bias="all"), "adapter_config.json: bias 'all' is not served"),
        "rank": (make_adapter(base, tmp_path / "rank", LoraConfig(r=16, target_modules=["query"])),
                 "adapter_config.json: r 16 is above max_lora_rank 8 (--max-lora-rank)"),
        "embedding": (make_adapter(base, tmp_path / "emb", LoraConfig(r=4, target_modules=["word_embeddings"])),
                      "LoRA on an embedding layer is not served"),
        "missing": (tmp_path / "nowhere", "adapter_config.json is missing"),
    }
    shapes = tmp_path / "shapes"
    make_adapter(base, shapes, LoraConfig(r=4, target_modules=["query"]))
    tensors = load_file(shapes / "adapter_model.safetensors")
    key = "base_model.model.encoder.layer.0.attention.self.query.lora_A.weight"
    tensors[key] = torch.zeros(4, 32)
    save_file(tensors, shapes / "adapter_model.safetensors")
    cases["shapes"] = (shapes, "module 'encoder.layer.0.attention.self.query': lora_A (4, 32) and lora_B (64, 4) "
                               "do not fit the model's layer (64 -> 64)")
    for name, (folder, message) in cases.items():
        with pytest.raises(ModelLoadError, match=re.escape(message)):
            runtime.load_lora(name, folder)
        assert name not in runtime.lora_adapters
    with pytest.raises(InvalidRequestError, match="lora 'nope' is not loaded; loaded adapters"):
        runtime.embed(TEXTS, lora="nope")
    for name, message in [
        ("", "a LoRA adapter name must be a non-empty string, got ''"),
        (" ", "a LoRA adapter name must be a non-empty string, got ' '"),
        (None, "a LoRA adapter name must be a non-empty string, got None"),
        ("x\x00y", "a LoRA adapter name must be printable (no control characters), got 'x\\x00y'"),
        ("n" * 257, "a LoRA adapter name has at most 256 characters, got 257: 'nnnnn"),
    ]:
        with pytest.raises(InvalidRequestError) as caught:
            runtime.load_lora(name, good)
        assert str(caught.value).startswith(message) and caught.value.param == "lora"
    with pytest.raises(InvalidRequestError, match="lora_modules: a LoRA adapter name must be a non-empty string"):
        Runtime(base, lora_modules={" ": good})
    runtime.load_lora("good", good)  # the next adapter loads and serves
    reference = peft_hidden(base, good, TEXTS[:1])[0].last_hidden_state[0, 0]
    np.testing.assert_allclose(runtime.embed(TEXTS[0], lora="good"), normalized(reference), atol=ATOL)
    runtime.unload_lora("good")
    with pytest.raises(InvalidRequestError, match="lora 'good' is not loaded"):
        runtime.embed(TEXTS, lora="good")


def test_a_served_name_an_adapter_also_has_is_refused(bert):
    """A request's ``model`` names a served model or an adapter: one name cannot be both, nor two
    models' adapters."""
    from poolrunner.core.server.models import ServedModel, served_models

    _, _, runtime = bert
    adapter = runtime.lora_adapters[0]
    with pytest.raises(ValueError, match=re.escape(
            f"model 0 and a LoRA adapter of model 0 are both named '{adapter}': a request's model must name one of "
            "them; rename one (a model: --served-model-name, or PATH:name=NAME of --model; an adapter: NAME of "
            "--lora-modules NAME=PATH)")):
        served_models(runtime, [adapter])
    with pytest.raises(ValueError, match=f"^a LoRA adapter of model 0 and a LoRA adapter of model 1 are both named "
                                         f"'{adapter}'"):
        served_models([ServedModel(runtime, "one"), ServedModel(runtime, "two")], None)


def _peft_embeddings(base: Path, adapters: dict[str, Path], name: str | None) -> np.ndarray:
    return np.stack([normalized(out.last_hidden_state[0, 0]) for out in peft_hidden(base, adapters.get(name), TEXTS)])


def test_lru_eviction_reloads_adapters_from_their_folders(bert):
    """vLLM's ``--max-loras``: three adapters registered, two resident; a request naming the
    third loads it again from its folder in place of the least recently used, under its number."""
    base, adapters, _ = bert
    runtime = Runtime(base, dtype="float32", lora_modules=adapters, max_loras=2, max_lora_rank=8)
    registry = runtime.frontend.adapters
    assert runtime.lora_adapters == ["names", "regex", "all"]
    assert registry.resident() == ["regex", "all"]  # all three folders checked at start
    numbers = {name: registry.get(name).lora_id for name in adapters}
    expected = {name: _peft_embeddings(base, adapters, name) for name in adapters}
    for name, resident in [("names", ["all", "names"]), ("regex", ["names", "regex"]), ("all", ["regex", "all"]),
                           ("regex", ["all", "regex"]), ("names", ["regex", "names"])]:
        np.testing.assert_allclose(runtime.embed(TEXTS, lora=name), expected[name], atol=ATOL)
        assert registry.resident() == resident
    assert {name: registry.get(name).lora_id for name in adapters} == numbers  # reloaded under its number
    runtime.unload_lora("all")
    runtime.load_lora("all", adapters["all"])
    assert registry.get("all").lora_id > max(numbers.values())  # a new registration: a new number


def test_eviction_never_drops_an_adapter_in_flight(bert, tmp_path):
    """An adapter with requests in flight is never the one evicted; when every resident adapter
    has some, a request needing another waits for a slot, first come first served: a later caller
    of a resident adapter waits behind it (vLLM's scheduler queues them so; no starvation).
    Loading an adapter at run time then checks its folder and leaves it out of the model until a
    request names it (vLLM's load answers at once too)."""
    import concurrent.futures

    base, adapters, _ = bert
    runtime = Runtime(base, dtype="float32", lora_modules=adapters, max_loras=2, max_lora_rank=8)
    registry = runtime.frontend.adapters
    expected = {name: _peft_embeddings(base, adapters, name) for name in adapters}
    in_flight = runtime.frontend.plan(planned("embed", TEXTS, "names")).requests  # least recently used
    with registry.using(in_flight), concurrent.futures.ThreadPoolExecutor(2) as callers:
        assert registry.resident() == ["all", "names"]  # made resident for them, in place of 'regex'
        np.testing.assert_allclose(runtime.embed(TEXTS, lora="regex"), expected["regex"], atol=ATOL)
        assert registry.resident() == ["names", "regex"]  # 'all' went, 'names' (in flight) stayed
        with registry.using(runtime.frontend.plan(planned("embed", TEXTS, "regex")).requests):
            waiting = callers.submit(runtime.embed, TEXTS, lora="all")
            while not registry.waiting:
                time.sleep(0.001)
            later = callers.submit(runtime.embed, TEXTS, lora="regex")  # resident, but it came second
            time.sleep(0.2)
            assert not waiting.done() and not later.done() and registry.waiting == 2
            runtime.load_lora("more", adapters["all"])  # checked by loading it, then out until named (vLLM: 200)
            assert registry.resident() == ["names", "regex"] and "more" in runtime.lora_adapters
        np.testing.assert_allclose(waiting.result(timeout=60), expected["all"], atol=ATOL)
        np.testing.assert_allclose(later.result(timeout=60), expected["regex"], atol=ATOL)
        assert registry.resident() == ["names", "regex"] and registry.waiting == 0
        np.testing.assert_allclose(runtime.embed(TEXTS, lora="more"), expected["all"], atol=ATOL)  # in place of 'regex'
        runtime.unload_lora("more")
        runtime.embed(TEXTS, lora="regex")  # in place of 'more'
    gone = tmp_path / "gone"
    shutil.copytree(adapters["all"], gone)
    runtime.load_lora("gone", gone)  # in place of 'names'
    runtime.embed(TEXTS, lora="regex")  # resident: now the most recently used
    runtime.embed(TEXTS, lora="names")  # in place of 'gone'
    assert registry.resident() == ["regex", "names"]
    shutil.rmtree(gone)
    with pytest.raises(InvalidRequestError, match=re.escape(
            "a LoRA adapter of this request was unloaded for room (max_loras 2) and no longer loads from its "
            f"folder: {gone / 'adapter_config.json'} is missing")):
        runtime.embed(TEXTS, lora="gone")
    three = [r for name in adapters for r in runtime.frontend.plan(planned("embed", TEXTS, name)).requests]
    with pytest.raises(InvalidRequestError, match=re.escape("one call names 3 LoRA adapters, more than max_loras 2")):
        run_together(runtime, three)
    np.testing.assert_allclose(runtime.embed(TEXTS), _peft_embeddings(base, adapters, None), atol=ATOL)


def test_cli_lora_modules_and_lora(bert, tmp_path):
    """``--lora-modules`` in both of vLLM's forms, ``--lora`` picking one: PEFT's vectors."""
    from poolrunner.core.cli.main import main

    base, adapters, _ = bert
    output = tmp_path / "out.npy"
    modules = ["names=" + str(adapters["names"]), json.dumps({"name": "regex", "path": str(adapters["regex"])})]
    for name in ("names", "regex"):
        argv = ["embed", "--model", str(base), "--dtype", "float32", "--lora-modules", *modules, "--lora", name,
                "-o", str(output), *TEXTS]
        assert main(argv) == 0
        expected = [normalized(out.last_hidden_state[0, 0]) for out in peft_hidden(base, adapters[name], TEXTS)]
        np.testing.assert_allclose(np.load(output), np.stack(expected), atol=ATOL)
    assert main(["embed", "--model", str(base), "--lora-modules", "names", "-o", str(output), "x"]) == 2


class _RecordingAdapters:
    """A plugin standing in for the built-in: records what the adapter hooks receive."""

    def __init__(self):
        self.calls = []

    @hookimpl
    def load_adapter(self, model, model_config, lora, max_rank):
        self.calls.append(("load", type(model).__name__, model_config.architecture, lora, max_rank))
        return "recorded"

    @hookimpl
    def unload_adapter(self, model, lora_id):
        self.calls.append(("unload", lora_id))
        return True


@pytest.fixture(scope="module")
def recorded(bert):
    base, adapters, _ = bert
    plugin = _RecordingAdapters()
    runtime = Runtime(base, dtype="float32", plugins=[plugin], disable_plugins=["lora"], max_loras=1,
                      max_lora_rank=4)
    return plugin, runtime, adapters


def test_hook_load_adapter(recorded):
    plugin, runtime, adapters = recorded
    runtime.load_lora("x", adapters["names"])
    assert plugin.calls[-1] == ("load", "BertModel", "BertModel",
                                LoraRequest(name="x", lora_id=1, path=adapters["names"]), 4)
    assert runtime.lora_adapters == ["x"]
    runtime.unload_lora("x")


def test_hook_unload_adapter(recorded):
    plugin, runtime, adapters = recorded
    runtime.load_lora("y", adapters["names"])
    runtime.unload_lora("y")
    assert plugin.calls[-1] == ("unload", plugin.calls[-2][3].lora_id)
    assert runtime.lora_adapters == []


def test_no_adapter_plugin_refuses_the_adapter(bert):
    base, adapters, _ = bert
    runtime = Runtime(base, dtype="float32", disable_plugins=["lora"], max_loras=1)
    with pytest.raises(ModelLoadError, match="lora 'x': no installed plugin loads LoRA adapters"):
        runtime.load_lora("x", adapters["names"])
    assert runtime.lora_adapters == []
    assert runtime.embed(TEXTS).shape == (3, 64)


def test_http_model_selects_the_adapter(bert, tmp_path):
    """vLLM's rule: ``model: NAME`` of an adapter runs its parent with it, 16 clients at once,
    mixed; ``/v1/models`` lists adapters with their parent; run-time loading is behind
    ``allow_runtime_lora`` and the API key."""
    import concurrent.futures

    import httpx

    from poolrunner.core.server import ServerSettings
    from poolrunner.core.testing.server import ServerThread

    base, adapters, _ = bert
    runtime = Runtime(base, dtype="float32", lora_modules={"names": adapters["names"], "regex": adapters["regex"]},
                      max_loras=4)
    expected = {name: np.stack([normalized(out.last_hidden_state[0, 0])
                                for out in peft_hidden(base, adapters.get(name), TEXTS)])
                for name in (None, "names", "regex", "all")}
    headers = {"Authorization": "Bearer sesame"}
    with ServerThread(runtime, ServerSettings(served_model_name="base", api_key="sesame",
                                              allow_runtime_lora=True)) as server:
        def embed(name):
            answer = httpx.post(server.url + "/v1/embeddings", json={"model": name or "base", "input": TEXTS},
                                headers=headers, timeout=60)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == (name or "base")  # vLLM's answers name the adapter
            return name, np.array([item["embedding"] for item in answer.json()["data"]], dtype=np.float32)

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            for name, vectors in pool.map(embed, [None, "names", "regex", "names"] * 4):
                np.testing.assert_allclose(vectors, expected[name], atol=ATOL)
        for route, field in (("/v1/embeddings", "embedding"), ("/pooling", "data")):  # two texts stay two inputs
            two = httpx.post(server.url + route, json={"model": "names", "input": TEXTS[:2]}, headers=headers)
            assert two.status_code == 200, two.text
            np.testing.assert_allclose([item[field] for item in two.json()["data"]], expected["names"][:2],
                                       atol=ATOL)
        for model, name in (("names", "names"), ("base", None), ("elsewhere", None)):  # TEI ignores others
            tei = httpx.post(server.url + "/embed", json={"model": model, "inputs": TEXTS}, headers=headers)
            assert tei.status_code == 200, tei.text
            np.testing.assert_allclose(tei.json(), expected[name], atol=ATOL)
        cards = httpx.get(server.url + "/v1/models", headers=headers).json()["data"]
        assert [(card["id"], card["parent"]) for card in cards] == [("base", None), ("names", "base"),
                                                                     ("regex", "base")]
        card = httpx.get(server.url + "/v1/models/names", headers=headers).json()
        assert (card["id"], card["root"], card["parent"]) == ("names", "names", "base")  # no folder path shown
        load = {"lora_name": "all", "lora_path": str(adapters["all"])}
        assert httpx.post(server.url + "/v1/load_lora_adapter", json=load).status_code == 401
        assert httpx.post(server.url + "/v1/load_lora_adapter", json=load, headers=headers).status_code == 200
        np.testing.assert_allclose(embed("all")[1], expected["all"], atol=ATOL)
        bad = httpx.post(server.url + "/v1/load_lora_adapter", headers=headers,
                         json={"lora_name": "bad", "lora_path": str(tmp_path / "nowhere")})
        assert bad.status_code == 400 and "adapter_config.json is missing" in bad.text, bad.text
        unnamed = httpx.post(server.url + "/v1/load_lora_adapter", headers=headers,
                             json={"lora_name": "", "lora_path": str(adapters["all"])})
        assert unnamed.status_code == 400 and unnamed.json()["error"]["message"] == (
            "a LoRA adapter name must be a non-empty string, got ''"), unnamed.text
        assert unnamed.json()["error"]["param"] == "lora_name"
        again = httpx.post(server.url + "/v1/load_lora_adapter", headers=headers,
                           json={"lora_name": "names", "lora_path": str(adapters["all"])})
        assert again.status_code == 400 and again.json()["error"]["message"] == (
            "lora_name 'names' is loaded already; unload it first"), again.text
        assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "all"},
                          headers=headers).status_code == 200
        gone = httpx.post(server.url + "/v1/embeddings", json={"model": "all", "input": TEXTS}, headers=headers)
        assert gone.status_code == 404 and "'all' does not exist" in gone.text, gone.text
        assert "LoRA adapters 'names', 'regex'" in gone.text, gone.text  # what is served instead
        np.testing.assert_allclose(embed("names")[1], expected["names"], atol=ATOL)  # still serving
        metrics = httpx.get(server.url + "/metrics").text
        assert 'poolrunner_lora_requests_total{lora="names"} 12.0' in metrics  # the TEI request too
        assert 'poolrunner_lora_requests_total{lora="all"} 1.0' in metrics
    with ServerThread(runtime) as plain:  # without allow_runtime_lora the routes are not there
        assert httpx.post(plain.url + "/v1/load_lora_adapter", json=load).status_code == 404
        assert "/v1/load_lora_adapter" not in httpx.get(plain.url + "/openapi.json").json()["paths"]


def test_unload_waits_for_requests_in_flight(tmp_path_factory):
    """``unload_lora`` during a run of that adapter returns after the run, whose answers are the
    adapter's (never the base model's, never an error)."""
    import threading

    root = tmp_path_factory.mktemp("lora-unload")
    base = tiny_model_folder(root / "base", "bert", "model")
    adapter = make_adapter(base, root / "a", LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"]))
    runtime = Runtime(base, dtype="float32", lora_modules={"a": adapter}, max_num_seqs=2)
    texts = TEXTS * 20
    requests = runtime.frontend.plan(planned("embed", texts, "a")).requests
    outputs = []
    with runtime.serving() as serving:
        running = threading.Thread(target=lambda: outputs.extend(asyncio.run(serving.run(requests))))
        running.start()
        while serving.pending == 0:  # submitted: the adapter counts as in use from here
            time.sleep(0.001)
        runtime.unload_lora("a")
        assert serving.pending == 0  # it returned once every request of the run had finished
        running.join()
    assert len(outputs) == len(texts)
    expected = [normalized(out.last_hidden_state[0, 0]) for out in peft_hidden(base, adapter, TEXTS)]
    np.testing.assert_allclose(np.stack([o.numpy() for o in outputs]), np.stack(expected * 20), atol=ATOL)
    assert runtime.lora_adapters == []


def test_a_cancelled_caller_leaves_the_adapter_queue(bert):
    """A served caller waiting for a slot that goes away (a client disconnecting cancels its task)
    leaves the queue: the caller behind it gets the slot and PEFT's answers."""
    base, adapters, _ = bert
    runtime = Runtime(base, dtype="float32", lora_modules=adapters, max_loras=1, max_lora_rank=8)
    registry = runtime.frontend.adapters
    plan = {name: runtime.frontend.plan(planned("embed", TEXTS, name)).requests for name in ("names", "regex")}

    async def scenario(serving):
        with registry.using(plan["regex"]):  # the only slot, busy
            gone = asyncio.ensure_future(serving.run(plan["names"]))
            behind = asyncio.ensure_future(serving.run(plan["names"]))
            while registry.waiting < 2:
                await asyncio.sleep(0.001)
            gone.cancel()
            while registry.waiting > 1:
                await asyncio.sleep(0.001)
        return await asyncio.wait_for(behind, 60)

    with runtime.serving() as serving:
        outputs = asyncio.run(scenario(serving))
    np.testing.assert_allclose(np.stack([o.numpy() for o in outputs]), _peft_embeddings(base, adapters, "names"),
                               atol=ATOL)
    assert registry.waiting == 0 and registry.resident() == ["names"]


@pytest.mark.parametrize("max_loras", [[], ["--max-loras", "1"]], ids=["both-resident", "one-slot"])
def test_serve_lora_modules_16_mixed_clients(bert, max_loras):
    """``serve --lora-modules a=... b=...`` as the command line builds it: 16 concurrent clients
    mixing ``model: a``, ``b`` and the base, each answer PEFT's (transformers' for the base). With
    one slot for the two adapters, requests wait for it in turn: every answer a 200 (vLLM queues
    them; no 429)."""
    import concurrent.futures

    import httpx

    from poolrunner.core.cli.main import build_parser
    from poolrunner.core.cli.model_specs import load_served_models, model_specs
    from poolrunner.core.testing.server import ServerThread

    base, adapters, _ = bert
    args = build_parser().parse_args(["serve", "--model", str(base), "--served-model-name", "base", "--dtype",
                                      "float32", "--max-lora-rank", "8", "--lora-modules",
                                      f"a={adapters['names']}", f"b={adapters['regex']}", *max_loras])
    expected = {"a": _peft_embeddings(base, adapters, "names"), "b": _peft_embeddings(base, adapters, "regex"),
                "base": _peft_embeddings(base, adapters, None)}
    with ServerThread(load_served_models(args, model_specs(args))) as server, httpx.Client(timeout=60) as client:
        def embed(model):
            answer = client.post(server.url + "/v1/embeddings", json={"model": model, "input": TEXTS})
            assert answer.status_code == 200, answer.text
            return model, np.array([item["embedding"] for item in answer.json()["data"]], dtype=np.float32)

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(embed, ["a", "b", "base", "b"] * 8))
    assert len(answers) == 32
    for model, vectors in answers:
        np.testing.assert_allclose(vectors, expected[model], atol=ATOL, err_msg=model)


def _st_files(folder: Path, *, pooling: str, prompts: dict[str, str], default: str | None = None) -> Path:
    """sentence-transformers' files (Transformer at the root, Pooling, Normalize) in ``folder``."""
    modules = [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
               for i, (path, kind) in enumerate([("", "Transformer"), ("1_Pooling", "Pooling"),
                                                 ("2_Normalize", "Normalize")])]
    (folder / "modules.json").write_text(json.dumps(modules))
    for sub in ("1_Pooling", "2_Normalize"):
        (folder / sub).mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                  "pooling_mode": pooling}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32, "do_lower_case": False}))
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": prompts, "default_prompt_name": default, "similarity_fn_name": "cosine"}))
    return folder


def test_adapter_folder_prompts_follow_sentence_transformers(tmp_path_factory):
    """An adapter saved as a sentence-transformers folder (its modules.json and prompts beside the
    PEFT files): requests naming it use its prompts, as ``SentenceTransformer(folder)`` does; a
    folder pooling otherwise than the base model is refused naming the file."""
    from sentence_transformers import SentenceTransformer

    root = tmp_path_factory.mktemp("lora-st")
    base = _st_files(tiny_model_folder(root / "base", "bert", "model"), pooling="mean", prompts={"q": "search: "})

    def st_adapter(name: str, pooling: str) -> Path:
        folder = make_adapter(base, root / name, LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"]))
        AutoTokenizer.from_pretrained(base).save_pretrained(folder)  # as ST's save_pretrained leaves it
        return _st_files(folder, pooling=pooling, prompts={"query": "query: ", "passage": "passage: "},
                         default="query")

    adapter = st_adapter("st", "mean")
    runtime = Runtime(base, dtype="float32", lora_modules={"st": adapter})
    reference = SentenceTransformer(str(adapter), device="cpu")
    np.testing.assert_allclose(runtime.embed(TEXTS, lora="st"), reference.encode(TEXTS), atol=ATOL)  # "query: "
    np.testing.assert_allclose(runtime.embed(TEXTS, lora="st", prompt_name="passage"),
                               reference.encode(TEXTS, prompt_name="passage"), atol=ATOL)
    with pytest.raises(InvalidRequestError, match=re.escape(
            f"prompt_name 'q' is not defined by LoRA adapter 'st' ({adapter / 'config_sentence_transformers.json'}); "
            "defined: ['passage', 'query']")):
        runtime.embed(TEXTS, lora="st", prompt_name="q")
    with pytest.raises(ModelLoadError, match=re.escape(
            f"{root / 'cls' / '1_Pooling/config.json'}: the adapter's pooling 'CLS' differs from the base model's "
            "'MEAN'")):
        runtime.load_lora("cls", st_adapter("cls", "cls"))
    assert runtime.lora_adapters == ["st"]
    base_reference = SentenceTransformer(str(base), device="cpu")  # the base keeps its own prompts
    np.testing.assert_allclose(runtime.embed(TEXTS, prompt_name="q"), base_reference.encode(TEXTS, prompt_name="q"),
                               atol=ATOL)


def test_bfloat16_adapter_equals_peft(model_path, tmp_path, lee_sentences):
    """bfloat16, all-MiniLM-L6-v2 with a rank-16 adapter on every linear layer (B drawn at a trained
    adapter's scale, 0.02): cosine >= 0.9999 to PEFT's bfloat16 (which, as poolrunner, runs the
    adapter's term in float32: ``autocast_adapter_dtype``). Random adapters 10x larger on
    hidden-64 models amplify both sides' bfloat16 rounding past that (PEFT's own bfloat16 is
    then 0.9995 from its float32)."""
    from tests.helpers import MIN_COSINE, cosine_rows

    config = LoraConfig(r=16, lora_alpha=32, target_modules=["query", "key", "value", "dense"])
    model = get_peft_model(AutoModel.from_pretrained(model_path), config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    model.save_pretrained(tmp_path / "a")
    texts = lee_sentences[:6]
    reference = PeftModel.from_pretrained(AutoModel.from_pretrained(model_path, dtype=torch.bfloat16),
                                          tmp_path / "a").eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    with torch.inference_mode():
        expected = [reference(**tokenizer(text, return_tensors="pt")).last_hidden_state[0].float().mean(0)
                    for text in texts]  # the model's MEAN pooling, normalized below
    runtime = Runtime(model_path, dtype="bfloat16", lora_modules={"a": tmp_path / "a"})
    cosines = cosine_rows(runtime.embed(texts, lora="a"), np.stack([normalized(v) for v in expected]))
    assert cosines.min() >= MIN_COSINE, cosines.min()
