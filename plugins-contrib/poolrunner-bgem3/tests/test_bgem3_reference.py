"""poolrunner-bgem3 against an independent reference (m3_reference.py: transformers' XLMRobertaModel
and FlagEmbedding's formulas) on a seeded tiny BGE-M3 folder (bgem3_folders.py): every part alone
and batched with texts of other lengths, the ``outputs`` option, the weighted score, bad requests,
and what the built-ins keep serving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import poolrunner_bgem3
import pytest
import torch
from bgem3_folders import HIDDEN, save_linear, write_bgem3_folder
from m3_reference import M3Reference, combined_score, dense_score

import poolrunner
from poolrunner.core import InvalidRequestError, ModelLoadError, PoolingMetadata, PoolingParams, UnsupportedTaskError

TEXTS = [
    "what is bge m3 ?",
    "the cat sat on the mat and the dog sat on the cat",
    "BGE M3 is an embedding model for dense, sparse and multi vector retrieval: price 12 €",
    "ok",
]
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital and largest city of france", "the cat sat on the mat", "ok"]
ATOL = 1e-5
WORST: dict[str, float] = {"dense": 0.0, "sparse": 0.0, "colbert": 0.0, "score": 0.0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_bgem3_folder(tmp_path_factory.mktemp("bgem3") / "tiny-bge-m3")


@pytest.fixture(scope="module")
def reference(folder) -> M3Reference:
    return M3Reference(folder)


@pytest.fixture(scope="module")
def runtime(folder) -> poolrunner.Runtime:
    """As installed (entry points): the built-ins serve embed and embed&token_classify (the default
    task of a folder with ``sparse_linear.pt``), the plugin m3_embed."""
    return poolrunner.Runtime(folder, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def m3_runtime(folder) -> poolrunner.Runtime:
    """Serving m3_embed alone, so score and rerank combine the parts."""
    return poolrunner.Runtime(folder, task="m3_embed", device="cpu", dtype="float32")


def lexical(output: dict[str, np.ndarray]) -> dict[int, float]:
    return dict(zip(output["token_ids"].tolist(), output["weights"].tolist(), strict=True))


def check_parts(output: dict[str, np.ndarray], want: dict) -> None:
    """Each part of ``output`` against the reference, within ``ATOL``; records the deviations."""
    assert list(output) == ["dense", "token_ids", "weights", "colbert"]
    assert output["dense"].dtype == output["weights"].dtype == output["colbert"].dtype == np.float32
    assert output["token_ids"].dtype == np.int64
    assert set(lexical(output)) == set(want["lexical"])  # the same ids: aggregated, specials and zeros dropped
    assert list(output["weights"]) == sorted(output["weights"], reverse=True)
    assert output["colbert"].shape == (len(want["ids"]) - 1, HIDDEN)
    deviations = {
        "dense": np.abs(output["dense"] - want["dense"]).max(),
        "sparse": max((abs(weight - want["lexical"][token]) for token, weight in lexical(output).items()), default=0),
        "colbert": np.abs(output["colbert"] - want["colbert"]).max(),
    }
    for part, deviation in deviations.items():
        WORST[part] = max(WORST[part], float(deviation))
        assert deviation <= ATOL, (part, deviation)


def test_the_texts_exercise_every_sparse_rule(reference):
    """The fixture proves each rule: an unknown token, a special token with a positive weight
    (dropped), a zero weight (dropped), and an id repeated with different positive weights (max)."""
    encoded = [reference.encode(text) for text in TEXTS]
    pairs = [(token, weight) for item in encoded for token, weight in zip(item["ids"], item["token_weights"],
                                                                         strict=True)]
    assert any(reference.tokenizer.unk_token_id in item["ids"] for item in encoded)
    assert any(token in reference.unused and weight > 0 for token, weight in pairs)
    assert any(weight == 0 and token not in reference.unused for token, weight in pairs)
    repeated = [{w for t, w in zip(item["ids"], item["token_weights"], strict=True) if t == token and w > 0}
                for item in encoded for token in set(item["ids"]) if item["ids"].count(token) > 1]
    assert any(len(weights) > 1 for weights in repeated)


def test_every_part_matches_the_reference_alone_and_batched(runtime, reference, poolrunner_runtime_factory, folder):
    wants = [reference.encode(text) for text in TEXTS]
    # A 16-token step budget spreads the batch over several steps.
    split = poolrunner_runtime_factory([poolrunner_bgem3], model=folder, task="m3_embed", max_num_batched_tokens=16)
    runs = {
        "alone": [runtime.encode(text, task="m3_embed")[0] for text in TEXTS],
        "batched": runtime.encode(TEXTS, task="m3_embed"),
        "batched over steps": split.encode(TEXTS),
    }
    for outputs in runs.values():
        for output, want in zip(outputs, wants, strict=True):
            check_parts(output, want)
    print(f"max deviation from the reference: {WORST}")


def test_embed_is_the_dense_part(runtime, reference):
    assert runtime.task == "embed&token_classify" and {"embed", "m3_embed"} <= runtime.supported_tasks
    dense = [reference.encode(text)["dense"] for text in TEXTS]
    np.testing.assert_allclose(runtime.embed(TEXTS), dense, atol=ATOL)
    # the built-ins' embed&token_classify (vLLM's BGE-M3 shape) is still served beside m3_embed
    [both] = runtime.encode(TEXTS[1], task="embed&token_classify")
    np.testing.assert_allclose(both["embedding"], dense[1], atol=ATOL)


@pytest.mark.parametrize(("outputs", "keys"), [
    ("dense", ["dense"]),
    ("sparse", ["token_ids", "weights"]),
    ("colbert", ["colbert"]),
    (" colbert , dense", ["dense", "colbert"]),
    ("sparse,colbert,dense", ["dense", "token_ids", "weights", "colbert"]),
])
def test_the_outputs_option_chooses_the_parts(runtime, outputs, keys):
    [full] = runtime.encode(TEXTS[2], task="m3_embed")
    [part] = runtime.encode(TEXTS[2], task="m3_embed", outputs=outputs)
    assert list(part) == keys
    for key in keys:
        np.testing.assert_array_equal(part[key], full[key])


def test_requests_of_one_step_get_their_own_parts(runtime, folder):
    """The pooler alone, on one packed step whose requests ask for different parts."""
    pooler = poolrunner_bgem3.get_pooler(model_config=runtime.model_config, task="m3_embed")
    ids = [[0, 7, 8, 7, 2], [0, 9, 2], [0, 11, 12, 2]]
    asks = ["sparse", "dense,colbert", "colbert"]
    hidden = torch.randn(sum(map(len, ids)), HIDDEN, generator=torch.Generator().manual_seed(3))
    metadata = PoolingMetadata(
        request_ids=("a", "b", "c"), prompt_lens=torch.tensor([len(row) for row in ids]),
        pooling_params=tuple(PoolingParams(task="m3_embed", extra_kwargs={"outputs": ask}) for ask in asks),
        query_start_loc=torch.tensor([0, 5, 8, 12]), prompt_token_ids=torch.tensor(sum(ids, [])),
    )
    outputs = pooler(hidden, metadata)
    assert [list(output) for output in outputs] == [["token_ids", "weights"], ["dense", "colbert"], ["colbert"]]
    assert set(outputs[0]["token_ids"].tolist()) <= {7, 8}  # <s> and </s> never get a weight
    assert outputs[1]["colbert"].shape == (2, HIDDEN) and outputs[2]["colbert"].shape == (3, HIDDEN)
    alone = pooler(hidden[8:], PoolingMetadata(
        request_ids=("c",), prompt_lens=torch.tensor([4]), pooling_params=metadata.pooling_params[2:],
        query_start_loc=torch.tensor([0, 4]), prompt_token_ids=torch.tensor(ids[2])))
    torch.testing.assert_close(alone[0]["colbert"], outputs[2]["colbert"])


@pytest.mark.parametrize(("options", "weights"), [
    ({}, {"dense": 0.4, "sparse": 0.2, "colbert": 0.4}),  # the model card's weights
    ({"dense_weight": 1, "sparse_weight": 0.3, "colbert_weight": 1.0}, {"dense": 1.0, "sparse": 0.3, "colbert": 1.0}),
    ({"outputs": "sparse"}, {"sparse": 0.2}),  # FlagEmbedding's 'sparse' mode
    ({"outputs": "colbert"}, {"colbert": 0.4}),  # its 'colbert' mode
    ({"outputs": "dense,sparse", "dense_weight": 0.6}, {"dense": 0.6, "sparse": 0.2}),  # its 'sparse+dense'
])
def test_score_combines_the_parts_with_the_weights(m3_runtime, reference, options, weights):
    query, documents = reference.encode(QUERY), [reference.encode(document) for document in DOCUMENTS]
    expected = np.array([combined_score(query, document, weights) for document in documents])
    scores = m3_runtime.score(QUERY, DOCUMENTS, **options)
    assert scores.dtype == np.float32 and scores.shape == (3,)
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-6)
    WORST["score"] = max(WORST["score"], float(np.abs(scores - expected).max()))
    ranked = m3_runtime.rerank(QUERY, DOCUMENTS, **options)
    assert [result.index for result in ranked] == list(np.argsort(-scores, kind="stable"))
    pair = m3_runtime.score(DOCUMENTS[1], DOCUMENTS[1], **options)  # one pair: a scalar
    np.testing.assert_allclose(pair, combined_score(documents[1], documents[1], weights), rtol=1e-5)


def test_an_embed_runtime_scores_the_dense_cosine(folder, reference):
    embed = poolrunner.Runtime(folder, task="embed", device="cpu", dtype="float32")
    query = reference.encode(QUERY)
    expected = [dense_score(query, reference.encode(document)) for document in DOCUMENTS]
    np.testing.assert_allclose(embed.score(QUERY, DOCUMENTS), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(InvalidRequestError) as caught:
        embed.score(QUERY, DOCUMENTS, dense_weight=1.0)
    assert str(caught.value) == "option 'dense_weight' (plugin 'bgem3') applies to tasks ['m3_embed'], not 'embed'"


@pytest.mark.parametrize(("options", "message"), [
    ({"outputs": "dense,lexical"}, "option outputs='dense,lexical' (plugin 'bgem3') must name parts among dense, "
                                   "sparse, colbert, comma-separated; 'lexical' is not one"),
    ({"outputs": ""}, "option outputs='' (plugin 'bgem3') must name parts among dense, sparse, colbert, "
                      "comma-separated; '' is not one"),
    ({"outputs": "sparse,sparse"}, "option outputs='sparse,sparse' (plugin 'bgem3') names a part twice"),
    ({"outputs": ["dense"]}, "option outputs=['dense'] (plugin 'bgem3') must be a string"),
    ({"sparse_weight": 0}, "option sparse_weight=0 (plugin 'bgem3') must be a positive number"),
    ({"normalize": False}, "normalize does not apply to task 'm3_embed' (got False)"),
])
def test_a_bad_request_is_refused_and_the_runtime_serves_the_next(runtime, m3_runtime, reference, options, message):
    with pytest.raises(InvalidRequestError) as caught:
        runtime.encode(TEXTS[1], task="m3_embed", **options)
    assert str(caught.value) == message
    [output] = runtime.encode(TEXTS[1], task="m3_embed", outputs="sparse")
    want = reference.encode(TEXTS[1])["lexical"]
    assert set(lexical(output)) == set(want)
    np.testing.assert_allclose([lexical(output)[token] for token in want], list(want.values()), atol=ATOL)
    if "normalize" not in options:  # a core field: score takes none
        with pytest.raises(InvalidRequestError) as caught:
            m3_runtime.score(QUERY, DOCUMENTS, **options)
        assert str(caught.value) == message
    assert m3_runtime.score(QUERY, DOCUMENTS).shape == (3,)


def test_weights_that_overflow_the_score_are_refused_not_answered_nan(m3_runtime):
    """Weights of 1e308 overflow float32: the answer would hold inf or nan (JSON's null)."""
    with pytest.raises(InvalidRequestError) as caught:
        m3_runtime.score(QUERY, DOCUMENTS, dense_weight=1e308, colbert_weight=1e308)
    assert str(caught.value) == ("the scores of 'm3_embed' outputs are not finite (inf or nan) with the request's "
                                 "options (dense_weight=1e+308, colbert_weight=1e+308, outputs='dense,sparse,colbert', "
                                 "sparse_weight=0.2): use smaller values")
    assert np.isfinite(m3_runtime.score(QUERY, DOCUMENTS, dense_weight=1e3, colbert_weight=1e3)).all()


def test_folders_without_both_heads_are_left_to_the_builtins(folder, tmp_path):
    partial = tmp_path / "sparse-head-only"
    shutil.copytree(folder, partial)
    (partial / "colbert_linear.pt").unlink()
    with pytest.raises(UnsupportedTaskError):
        poolrunner.Runtime(partial, task="m3_embed", device="cpu", dtype="float32")
    builtin = poolrunner.Runtime(partial, device="cpu", dtype="float32")
    assert "m3_embed" not in builtin.supported_tasks and "embed&token_classify" in builtin.supported_tasks


def test_a_misshapen_head_fails_the_load_naming_the_file(folder, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    save_linear(broken / "colbert_linear.pt", 16, HIDDEN, seed=5)
    with pytest.raises(ModelLoadError) as caught:
        poolrunner.Runtime(broken, task="m3_embed", device="cpu", dtype="float32")
    assert str(caught.value) == (f"{broken / 'colbert_linear.pt'}: expected an nn.Linear with in_features=32 (the "
                                 "hidden size); found a weight of shape [32, 16]")
    served = poolrunner.Runtime(broken, device="cpu", dtype="float32")  # m3_embed left out, the rest served
    assert served.task == "embed&token_classify" and "m3_embed" not in served.supported_tasks


def test_poolrunner_plugins_lists_the_distribution_and_its_options(folder, capsys):
    import importlib_metadata

    from poolrunner.core.cli.main import main

    assert main(["plugins", "--json"]) == 0
    listed = {plugin["name"]: plugin for plugin in json.loads(capsys.readouterr().out)}
    assert listed["bgem3"] == {
        "name": "bgem3", "source": "entrypoint", "dist": "poolrunner-bgem3",
        "version": importlib_metadata.version("poolrunner-bgem3"),
        "hooks": ["get_pooler", "request_options", "score_outputs", "supported_tasks"],
    }
    assert main(["plugins", "--options", str(folder), "--json"]) == 0
    options = {option["name"]: option for option in json.loads(capsys.readouterr().out)}
    assert list(options) == ["outputs", "dense_weight", "sparse_weight", "colbert_weight"]
    assert options["outputs"]["default"] == "dense,sparse,colbert" and options["sparse_weight"]["default"] == 0.2


def test_encode_from_the_command_line(runtime, folder, capsys):
    from poolrunner.core.cli.main import main

    [want] = runtime.encode(TEXTS[1], task="m3_embed", outputs="sparse")
    argv = ["encode", "--model", str(folder), "--task", "m3_embed", "--dtype", "float32", "--device", "cpu",
            "--option", "outputs=sparse", TEXTS[1]]
    assert main(argv) == 0
    [line] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert line["output"]["token_ids"] == want["token_ids"].tolist()
    np.testing.assert_array_equal(np.array(line["output"]["weights"], dtype=np.float32), want["weights"])


def test_score_and_rerank_take_the_weights_from_the_command_line(reference, folder, capsys):
    from poolrunner.core.cli.main import main

    weights = {"dense": 1.0, "sparse": 0.3, "colbert": 0.5}
    query, documents = reference.encode(QUERY), [reference.encode(document) for document in DOCUMENTS]
    expected = np.array([combined_score(query, document, weights) for document in documents], dtype=np.float32)
    common = ["--model", str(folder), "--task", "m3_embed", "--dtype", "float32", "--device", "cpu", "--option",
              "dense_weight=1", "--option", "sparse_weight=0.3", "--option", "colbert_weight=0.5", "--query", QUERY]
    assert main(["score", *common, *DOCUMENTS]) == 0
    scored = [json.loads(line)["score"] for line in capsys.readouterr().out.splitlines()]
    np.testing.assert_allclose(scored, expected, rtol=1e-5, atol=1e-6)
    assert main(["rerank", *common, *DOCUMENTS]) == 0
    ranked = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["index"] for row in ranked] == list(np.argsort(-expected, kind="stable"))
    np.testing.assert_allclose([row["score"] for row in ranked], np.sort(expected)[::-1], rtol=1e-5, atol=1e-6)


def test_report_the_largest_deviations():
    """Printed for the record (``pytest -rP``); each part was asserted within ATOL where computed."""
    print(f"max deviation from the reference: {WORST}")
