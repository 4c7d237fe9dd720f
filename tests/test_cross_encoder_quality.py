"""A real cross-encoder against sentence-transformers: scores, STS-style quality and reranking.

The model is all-MiniLM-L6-v2 as ``BertForSequenceClassification`` with one label, its head fitted
on human similarities of Lee document pairs (the ``lee_cross_encoder`` fixture). The reference is
``sentence_transformers.CrossEncoder`` on the same folder: its default activation for one label
is a sigmoid, and its ``max_length`` is set to the same 256 tokens poolrunner keeps
(``truncate_prompt_tokens=256``), both truncating pairs ``longest_first``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from poolrunner import Runtime

MAX_LENGTH = 256  # == conftest.CROSS_ENCODER_MAX_LENGTH
RTOL = 2e-3  # classification tolerance in fp32 (REFERENCE.md)
# Measured: Spearman 0.40 on the 105 held-out pairs (documents never seen by the fit). A cosine of
# mean-pooled MiniLM embeddings reaches about 0.5 on all Lee pairs; a head fitted on 199 pairs
# of CLS pooler features is weaker but clearly informative. The floor only catches a broken model.
SPEARMAN_FLOOR = 0.25
# Rerank queries (held-out documents) and their candidate documents.
RERANK_CASES = ((35, list(range(36, 44))), (44, [45, 46, 47, 48, 49, 36, 37, 38]))
# Short pairs for the activation checks (cheap to run several times).
SHORT_PAIRS = [
    ("A court sentenced the man to prison.", "The judge jailed him for fraud."),
    ("Bushfires burn near Sydney.", "The cricket test resumed in Adelaide."),
    ("Israeli troops entered the West Bank town.", "Palestinian militants fired on soldiers."),
]


@pytest.fixture(scope="module")
def cross_encoder(lee_cross_encoder):
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(lee_cross_encoder.folder), device="cpu", max_length=MAX_LENGTH)
    assert model.max_seq_length == MAX_LENGTH
    assert isinstance(model.activation_fn, torch.nn.Sigmoid)  # ST's default for num_labels=1
    return model


@pytest.fixture(scope="module")
def ce_runtime(lee_cross_encoder, classifier_runtime) -> Runtime:
    return classifier_runtime(lee_cross_encoder.folder)


@pytest.fixture(scope="module")
def heldout(lee_cross_encoder, lee_docs, lee_similarities, cross_encoder, ce_runtime) -> dict[str, Any]:
    """Scores of the 105 held-out pairs from poolrunner and sentence-transformers, computed once."""
    pairs = lee_cross_encoder.heldout_pairs
    queries = [lee_docs[i] for i, _ in pairs]
    documents = [lee_docs[j] for _, j in pairs]
    return {
        "pairs": pairs,
        "queries": queries,
        "documents": documents,
        "human": np.array([lee_similarities[i, j] for i, j in pairs]),
        "reference": cross_encoder.predict(list(zip(queries, documents, strict=True)), batch_size=16),
        "ours": ce_runtime.score(queries, documents, truncate_prompt_tokens=MAX_LENGTH),
    }


def test_fixture_split_is_disjoint(lee_cross_encoder):
    train_docs = {d for pair in lee_cross_encoder.train_pairs for d in pair}
    heldout_docs = {d for pair in lee_cross_encoder.heldout_pairs for d in pair}
    assert len(lee_cross_encoder.train_pairs) == 199 and len(lee_cross_encoder.heldout_pairs) == 105
    assert not train_docs & heldout_docs


def test_runtime_serves_the_cross_encoder_as_one_label_classifier(ce_runtime):
    assert ce_runtime.task == "classify"
    assert ce_runtime.model_config.labels == ("LABEL_0",)
    assert ce_runtime.model_config.classifier_activation is None  # default: sigmoid for one label


def test_scores_match_sentence_transformers(heldout, record_property):
    ours, reference = heldout["ours"], heldout["reference"]
    assert ours.dtype == np.float32 and ours.shape == (105,)
    deviation = np.abs(ours - reference) / np.abs(reference)
    record_property("max_relative_deviation", float(deviation.max()))
    print(f"cross-encoder parity: max relative deviation {deviation.max():.2e}")
    np.testing.assert_allclose(ours, reference, rtol=RTOL)
    # The head is not degenerate: scores spread over a real range.
    assert reference.max() - reference.min() > 0.1


def test_truncated_pairs_match_sentence_transformers(lee_docs, cross_encoder, ce_runtime):
    """The four longest Lee pairs are cut to 256 tokens (``longest_first``) on both sides."""
    tokenizer = ce_runtime.inputs.tokenizer
    pairs = [(i, j) for i in range(50) for j in range(i + 1, 50)]
    lengths = {(i, j): len(tokenizer(lee_docs[i], lee_docs[j])["input_ids"]) for i, j in pairs}
    longest = sorted(lengths, key=lambda pair: -lengths[pair])[:4]
    assert all(lengths[pair] > MAX_LENGTH + 20 for pair in longest)
    queries, documents = [lee_docs[i] for i, _ in longest], [lee_docs[j] for _, j in longest]
    reference = cross_encoder.predict(list(zip(queries, documents, strict=True)))
    np.testing.assert_allclose(ce_runtime.score(queries, documents, truncate_prompt_tokens=MAX_LENGTH), reference,
                               rtol=RTOL)


def test_raw_logits_match_sentence_transformers(heldout, cross_encoder, ce_runtime):
    queries, documents = heldout["queries"][:4], heldout["documents"][:4]
    reference = cross_encoder.predict(list(zip(queries, documents, strict=True)), activation_fn=torch.nn.Identity())
    ours = ce_runtime.score(queries, documents, truncate_prompt_tokens=MAX_LENGTH, use_activation=False)
    np.testing.assert_allclose(ours, reference, rtol=RTOL, atol=1e-4)
    np.testing.assert_allclose(1 / (1 + np.exp(-ours)), heldout["ours"][:4], rtol=1e-5)


def test_heldout_spearman_matches_reference(heldout, record_property):
    ours = spearmanr(heldout["ours"], heldout["human"]).statistic
    reference = spearmanr(heldout["reference"], heldout["human"]).statistic
    record_property("spearman_poolrunner", float(ours))
    record_property("spearman_sentence_transformers", float(reference))
    print(f"held-out Spearman: poolrunner {ours:.5f}, sentence-transformers {reference:.5f}, "
          f"difference {abs(ours - reference):.2e}")
    assert abs(ours - reference) <= 1e-3
    assert ours > SPEARMAN_FLOOR


@pytest.mark.parametrize(("query_doc", "candidate_docs"), RERANK_CASES)
def test_rerank_matches_cross_encoder_rank(query_doc, candidate_docs, lee_docs, cross_encoder, ce_runtime):
    query, documents = lee_docs[query_doc], [lee_docs[d] for d in candidate_docs]
    results = ce_runtime.rerank(query, documents, top_n=5, return_documents=True, truncate_prompt_tokens=MAX_LENGTH)
    reference = cross_encoder.rank(query, documents, top_k=5)
    assert len(results) == 5
    scores = [r.score for r in results]
    assert scores == sorted(scores, reverse=True)
    assert [r.index for r in results] == [int(r["corpus_id"]) for r in reference]
    np.testing.assert_allclose(scores, [r["score"] for r in reference], rtol=RTOL)
    assert [r.document for r in results] == [documents[r.index] for r in results]


# --------------------------------------------------------------------------- folders saved by ST


def test_loads_a_folder_saved_by_cross_encoder(cross_encoder, heldout, tmp_path):
    """``CrossEncoder.save_pretrained`` (sentence-transformers 6) writes ``modules.json`` with one
    Transformer module, the activation in ``config_sentence_transformers.json`` and
    ``max_length`` as the tokenizer's ``model_max_length``."""
    folder = tmp_path / "saved_by_st"
    cross_encoder.save_pretrained(str(folder))
    modules = json.loads((folder / "modules.json").read_text(encoding="utf-8"))
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == ["Transformer"]
    runtime = Runtime(folder, dtype="float32")
    assert runtime.task == "classify"
    assert runtime.model_config.max_model_len == MAX_LENGTH
    assert runtime.model_config.classifier_activation == "Sigmoid"
    ours = runtime.score(heldout["queries"][:6], heldout["documents"][:6], truncate_prompt_tokens=-1)
    np.testing.assert_allclose(ours, heldout["reference"][:6], rtol=RTOL)


def _copy_folder(source: Path, target: Path) -> Path:
    target.mkdir()
    for name in os.listdir(source):
        if name == "model.safetensors":
            os.symlink(source / name, target / name)
        else:
            shutil.copyfile(source / name, target / name)
    return target


def _edit_config(folder: Path, **values: Any) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text(encoding="utf-8")), **values}), encoding="utf-8")


IDENTITY = "torch.nn.modules.linear.Identity"


@pytest.mark.parametrize("where", ["st6_config_sentence_transformers", "st4_config_json", "st3_legacy_key"])
def test_activation_named_by_the_folder(where, lee_cross_encoder, tmp_path):
    """Every place sentence-transformers reads a cross-encoder's activation from: the named
    Identity makes both return raw logits (a sigmoid would squash them into 0..1)."""
    from sentence_transformers import CrossEncoder

    if where == "st6_config_sentence_transformers":
        folder = tmp_path / "st6"
        CrossEncoder(str(lee_cross_encoder.folder), device="cpu", activation_fn=torch.nn.Identity()).save_pretrained(
            str(folder))
        assert json.loads((folder / "config_sentence_transformers.json").read_text())["activation_fn"] == IDENTITY
    else:
        folder = _copy_folder(lee_cross_encoder.folder, tmp_path / where)
        if where == "st4_config_json":
            _edit_config(folder, sentence_transformers={"activation_fn": IDENTITY})
        else:
            _edit_config(folder, sbert_ce_default_activation_function=IDENTITY)
    reference = CrossEncoder(str(folder), device="cpu")
    assert isinstance(reference.activation_fn, torch.nn.Identity)
    expected = reference.predict(SHORT_PAIRS)
    runtime = Runtime(folder, dtype="float32")
    assert runtime.model_config.classifier_activation == "Identity"
    ours = runtime.score([q for q, _ in SHORT_PAIRS], [d for _, d in SHORT_PAIRS])
    np.testing.assert_allclose(ours, expected, rtol=RTOL, atol=1e-4)
    assert (ours < 0).any() or (ours > 1).any(), ours  # raw logits, not probabilities
