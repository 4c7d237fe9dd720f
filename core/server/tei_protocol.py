"""Request and response bodies of Text Embeddings Inference's API (TEI's ``router/src/http/types.rs``).

As in TEI, unknown fields are ignored rather than refused: TEI's clients send fields TEI does not
read (``huggingface_hub``'s ``text_classification`` sends ``parameters``, ``feature_extraction``
may send ``encoding_format``). Types are strict, so ``"1"`` is never taken for a token id nor
``"true"`` for a boolean.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from poolrunner.core.frontend import requests as fr
from poolrunner.core.server.json_inputs import json_inputs

TokenIds = list[StrictInt]
EmbedInputs = json_inputs(StrictStr | TokenIds | list[StrictStr | TokenIds])
"""TEI's ``Input``: a text or token ids (one input), or a list mixing both (a batch)."""
TruncationDirection = Literal["Left", "Right", "left", "right"]
PredictInputs = StrictStr | list[StrictStr] | list[list[StrictStr]]
"""TEI's ``PredictInput``: a text, ``[text]`` or a ``[text, text_pair]`` pair (one input), or a
list of ``[text]`` / ``[text, text_pair]`` (a batch); the lengths are checked by the route, so
that a wrong one gets one plain sentence rather than an error per union member."""

_TRUNCATE = Field(default=None, description="Keep the model maximum of tokens of an over-long input "
                                            "(default: the server's --auto-truncate); else it is a 422.")
_DIRECTION = Field(default=None, description="Which end truncation removes: Right keeps the start, Left the end; "
                                             "none: the folder's tokenizer_config.json side, Right unless it says "
                                             "Left.")
_PROMPT_NAME = Field(default=None, description="A prompt of the model's sentence-transformers configuration "
                                               "to prepend to every text.")


class _TeiRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Any = Field(default=None, description="Not TEI's: the name of a served model or LoRA adapter picks it, "
                                                 "as on the other routes; any other value is ignored, as TEI "
                                                 "ignores fields it does not know.")


def tei_tokenization(truncate: bool | None, direction: str | None, auto_truncate: bool,
                     prompt_name: str | None = None) -> fr.Tokenization:
    """TEI's truncation as poolrunner's: ``truncate`` (``None``: the server's ``auto_truncate``)
    keeps the model maximum, from the ``direction`` end (``None``: the folder's own side, right
    unless its ``tokenizer_config.json`` says left, as TEI's tokenizer then cuts)."""
    keep = truncate if truncate is not None else auto_truncate
    side = None if direction is None else "left" if direction.lower() == "left" else "right"
    return fr.Tokenization(truncate_prompt_tokens=-1 if keep else None, truncation_side=side, prompt_name=prompt_name)


class _Truncation(_TeiRequest):
    truncate: StrictBool | None = _TRUNCATE
    truncation_direction: TruncationDirection | None = _DIRECTION

    def tokenization(self, auto_truncate: bool, prompt_name: str | None = None) -> fr.Tokenization:
        """:func:`tei_tokenization` of this body."""
        return tei_tokenization(self.truncate, self.truncation_direction, auto_truncate, prompt_name)


class EmbedRequest(_Truncation):
    """``/embed``: one pooled vector per input."""

    inputs: EmbedInputs
    normalize: StrictBool = True
    prompt_name: StrictStr | None = _PROMPT_NAME
    dimensions: StrictInt | None = Field(default=None, description="Matryoshka size (Matryoshka models only).")

    def to_request(self, inputs: list[fr.Input], auto_truncate: bool) -> fr.EncodeRequest:
        """``/embed``'s request of ``inputs`` (the body's, checked by the route)."""
        return fr.EncodeRequest(inputs=inputs, task="embed", dimensions=self.dimensions, normalize=self.normalize,
                                tokenization=self.tokenization(auto_truncate, self.prompt_name))


class TokenRequest(_Truncation):
    """``/embed_all`` and ``/embed_sparse``: per-token vectors, or a sparse vector, per input."""

    inputs: EmbedInputs
    prompt_name: StrictStr | None = _PROMPT_NAME

    def to_request(self, inputs: list[fr.Input], auto_truncate: bool, task: str) -> fr.EncodeRequest:
        """The request of ``inputs`` for ``task`` (``/embed_all``: token_embed, ``/embed_sparse``: sparse_embed)."""
        return fr.EncodeRequest(inputs=inputs, task=task, tokenization=self.tokenization(auto_truncate,
                                                                                          self.prompt_name))


class PredictRequest(_Truncation):
    """``/predict``: every label's score per input, best first."""

    inputs: PredictInputs
    raw_scores: StrictBool = False

    def to_request(self, inputs: list[fr.Input], auto_truncate: bool) -> fr.ClassifyRequest:
        """``/predict``'s request of ``inputs``: TEI's scores (a sigmoid of one logit, a softmax
        over several, whatever the folder names); ``raw_scores`` skips the activation."""
        return fr.ClassifyRequest(inputs=inputs, use_activation=False if self.raw_scores else None,
                                  activation="labels", tokenization=self.tokenization(auto_truncate))


class SimilarityInput(_TeiRequest):
    source_sentence: StrictStr
    sentences: list[StrictStr]


class SimilarityParameters(_Truncation):
    prompt_name: StrictStr | None = _PROMPT_NAME


class SimilarityRequest(_TeiRequest):
    """``/similarity``: the cosine of ``source_sentence`` with each of ``sentences``."""

    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None

    def to_request(self, auto_truncate: bool) -> fr.EncodeRequest:
        """The embeddings ``/similarity`` compares: the source sentence, then each sentence."""
        options = self.parameters or SimilarityParameters()
        return fr.EncodeRequest(inputs=[self.inputs.source_sentence, *self.inputs.sentences], task="embed",
                                tokenization=options.tokenization(auto_truncate, options.prompt_name))


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
    tokenization_workers: int = Field(default=1, description="Requests are tokenized one at a time (one shared "
                                                             "tokenizer, its batches on all cores).")
    version: str
    sha: str | None = None
    docker_label: str | None = None
