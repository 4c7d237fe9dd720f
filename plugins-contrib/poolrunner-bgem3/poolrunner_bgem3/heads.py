"""BGE-M3's folder layout: a backbone plus two ``torch.save``-d ``nn.Linear`` state dicts.

FlagEmbedding (``BGEM3Model.save`` / ``load_pooler``) writes ``sparse_linear.pt``, a
``Linear(hidden_size, 1)``, and ``colbert_linear.pt``, a ``Linear(hidden_size, colbert_dim)``
(``colbert_dim`` is ``hidden_size`` in the released BAAI/bge-m3), beside the backbone's weights.
"""

from __future__ import annotations

import functools
from pathlib import Path

from torch import nn

from poolrunner.core import ModelConfig, ModelLoadError, load_weights

SPARSE_FILE = "sparse_linear.pt"
COLBERT_FILE = "colbert_linear.pt"

# FlagEmbedding leaves these tokens out of the lexical weights (``_process_token_weights`` in
# its M3 embedder; ``unused_tokens`` in its M3 model's ``_sparse_embedding``).
_UNUSED_TOKENS = ("cls_token", "eos_token", "pad_token", "unk_token")


def has_heads(folder: Path) -> bool:
    """Both BGE-M3 head files are in ``folder``."""
    return (folder / SPARSE_FILE).is_file() and (folder / COLBERT_FILE).is_file()


def load_linear(path: Path, in_features: int, out_features: int | None = None) -> nn.Linear:
    """The float32 ``nn.Linear`` saved at ``path`` (a state dict with ``weight`` ``[out, in]`` and
    an optional ``bias`` ``[out]``).

    :param out_features: The width it must have; ``None``: whatever the file says.
    :raises ModelLoadError: for an unreadable file or a weight of another shape.
    """
    state = load_weights(path)
    if "weight" not in state:
        raise ModelLoadError(f"{path}: not a Linear state dict (no 'weight'; found {sorted(state)[:5]})")
    weight, bias = state["weight"], state.get("bias")
    wrong_width = out_features is not None and weight.shape[0] != out_features
    if weight.ndim != 2 or weight.shape[1] != in_features or wrong_width:
        width = "" if out_features is None else f", out_features={out_features}"
        raise ModelLoadError(f"{path}: expected an nn.Linear with in_features={in_features} (the hidden size){width}; "
                             f"found a weight of shape {list(weight.shape)}")
    linear = nn.Linear(in_features, weight.shape[0], bias=bias is not None)
    linear.load_state_dict({"weight": weight.float(), **({"bias": bias.float()} if bias is not None else {})})
    return linear.eval()


@functools.cache
def unused_token_ids(folder: str) -> tuple[int, ...]:
    """The ids of the tokenizer's CLS, EOS, PAD and UNK tokens (those it defines), sorted.

    Read once per folder: the pooler is built again for each precision ``dtype="auto"`` tries.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    ids = {getattr(tokenizer, f"{name}_id") for name in _UNUSED_TOKENS}
    return tuple(sorted(token for token in ids if token is not None))


def load_heads(model_config: ModelConfig) -> tuple[nn.Linear, nn.Linear]:
    """``(sparse_linear, colbert_linear)`` of the folder, float32.

    :raises ModelLoadError: when either does not fit the backbone's ``hidden_size``.
    """
    folder = Path(model_config.path)
    hidden = model_config.hidden_size
    return load_linear(folder / SPARSE_FILE, hidden, 1), load_linear(folder / COLBERT_FILE, hidden)
