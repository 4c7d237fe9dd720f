"""The load-time task check and the load-time hooks ``claim_model_folder``, ``supported_tasks``
and ``get_pooler``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

import poolrunner
from poolrunner.core import (
    ModelConfig,
    PluginConflictError,
    Pooler,
    PoolingMetadata,
    PoolingParams,
    PoolingRequest,
    PoolingTask,
    UnsupportedTaskError,
    build_plugin_manager,
    hookimpl,
)
from poolrunner.core.hooks import Hooks
from poolrunner.core.types import RequiredPlugin
from tests.helpers import assert_engine_empty, run_requests
from tests.plugin_system.builtin_plugins import (
    builtins_implementing,
    describe_pooling_builtins,
    pooling_builtins,
)

REMEDY = "Pick a supported task, or install a plugin that serves it (see `poolrunner plugins --all`)."


class TokenPooler(Pooler):
    """Every token's hidden state, one ``[num_tokens, hidden_size]`` tensor per request."""

    def get_supported_tasks(self) -> frozenset[PoolingTask]:
        return frozenset({"token_embed"})

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
        offsets = metadata.query_start_loc.tolist()
        return [hidden_states[start:end].float() for start, end in zip(offsets[:-1], offsets[1:], strict=True)]


class TokenEmbedPlugin:
    """A third-party plugin adding ``token_embed``, which a bare BERT can do."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    @hookimpl
    def supported_tasks(self, model_config: ModelConfig):
        return {"token_embed"} if "token_embed" in model_config.model_tasks else set()

    @hookimpl
    def get_pooler(self, task):
        self.asked.append(task)
        return TokenPooler() if task == "token_embed" else None


class ClaimsTokenClassify:
    """Claims ``token_classify`` without the model (a bare BertModel) being able to do it."""

    @hookimpl
    def supported_tasks(self):
        return ["token_classify"]


class ClaimsWithoutPooler:
    """Claims ``token_embed`` but never returns a pooler."""

    @hookimpl
    def supported_tasks(self):
        return {"token_embed"}


class AlwaysNone:
    def __init__(self) -> None:
        self.asked: list[str] = []

    @hookimpl
    def get_pooler(self, model_config, task):
        self.asked.append(task)
        return None


# ---- 6. Unsupported tasks fail at load, with a message that says what to do ----


def test_classify_on_the_default_model_is_unsupported(default_runtime, default_model_path):
    """sequence_pooling serves classify, but a bare BertModel has no classification head."""
    with pytest.raises(UnsupportedTaskError) as excinfo:
        poolrunner.Runtime(task="classify", load_entrypoints=False, dtype="float32")
    assert isinstance(excinfo.value, ValueError)
    # Only pooling plugins are listed: token_type_ids (request hooks only) is not.
    builtins = describe_pooling_builtins(default_runtime.model_config)
    assert "token_type_ids" not in builtins
    assert str(excinfo.value) == (
        f"model {default_model_path!r} (BertModel) does not support task 'classify'. "
        "Supported: ['embed', 'token_embed']. The model itself can do ['embed', 'token_embed']; "
        f"pooling plugins: {builtins}. " + REMEDY
    )


def test_token_classify_on_the_default_model_is_unsupported(default_runtime, default_model_path):
    """token_pooling serves token_classify, but only a *ForTokenClassification model can do it."""
    with pytest.raises(UnsupportedTaskError) as excinfo:
        poolrunner.Runtime(task="token_classify", load_entrypoints=False, dtype="float32")
    assert str(excinfo.value) == (
        f"model {default_model_path!r} (BertModel) does not support task 'token_classify'. "
        "Supported: ['embed', 'token_embed']. The model itself can do ['embed', 'token_embed']; "
        f"pooling plugins: {describe_pooling_builtins(default_runtime.model_config)}. " + REMEDY
    )


def test_unsupported_task_message_lists_third_party_plugins(default_runtime, default_model_path):
    with pytest.raises(UnsupportedTaskError) as excinfo:
        poolrunner.Runtime(task="token_classify", plugins=[TokenEmbedPlugin()], load_entrypoints=False, dtype="float32")
    # Third-party plugins come after the built-ins, in registration order.
    assert str(excinfo.value) == (
        f"model {default_model_path!r} (BertModel) does not support task 'token_classify'. "
        "Supported: ['embed', 'token_embed']. The model itself can do ['embed', 'token_embed']; "
        f"pooling plugins: {describe_pooling_builtins(default_runtime.model_config)}, "
        "TokenEmbedPlugin (programmatic) serves ['token_embed']. " + REMEDY
    )


def test_a_claim_the_model_cannot_honour_is_not_enough(default_runtime, default_model_path):
    with pytest.raises(UnsupportedTaskError) as excinfo:
        poolrunner.Runtime(task="token_classify", plugins=[ClaimsTokenClassify()], load_entrypoints=False,
                           dtype="float32")
    assert str(excinfo.value) == (
        f"model {default_model_path!r} (BertModel) does not support task 'token_classify'. "
        "Supported: ['embed', 'token_embed']. The model itself can do ['embed', 'token_embed']; "
        f"pooling plugins: {describe_pooling_builtins(default_runtime.model_config)}, "
        "ClaimsTokenClassify (programmatic) serves ['token_classify']. " + REMEDY
    )


def test_a_claimed_task_without_a_pooler_fails_at_load(default_model_path):
    # With the pooling built-ins left out, only the claim remains: no plugin gives a pooler.
    with pytest.raises(UnsupportedTaskError) as excinfo:
        poolrunner.Runtime(task="token_embed", plugins=[ClaimsWithoutPooler()], load_entrypoints=False,
                           disable_plugins=pooling_builtins(), dtype="float32")
    assert str(excinfo.value) == (
        f"no plugin returned a pooler for task 'token_embed' of model {default_model_path}"
    )


# ---- the load-time hooks ----


def test_hook_supported_tasks(default_runtime):
    model_config = default_runtime.model_config
    third_party = [TokenEmbedPlugin(), ClaimsTokenClassify()]
    # What plugins serve, before the intersection with what the model can do: the union of the
    # plugins' answers. Third-party plugins alone (no pooling built-in):
    alone = Hooks(build_plugin_manager(plugins=third_party, load_entrypoints=False, disable=pooling_builtins()))
    assert alone.supported_tasks(model_config=model_config) == {"token_embed", "token_classify"}
    assert alone.tasks_by_plugin(model_config=model_config) == {
        "TokenEmbedPlugin": {"token_embed"}, "ClaimsTokenClassify": {"token_classify"}}
    # Beside the built-ins (whose own answers test_plugin_manager.py pins), each plugin keeps its own answer.
    builtin_only = Hooks(build_plugin_manager(load_entrypoints=False))
    builtin_tasks = builtin_only.tasks_by_plugin(model_config=model_config)
    assert list(builtin_tasks) == builtins_implementing("supported_tasks")
    assert builtin_only.supported_tasks(model_config=model_config) == frozenset().union(*builtin_tasks.values())
    hooks = Hooks(build_plugin_manager(plugins=third_party, load_entrypoints=False))
    assert hooks.tasks_by_plugin(model_config=model_config) == {
        **builtin_tasks, "TokenEmbedPlugin": {"token_embed"}, "ClaimsTokenClassify": {"token_classify"}}
    assert hooks.supported_tasks(model_config=model_config) == (
        builtin_only.supported_tasks(model_config=model_config) | {"token_embed", "token_classify"})
    assert default_runtime.task == "embed"  # of those, the bare BertModel gets embed by default


def test_hook_get_pooler(default_runtime, poolrunner_hook_recorder):
    """A third-party get_pooler is asked first; returning None hands over to the built-in."""
    none = AlwaysNone()
    runtime = poolrunner.Runtime(plugins=[none], load_entrypoints=False, dtype="float32")
    assert none.asked == ["embed", "token_embed"]  # once per served task, the default first
    calls = poolrunner_hook_recorder(runtime)
    np.testing.assert_allclose(runtime.embed("text"), default_runtime.embed("text"), atol=1e-6)
    assert [type(call.kwargs["pooler"]).__name__ for call in calls.getcalls("pool")] == ["EmbeddingPooler"]

    # Built-in poolers are trylast defaults: AlwaysNone (called first) comes after them all.
    impls = runtime.plugin_manager.hook.get_pooler.get_hookimpls()
    builtin_impls = build_plugin_manager(load_entrypoints=False).hook.get_pooler.get_hookimpls()
    assert [(impl.plugin_name, impl.trylast) for impl in impls] == [
        *((impl.plugin_name, True) for impl in builtin_impls), ("AlwaysNone", False)]


class ClaimsMarkedFolders:
    """A third-party format: folders holding ``my_format.json`` are this plugin's alone."""

    def __init__(self, name: str = "ClaimsMarkedFolders") -> None:
        self.name = name

    @hookimpl
    def claim_model_folder(self, folder, architecture):
        return f"{folder.name} holds my_format.json ({architecture})" if (folder / "my_format.json").is_file() else None

    @hookimpl
    def supported_tasks(self, model_config: ModelConfig):
        mine = model_config.required_plugin is not None and model_config.required_plugin.name == self.name
        return {"token_embed"} if mine else set()

    @hookimpl
    def get_pooler(self, model_config: ModelConfig, task):
        mine = model_config.required_plugin is not None and model_config.required_plugin.name == self.name
        return TokenPooler() if mine and task == "token_embed" else None


def test_hook_claim_model_folder(default_model_path, tmp_path, poolrunner_hook_recorder):
    """A claimed folder is served by its plugin alone; an unmarked folder is left to the built-ins;
    two claims are a conflict naming both plugins and their reasons."""
    marked = tmp_path / "marked"
    marked.mkdir()
    for item in Path(default_model_path).iterdir():
        (marked / item.name).symlink_to(item)
    (marked / "my_format.json").write_text("{}", encoding="utf-8")

    runtime = poolrunner.Runtime(marked, plugins=[ClaimsMarkedFolders()], load_entrypoints=False, dtype="float32")
    assert runtime.model_config.required_plugin == RequiredPlugin(
        name="ClaimsMarkedFolders", dist="ClaimsMarkedFolders", reason="marked holds my_format.json (BertModel)")
    assert runtime.task == "token_embed"
    calls = poolrunner_hook_recorder(runtime)
    runtime.encode("text")
    assert [type(call.kwargs["pooler"]) for call in calls.getcalls("pool")] == [TokenPooler]
    assert runtime.model_config.pooling_type == "CLS"  # the folder's ST pipeline is the plugin's to read

    plain = poolrunner.Runtime(default_model_path, plugins=[ClaimsMarkedFolders()], load_entrypoints=False,
                               dtype="float32")
    assert plain.model_config.required_plugin is None and plain.task == "embed"

    with pytest.raises(PluginConflictError, match=(
        r"^plugins \['first', 'second'\] all claim the model folder .*marked \(first: marked holds my_format\.json "
        r"\(BertModel\); second: marked holds my_format\.json \(BertModel\)\); disable all but one$")):
        poolrunner.Runtime(marked, plugins=[_named(ClaimsMarkedFolders("first"), "first"),
                                            _named(ClaimsMarkedFolders("second"), "second")],
                           load_entrypoints=False, dtype="float32")


def _named(plugin: object, name: str) -> object:
    plugin.__name__ = name  # the registration name build_plugin_manager gives a code-passed plugin
    return plugin


def test_third_party_task_and_pooler_serve_requests(default_model_path, poolrunner_hook_recorder):
    plugin = TokenEmbedPlugin()
    runtime = poolrunner.Runtime(task="token_embed", plugins=[plugin], load_entrypoints=False, dtype="float32")
    assert runtime.task == "token_embed" and plugin.asked == ["token_embed"]
    calls = poolrunner_hook_recorder(runtime)

    texts = ["Per-token vectors from a plugin.", "Short"]
    ids = runtime.inputs.encode(texts)
    requests = [PoolingRequest(request_id=f"t{i}", prompt_token_ids=tokens, params=PoolingParams(task="token_embed"))
                for i, tokens in enumerate(ids)]
    outputs = run_requests(runtime, requests)
    assert [type(call.kwargs["pooler"]) for call in calls.getcalls("pool")] == [TokenPooler]  # one step

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModel.from_pretrained(default_model_path).eval()
    for i, text in enumerate(texts):
        encoded = tokenizer(text, return_tensors="pt")
        assert encoded["input_ids"][0].tolist() == list(ids[i])
        with torch.inference_mode():
            reference = model(**encoded).last_hidden_state[0]
        assert outputs[f"t{i}"].shape == (len(ids[i]), 384)
        torch.testing.assert_close(outputs[f"t{i}"], reference, rtol=1e-5, atol=1e-5)
    # The runtime serves only its task: an embed request is refused before admission.
    refused = r"^request 'e' asks for task 'embed', but this runtime serves \['token_embed'\]$"
    with pytest.raises(poolrunner.InvalidRequestError, match=refused):
        run_requests(runtime, [PoolingRequest(request_id="e", prompt_token_ids=ids[0],
                                              params=PoolingParams(task="embed"))])
    assert_engine_empty(runtime)


# ---- Ambiguity: two third-party poolers for one task ----


class NamedTokenEmbed(TokenEmbedPlugin):
    """A second, distinctly named plugin offering the same task."""


def test_two_third_party_poolers_conflict_unless_one_is_named(poolrunner_hook_recorder):
    with pytest.raises(poolrunner.PluginConflictError) as excinfo:
        poolrunner.Runtime(task="token_embed", load_entrypoints=False,
                           plugins=[TokenEmbedPlugin(), NamedTokenEmbed()], dtype="float32")
    assert str(excinfo.value) == (
        "plugins ['NamedTokenEmbed', 'TokenEmbedPlugin'] all offer a pooler for task 'token_embed'; "
        "choose one with pooler_plugin=<name> or disable the others"
    )
    chosen, other = NamedTokenEmbed(), TokenEmbedPlugin()
    runtime = poolrunner.Runtime(task="token_embed", load_entrypoints=False, plugins=[other, chosen],
                                 pooler_plugin="NamedTokenEmbed", dtype="float32")
    assert chosen.asked == ["token_embed"] and other.asked == []
    calls = poolrunner_hook_recorder(runtime)
    runtime.encode("text")
    assert [type(call.kwargs["pooler"]) for call in calls.getcalls("pool")] == [TokenPooler]


def test_a_named_pooler_plugin_must_exist_and_answer():
    with pytest.raises(UnsupportedTaskError, match=r"^pooler_plugin 'nope' is not a registered plugin$"):
        poolrunner.Runtime(load_entrypoints=False, pooler_plugin="nope", dtype="float32")
    with pytest.raises(UnsupportedTaskError,
                       match=r"^plugin 'AlwaysNone' returned no pooler for task 'embed'$"):
        poolrunner.Runtime(load_entrypoints=False, plugins=[AlwaysNone()], pooler_plugin="AlwaysNone", dtype="float32")
