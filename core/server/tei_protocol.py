"""Request and response bodies of Text Embeddings Inference's API (TEI's ``router/src/http/types.rs``).

As in TEI, unknown fields are ignored rather than refused: TEI's clients send fields TEI does not
read (``huggingface_hub``'s ``text_classification`` sends ``parameters``, ``feature_extraction``
may send ``encoding_format``). Types are strict, so ``"1"`` is never taken for a token id nor
``"true"`` for a boolean.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

TokenIds = list[StrictInt]
EmbedInputs = StrictStr | TokenIds | list[StrictStr | TokenIds]
"""TEI's ``Input``: a text or token ids (one input), or a list mixing both (a batch)."""
TruncationDirection = Literal["Left", "Right", "left", "right"]
PredictInputs = StrictStr | list[StrictStr] | list[list[StrictStr]]
"""TEI's ``PredictInput``: a text, ``[text]`` or a ``[text, text_pair]`` pair (one input), or a
list of ``[text]`` / ``[text, text_pair]`` (a batch); the lengths are checked by the route, so
that a wrong one gets one plain sentence rather than an error per union member."""

_TRUNCATE = Field(default=None, description="Keep the model maximum of tokens of an over-long input "
                                            "(default: the server's --auto-truncate); else it is a 422.")
_DIRECTION = Field(default="Right", description="Which end truncation removes: Right keeps the start.")
_PROMPT_NAME = Field(default=None, description="A prompt of the model's sentence-transformers configuration "
                                               "to prepend to every text.")


class _TeiRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Truncation(_TeiRequest):
    truncate: StrictBool | None = _TRUNCATE
    truncation_direction: TruncationDirection = _DIRECTION


class EmbedRequest(_Truncation):
    """``/embed``: one pooled vector per input."""

    inputs: EmbedInputs
    normalize: StrictBool = True
    prompt_name: StrictStr | None = _PROMPT_NAME
    dimensions: StrictInt | None = Field(default=None, description="Matryoshka size (Matryoshka models only).")


class TokenRequest(_Truncation):
    """``/embed_all`` and ``/embed_sparse``: per-token vectors, or a sparse vector, per input."""

    inputs: EmbedInputs
    prompt_name: StrictStr | None = _PROMPT_NAME


class PredictRequest(_Truncation):
    """``/predict``: every label's score per input, best first."""

    inputs: PredictInputs
    raw_scores: StrictBool = False


class SimilarityInput(_TeiRequest):
    source_sentence: StrictStr
    sentences: list[StrictStr]


class SimilarityParameters(_Truncation):
    prompt_name: StrictStr | None = _PROMPT_NAME


class SimilarityRequest(_TeiRequest):
    """``/similarity``: the cosine of ``source_sentence`` with each of ``sentences``."""

    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None


class DecodeRequest(_TeiRequest):
    """``/decode``: token ids (one list, or a list of lists) back to text."""

    ids: TokenIds | list[TokenIds]
    skip_special_tokens: StrictBool = True


class Prediction(BaseModel):
    score: float
    label: str


class SparseValue(BaseModel):
    index: int
    value: float


class EmbeddingModel(BaseModel):
    pooling: str


class ClassifierModel(BaseModel):
    id2label: dict[str, str]
    label2id: dict[str, int]


class Info(BaseModel):
    """``GET /info``: TEI's ``Info``, in poolrunner's terms where they differ (see each field)."""

    model_id: str
    model_sha: str | None = Field(description="The revision asked for, if any.")
    model_dtype: str
    served_model_name: str
    model_type: dict[Literal["embedding", "classifier", "reranker"], EmbeddingModel | ClassifierModel] = Field(
        description='One key, as TEI: {"embedding": {"pooling"}}, {"classifier": {"id2label", "label2id"}} or, '
                    'for one label, {"reranker": {...}}.')
    max_concurrent_requests: int = Field(description="Most inputs queued or running at once "
                                                     "(--max-waiting-requests); more is a 429.")
    max_input_length: int
    max_batch_tokens: int
    max_batch_requests: int | None
    max_client_batch_size: int = Field(description="Most inputs in one request (--max-inputs-per-request).")
    auto_truncate: bool
    version: str
    sha: str | None = None
    docker_label: str | None = None
