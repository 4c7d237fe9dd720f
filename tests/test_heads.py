"""A classification head poolrunner does not know is refused at load, never guessed.

The known heads are proven against transformers by the architecture matrix; here a class that
transformers would load but whose head layout poolrunner has no recipe for must fail at load,
naming the class and what is supported, for sequence and token heads alike.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from poolrunner import ModelLoadError, Runtime
from poolrunner.core.model import families
from tests.models.architectures import make_tokenizer

_BERT = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "max_position_embeddings": 128, "pad_token_id": 1}


class CustomHeadForSequenceClassification(transformers.BertForSequenceClassification):
    """Loads like BERT, but its head could do anything: poolrunner must not assume BERT's."""


class CustomHeadForTokenClassification(transformers.BertForTokenClassification):
    """As above, per token."""


@pytest.mark.parametrize(("model_class", "task", "supported"), [
    (CustomHeadForSequenceClassification, "classify", "BertForSequenceClassification"),
    (CustomHeadForTokenClassification, "token_classify", "BertForTokenClassification"),
])
def test_an_unknown_head_layout_is_refused_at_load(tmp_path, monkeypatch, model_class, task, supported):
    # As if transformers shipped the class: the loader resolves config.json's architecture to it.
    monkeypatch.setattr(families, "architecture_class", lambda *args, **kwargs: model_class)
    torch.manual_seed(0)
    config = transformers.BertConfig(**_BERT, num_labels=2, architectures=[model_class.__name__])
    model_class(config).save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        Runtime(str(tmp_path), task=task, dtype="float32", load_entrypoints=False)
    message = str(info.value)
    assert f"({model_class.__name__}) has a classification head poolrunner does not know how to apply" in message
    assert "refused rather than run without it" in message and supported in message
    assert "GenericFor" in message  # the decoder classes are named too
