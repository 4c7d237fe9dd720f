"""Builds a seeded tiny BGE-M3 folder for the tests: an XLM-RoBERTa backbone with a
SentencePiece-style (Unigram) tokenizer, and the two heads FlagEmbedding saves beside it.
Imported by the test modules (not a test module itself).

The tokenizer is transformers' ``XLMRobertaTokenizer`` (the tokenizers-backed Unigram with
Metaspace pre-tokenization and XLM-R's ``<s> A </s>`` template) over a small fixed vocabulary,
with XLM-R's special ids: ``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3, ``<mask>`` last.
Characters outside the vocabulary (``€``) become ``<unk>``.
"""

from __future__ import annotations

import string
from pathlib import Path

HIDDEN = 32
MAX_TOKENS = 128
WORDS = (
    "the a an and is of on in to what who wrote about cat dog sat mat paris capital city largest france "
    "bge m3 model embedding dense sparse lexical matching retrieval vector multi interaction ok price"
).split()
CHARACTERS = string.ascii_letters + string.digits + ".,?!'-"


def xlmr_tokenizer():
    """A small XLM-R tokenizer: whole words score above their spelling, so known words are one
    piece and other text falls back to single characters."""
    from transformers import XLMRobertaTokenizer

    pieces = dict.fromkeys(("<s>", "<pad>", "</s>", "<unk>"), 0.0)
    pieces["▁"] = -4.0
    for word in WORDS:
        pieces.setdefault(f"▁{word}", -2.0)
    for character in CHARACTERS:
        pieces.setdefault(f"▁{character}", -5.0)
        pieces.setdefault(character, -6.0)
    pieces["<mask>"] = 0.0
    return XLMRobertaTokenizer(vocab=list(pieces.items()), model_max_length=MAX_TOKENS)


def save_linear(path: Path, in_features: int, out_features: int, seed: int) -> None:
    """A seeded ``nn.Linear`` state dict, saved as FlagEmbedding saves its heads (``torch.save``)."""
    import torch

    torch.manual_seed(seed)
    torch.save(torch.nn.Linear(in_features, out_features).state_dict(), path)


def write_bgem3_folder(folder: Path, *, seed: int = 3, colbert_dim: int = HIDDEN) -> Path:
    """A seeded 2-layer ``XLMRobertaModel`` (hidden 32, weights of std 0.2 so that rows differ
    visibly), the tokenizer above, ``sparse_linear.pt`` (``Linear(32, 1)``) and
    ``colbert_linear.pt`` (``Linear(32, colbert_dim)``).

    With seed 3 the test texts meet every sparse rule: zero and positive token weights, special
    tokens with positive weights, and repeated ids with different weights (checked by
    ``test_the_texts_exercise_every_sparse_rule``)."""
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaModel

    folder.mkdir(parents=True)
    tokenizer = xlmr_tokenizer()
    tokenizer.save_pretrained(folder)
    config = XLMRobertaConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=MAX_TOKENS + 2, type_vocab_size=1, initializer_range=0.2,
        pad_token_id=1, bos_token_id=0, eos_token_id=2,
    )
    torch.manual_seed(seed)
    XLMRobertaModel(config).save_pretrained(folder)
    save_linear(folder / "sparse_linear.pt", HIDDEN, 1, seed + 1)
    save_linear(folder / "colbert_linear.pt", HIDDEN, colbert_dim, seed + 2)
    return folder
