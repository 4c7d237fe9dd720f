"""One settings object: every way of asking for a runtime builds the same RuntimeConfig.

The Python API's keywords, ``Runtime.from_config`` and the command line's flags meet in
:class:`RuntimeConfig`; Ray jobs record it without its speed-only fields.
"""

from __future__ import annotations

import pytest

from poolrunner import ModelOverrides, Runtime, RuntimeConfig
from poolrunner.core.cli.main import main
from poolrunner.core.config import SPEED_ONLY


def test_keywords_and_from_config_load_the_same_settings(model_path, runtime):
    by_keywords = Runtime(model_path, dtype="float32", max_num_seqs=8, pooling_type="MEAN", load_entrypoints=False)
    config = RuntimeConfig(model=str(model_path), dtype="float32", max_num_seqs=8, load_entrypoints=False,
                           overrides=ModelOverrides(pooling_type="MEAN"))
    by_config = Runtime.from_config(config)
    assert by_keywords.config == by_config.config == config
    texts = ["A cat sat on the mat.", "Dogs bark."]
    assert (by_keywords.embed(texts) == by_config.embed(texts)).all()


def test_a_pooling_type_is_taken_in_any_case():
    """sentence-transformers and TEI write pooling modes in lower case."""
    assert RuntimeConfig.from_options(pooling_type="cls").overrides.pooling_type == "CLS"
    assert ModelOverrides(pooling_type="Mean").pooling_type == "MEAN"


def test_an_unknown_option_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match=r"^unknown runtime option\(s\) 'max_batch_tokens'; known: "
                                        r"allowed_media_domains, async_scheduling, "):
        RuntimeConfig.from_options(max_batch_tokens=64)


def test_recorded_settings_leave_out_speed_and_defaults():
    config = RuntimeConfig.from_options("m", dtype="float32", device="cpu", max_num_batched_tokens=64,
                                        max_num_seqs=4, async_scheduling=True, batch_wait_fraction=0.25,
                                        normalize=False)
    assert config.recorded() == {"dtype": "float32", "model": "m", "normalize": False}
    speed = sorted(a.name for a in RuntimeConfig.__attrs_attrs__ if a.metadata.get(SPEED_ONLY))
    assert speed == ["async_scheduling", "batch_wait_fraction", "compile", "device", "max_num_batched_tokens",
                     "max_num_seqs"]


class _Captured(Exception):
    pass


def test_the_command_line_builds_the_config_the_python_api_would(monkeypatch, capsys):
    seen: list[RuntimeConfig] = []

    def capture(cls, config, *, plugins=()):
        seen.append(config)
        raise _Captured

    monkeypatch.setattr(Runtime, "from_config", classmethod(capture))
    with pytest.raises(_Captured):
        main(["embed", "--model", "some/folder", "--dtype", "float32", "--max-num-seqs", "8",
              "--max-num-batched-tokens", "512", "--batch-wait-fraction", "0.5", "--revision", "v1",
              "--disable-plugin", "async_output", "x"])
    assert seen == [RuntimeConfig.from_options(
        "some/folder", revision="v1", dtype="float32", max_num_seqs=8, max_num_batched_tokens=512,
        batch_wait_fraction=0.5, disable_plugins=("async_output",), task="embed",
    )]


def test_a_folder_that_names_no_length_loads_with_max_model_len(tmp_path, capsys):
    """T5's encoder (sentence-t5, GTR) has relative positions and, here, a tokenizer without a
    limit: the load asks for max_model_len, then takes it (the API's keyword and every command's
    --max-model-len), its vectors transformers'."""
    import json

    import numpy as np
    import torch
    import transformers

    from poolrunner.core.errors import ModelLoadError, PromptTooLongError
    from tests.test_attention_rules import _folder

    config = transformers.T5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                   pad_token_id=0, eos_token_id=1, architectures=["T5EncoderModel"])
    folder = _folder(config, tmp_path)
    options = {"dtype": "float32", "pooling_type": "MEAN", "load_entrypoints": False}
    with pytest.raises(ModelLoadError, match="cannot tell the maximum prompt length; pass max_model_len"):
        Runtime(folder, **options)
    runtime = Runtime(folder, **options, max_model_len=32)
    assert runtime.model_config.max_model_len == 32
    ids = [[5, 6, 7, 8, 1], list(range(9, 40)) + [1]]
    model = transformers.T5EncoderModel.from_pretrained(folder).eval()
    with torch.inference_mode():
        expected = [model(input_ids=torch.tensor([row])).last_hidden_state[0].mean(0).numpy() for row in ids]
    np.testing.assert_allclose(runtime.embed(ids, normalize=False), np.stack(expected), rtol=1e-5, atol=1e-6)
    with pytest.raises(PromptTooLongError, match="input 0 has 33 tokens, more than the maximum of 32"):
        runtime.embed([list(range(5, 37)) + [1]])
    assert runtime.embed([ids[0]]).shape == (1, 64)
    assert main(["embed", "--model", folder, "--dtype", "float32", "--pooling-type", "MEAN", "--max-model-len", "32",
                 "--no-entrypoints", "a b c"]) == 0
    vector = json.loads(capsys.readouterr().out)["embedding"]
    np.testing.assert_allclose(vector, runtime.embed(["a b c"])[0], rtol=1e-5, atol=1e-6)
