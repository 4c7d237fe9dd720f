"""An independent BGE-M3 reference, written from FlagEmbedding's published formulas over
transformers' ``XLMRobertaModel`` (eager attention, float32, one text at a time, so no padding),
with the heads applied in float64. It shares no code with the plugin.

Formulas (FlagEmbedding ``finetune/embedder/encoder_only/m3/modeling.py`` and
``inference/embedder/encoder_only/m3.py``), for ``h`` the last hidden states of one text:

- dense ``h[0] / |h[0]|``;
- sparse: token weights ``relu(h W_s^T + b_s)``; ``_process_token_weights`` keeps, per token id,
  the largest weight above 0, skipping the ids of the tokenizer's cls, eos, pad and unk tokens;
- colbert ``normalize(h[1:] W_c^T + b_c)`` row by row;
- scores: dense ``q . d``; sparse ``compute_lexical_matching_score`` (sum over shared ids of
  ``w_q * w_d``); colbert ``colbert_score`` (sum over query rows of the max dot product with the
  document rows, divided by the query rows); combined ``compute_score``'s
  ``(w0 * dense + w1 * sparse + w2 * colbert) / (w0 + w1 + w2)``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, XLMRobertaModel


def _head(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state["weight"].double(), state["bias"].double()


class M3Reference:
    """``encode(text)`` and the scores, for one BGE-M3 folder."""

    def __init__(self, folder: Path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.model = XLMRobertaModel.from_pretrained(folder, local_files_only=True, attn_implementation="eager").eval()
        self.sparse = _head(folder / "sparse_linear.pt")
        self.colbert = _head(folder / "colbert_linear.pt")
        special = self.tokenizer.special_tokens_map
        self.unused = {self.tokenizer.convert_tokens_to_ids(special[name])
                       for name in ("cls_token", "eos_token", "pad_token", "unk_token") if name in special}

    def encode(self, text: str) -> dict:
        """``{"ids", "token_weights", "dense", "lexical", "colbert"}`` of one text (float64)."""
        ids = self.tokenizer(text)["input_ids"]
        with torch.inference_mode():
            hidden = self.model(input_ids=torch.tensor([ids])).last_hidden_state[0].double()
        token_weights = torch.relu(hidden @ self.sparse[0].T + self.sparse[1])[:, 0].tolist()
        lexical: dict[int, float] = {}
        for weight, token in zip(token_weights, ids, strict=True):
            if token not in self.unused and weight > 0 and weight > lexical.get(token, 0.0):
                lexical[token] = weight
        colbert = hidden[1:] @ self.colbert[0].T + self.colbert[1]
        return {"ids": ids, "token_weights": token_weights, "dense": (hidden[0] / hidden[0].norm()).numpy(),
                "lexical": lexical, "colbert": (colbert / colbert.norm(dim=1, keepdim=True)).numpy()}


def dense_score(query: dict, document: dict) -> float:
    return float(query["dense"] @ document["dense"])


def sparse_score(query: dict, document: dict) -> float:
    return sum(weight * document["lexical"][token] for token, weight in query["lexical"].items()
               if token in document["lexical"])


def colbert_score(query: dict, document: dict) -> float:
    token_scores = torch.einsum("in,jn->ij", torch.from_numpy(query["colbert"]), torch.from_numpy(document["colbert"]))
    return float(token_scores.max(-1).values.sum() / len(query["colbert"]))


MODE_SCORES = {"dense": dense_score, "sparse": sparse_score, "colbert": colbert_score}


def combined_score(query: dict, document: dict, weights: dict[str, float]) -> float:
    """The weighted mean of the modes in ``weights`` (FlagEmbedding's ``compute_score``)."""
    total = sum(weight * MODE_SCORES[mode](query, document) for mode, weight in weights.items())
    return total / sum(weights.values())
