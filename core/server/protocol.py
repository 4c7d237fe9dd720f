"""Request and response bodies, in the OpenAI shape for ``/v1/embeddings`` and vLLM's for the rest.

Request models forbid unknown fields and use strict types, so ``"1"`` is never taken for a
token id nor ``1.0`` for an integer: such input is a 400 naming the field. A server started
with ``allow_extra_fields`` drops and logs unknown fields instead (vLLM's behaviour), and one with
``truncate_prompt_tokens`` gives that value to a body that sets none: the middleware sets
:data:`BODY_SETTINGS` to the server's settings while a request is read.
"""

from __future__ import annotations

import json
import logging
from contextvars import ContextVar
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    create_model,
    model_validator,
)
from pydantic_core import PydanticCustomError

from poolrunner.core.frontend import requests as fr
from poolrunner.core.frontend.quantize import Precision
from poolrunner.core.plugin_api.options import RequestOptions
from poolrunner.core.server.errors import ApiError
from poolrunner.core.server.json_inputs import json_inputs, json_inputs_with_pairs
from poolrunner.core.server.settings import ServerSettings
from poolrunner.core.server.tei_protocol import tei_tokenization
from poolrunner.core.types import TruncationSide
from poolrunner.core.validators import unencodable_at

logger = logging.getLogger("poolrunner.core.server")

LOGGED_NAMES = 10
"""Unknown field names logged per request; their number is logged beyond it."""
LOGGED_NAME_CHARS = 64
"""Characters of an unknown field's name logged."""
# ServerSettings is frozen, so one shared default is safe.
BODY_SETTINGS: ContextVar[ServerSettings] = ContextVar("poolrunner_body_settings", default=ServerSettings())  # noqa: B039
"""The settings of the server whose request is being read (set by its middleware)."""

TokenIds = list[StrictInt]
EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
"""``float``: JSON numbers; ``base64``: each array's bytes in base64; ``bytes`` (vLLM): one
``application/octet-stream`` body of every array's bytes in input order, described by the
``metadata`` header (JSON); ``bytes_only``: the same body without the header."""
EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
"""The element type of float arrays in ``base64`` and ``bytes`` payloads (vLLM's ``embed_dtype``;
the fp8 types are torch's ``float8_e4m3fn`` and ``float8_e5m2``, one byte a value)."""
Endianness = Literal["native", "big", "little"]
"""Byte order of ``base64`` and ``bytes`` payloads; ``native`` is the server's (vLLM's default)."""
Vector = list[float] | list[int] | str
"""A float list (ints for a quantized ``precision``), or with ``encoding_format="base64"`` the
base64 of its bytes (``embed_dtype``, ``endianness``; int8/uint8 bytes for a quantized one)."""
PoolingArray = list[int] | list[float] | list[list[int]] | list[list[float]] | str
"""One ``/pooling`` output in its own dtype: ints (e.g. SPLADE's ``token_ids``) stay JSON ints, floats
are float32; with ``encoding_format="base64"`` the base64 of its row-major bytes, int64 for integer
outputs and ``embed_dtype`` (default float32) for float ones, in ``endianness`` order."""
Pair = tuple[StrictStr, StrictStr]
"""A ``[text, text_pair]`` pair, tokenized as the model's tokenizer pairs two texts."""


def _whole_characters(text: str) -> str:
    """``text`` when UTF-8 can write it, as every answer is written.

    :raises PydanticCustomError: for a lone surrogate (half of a UTF-16 pair), naming its position.
    """
    position = unencodable_at(text)
    if position is not None:
        raise PydanticCustomError(
            "unicode_text", "not valid Unicode text: character {position} is U+{code}, a lone surrogate (half of a "
            "UTF-16 pair); send whole characters", {"position": position, "code": f"{ord(text[position]):04X}"},
        )
    return text


EchoedStr = Annotated[StrictStr, AfterValidator(_whole_characters)]
"""A string that answers send back (``request_id``): valid Unicode, so that they can be written."""


class _Body(BaseModel):
    """A request body: unknown fields are a 400 unless the server allows them
    (:data:`BODY_SETTINGS`); then they are logged and dropped."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _drop_extra_fields(cls, data: Any) -> Any:
        if not BODY_SETTINGS.get().allow_extra_fields or not isinstance(data, dict):
            return data
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        extra = [name for name in data if name not in known]
        if not extra:
            return data
        # Client text in a log line: quoted (a newline cannot forge a line) and capped.
        shown = ", ".join(repr(name[:LOGGED_NAME_CHARS]) + ("..." if len(name) > LOGGED_NAME_CHARS else "")
                          for name in extra[:LOGGED_NAMES])
        more = f" and {len(extra) - LOGGED_NAMES} more" if len(extra) > LOGGED_NAMES else ""
        logger.warning("ignoring fields the request sent that %s does not know: %s%s", cls.__name__, shown, more)
        return {name: value for name, value in data.items() if name in known}


class _Request(_Body):
    plugin_option_names: ClassVar[frozenset[str]] = frozenset()
    """The body fields :func:`with_plugin_options` added: the plugins' request options."""

    model: StrictStr | None = Field(default=None, description="Must be a served model name when given.")
    truncate_prompt_tokens: StrictInt | None = Field(
        default=None, description="Keep this many tokens of each input (-1: the model maximum); "
                                  "without it (and without the server's --truncate-prompt-tokens) a too long "
                                  "input is a 400.")
    truncation_side: TruncationSide | None = Field(
        default=None, description="vLLM's: which end truncate_prompt_tokens keeps, right (the first tokens) or "
                                  "left (the last); none: the folder's tokenizer_config.json side, right unless "
                                  "it says left.")
    user: StrictStr | None = Field(default=None, description="Accepted (OpenAI, vLLM); unused.")
    priority: StrictInt | None = Field(
        default=None, description="vLLM's: lower runs first (default 0); requests of equal priority take turns.")
    request_id: EchoedStr | None = Field(
        default=None, description="vLLM: the answer's id is the endpoint's prefix and this id (default: random).")

    def plugin_options(self) -> dict[str, Any]:
        """The plugin request options this body sets, by name (those it leaves out are not passed)."""
        return {name: getattr(self, name) for name in self.plugin_option_names if getattr(self, name) is not None}

    def tokenization(self, add_special_tokens: bool = True) -> fr.Tokenization:
        """The body's prompt fields; ``truncate_prompt_tokens`` unset: the server's default."""
        keep = self.truncate_prompt_tokens
        return fr.Tokenization(truncate_prompt_tokens=BODY_SETTINGS.get().truncate_prompt_tokens if keep is None
                               else keep, truncation_side=self.truncation_side,
                               add_special_tokens=add_special_tokens)


class ContentPart(_Body):
    """A text part of a chat message's content (vLLM's ``{"type": "text", "text": ...}``)."""

    type: Literal["text"]
    text: StrictStr


class ImageUrl(_Body):
    """OpenAI's ``image_url`` object: ``url`` is a ``data:image/...;base64,`` URL, or an
    ``http(s)`` URL the server fetches only from its allowed media domains; ``detail`` is
    accepted and unused (the model's own processor decides the resolution)."""

    url: StrictStr
    detail: StrictStr | None = None


class ImagePart(_Body):
    """An image part of a chat message's content (OpenAI's and vLLM's ``{"type": "image_url",
    "image_url": {"url": ...}}``)."""

    type: Literal["image_url"]
    image_url: ImageUrl


Part = Annotated[ContentPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    """One chat message (OpenAI's shape): ``role`` and ``content`` (a text, or text and image
    parts; text parts are joined with newlines as vLLM's ``string`` content format joins them); any
    other field (``name``...) reaches the chat template as sent."""

    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: StrictStr | list[Part] | None = None

    def text(self) -> str:
        """The message's text: ``content``, or its text parts joined with newlines."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content if isinstance(part, ContentPart))
        return self.content or ""

    def image_urls(self) -> list[str]:
        """The URLs of the message's image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template reads it: ``content`` as one text."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = self.text()
        return message


def text_image_prompt(messages: list[ChatMessage]) -> fr.Input:
    """The one input ``messages`` make for a text-image model (CLIP), as vLLM reads them: its
    fallback chat template for CLIP concatenates the messages' texts, and CLIP's processor takes a
    prompt of text only or of one image only. So the messages' image part, when there is one, is
    the input; else their texts, concatenated.

    :raises ApiError: 400 for more than one image, or text beside the image (vLLM refuses both).
    """
    urls = [url for message in messages for url in message.image_urls()]
    text = "".join(message.text() for message in messages)
    if len(urls) > 1:
        raise ApiError(400, f"messages hold {len(urls)} images: a text-image model embeds one image per prompt "
                            "(vLLM's limit for CLIP); send each image in its own request, or the images as input",
                       param="messages")
    if urls and text:
        raise ApiError(400, "messages hold text and an image: a text-image model (CLIP) embeds a text or an image, "
                            "not both in one prompt (as vLLM refuses it); send them as two inputs", param="messages")
    if urls:
        return fr.ImageURL(urls[0])
    if not text:
        raise ApiError(400, "messages hold no text and no image", param="messages")
    return text


class _Chat(_Body):
    """vLLM's chat form of the pooling requests: ``messages`` instead of ``input``."""

    messages: list[ChatMessage] | None = Field(
        default=None, description="A chat instead of input, rendered with the model's chat template (vLLM).")
    add_generation_prompt: StrictBool = False
    continue_final_message: StrictBool = False
    chat_template: StrictStr | None = Field(
        default=None, description="Refused: the model's own chat template renders messages.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="Extra variables for the chat template.")
    add_special_tokens: StrictBool | None = Field(
        default=None, description="Add the tokenizer's special tokens to each text (default true for input, "
                                  "false for messages: the chat template writes its own).")

    def chat_fields(self) -> list[str]:
        """The fields of the chat form this body sets: they apply to ``messages`` only."""
        return [name for name in ("add_generation_prompt", "continue_final_message", "chat_template",
                                  "chat_template_kwargs", "tools") if name in self.model_fields_set]


class _Encoding(_Body):
    encoding_format: EncodingFormat = "float"
    embed_dtype: EmbedDType = Field(
        default="float32", description="Element type of float arrays in base64 and bytes payloads; "
                                       "JSON floats are float32 values.")
    endianness: Endianness = Field(default="native", description="Byte order of base64 and bytes payloads.")


class _Quantize(_Body):
    precision: Precision = Field(
        default="float32", description="poolrunner: sentence-transformers' precision (int8, uint8, binary, "
                                       "ubinary) after dimensions and normalization; JSON ints, or their bytes.")
    ranges: list[list[StrictFloat | StrictInt]] | None = Field(
        default=None, description="int8/uint8: [2, d] per-dimension minima and maxima (default: calibrated on "
                                  "this request's embeddings).")


Inputs = json_inputs(StrictStr | TokenIds | list[StrictStr | TokenIds])
"""A text, one token-id list, or a list of texts and token-id lists in any order."""
PairInputs = json_inputs_with_pairs(StrictStr | TokenIds | list[StrictStr | TokenIds | Pair])
""":data:`Inputs`, the list's items ``[text, text_pair]`` pairs too."""


class EmbeddingRequest(_Request, _Chat, _Encoding, _Quantize):
    """OpenAI's embeddings request with vLLM's fields: ``input`` (a text, texts, token ids or
    token-id lists) or ``messages`` (vLLM's chat form); or infinity's, which sends ``modality``
    (its client always does) and ``dimensions: 0`` for the full size."""

    input: Inputs = None
    dimensions: StrictInt | None = Field(
        default=None, description="Matryoshka size (Matryoshka models only); in infinity's body (with modality) "
                                  "0 is the full size, as infinity reads it.")
    normalize: StrictBool | None = None
    use_activation: StrictBool | None = Field(default=None, description="vLLM: normalize (normalize wins).")
    modality: Literal["text", "image", "audio"] | None = Field(
        default=None, description="infinity's: image reads each input as an image URL (data:image/...;base64, or "
                                  "http(s) from an allowed media domain); text (default) reads texts, where a "
                                  "data:image/ URL is an image for a text-image model; audio is not served.")

    def to_request(self, inputs: list[fr.Input], add_special_tokens: bool) -> fr.EncodeRequest:
        """The request of ``inputs`` (:meth:`PoolingService.prompts` reads them from ``input`` or
        ``messages``), each an image URL with ``modality="image"``.

        :raises ApiError: 400 for ``modality`` with ``messages``, ``audio``, or token ids as images.
        """
        inputs = self.modal_inputs(inputs)
        full_size = self.modality is not None and self.dimensions == 0  # infinity's default; OpenAI refuses 0
        return fr.EncodeRequest(inputs=inputs, task="embed", dimensions=None if full_size else self.dimensions,
                                normalize=self.normalize,
                                use_activation=self.use_activation, precision=self.precision, ranges=self.ranges,
                                tokenization=self.tokenization(add_special_tokens))

    def modal_inputs(self, inputs: list[fr.Input]) -> list[fr.Input]:
        """``inputs`` as :attr:`modality` says (infinity's field): image URLs for ``image``.

        :raises ApiError: as :meth:`to_request`.
        """
        if self.modality is None or self.modality == "text":
            if self.modality is not None and self.messages is not None:
                raise ApiError(400, "modality applies to input, not to messages", param="modality")
            return inputs
        if self.messages is not None:
            raise ApiError(400, "modality applies to input, not to messages", param="modality")
        if self.modality == "audio":
            raise ApiError(400, "modality 'audio' is not served: poolrunner embeds texts and images", param="modality")
        for index, item in enumerate(inputs):
            if not isinstance(item, str):
                raise ApiError(400, f"input[{index}]: modality 'image' takes image URLs (data:image/...;base64, "
                                    "or http(s)), not token ids", param="input")
        return [fr.ImageURL(item) for item in inputs]  # type: ignore[arg-type]


class PoolingHttpRequest(_Request, _Chat, _Encoding, _Quantize):
    """vLLM's ``/pooling``: any task this server's runtime serves, per-token outputs included;
    ``[text, text_pair]`` pairs as ``/classify`` takes them (a cross-encoder's ``classify``)."""

    input: PairInputs = None
    task: StrictStr | None = Field(default=None, description="Defaults to the served task.")
    dimensions: StrictInt | None = None
    normalize: StrictBool | None = None
    use_activation: StrictBool | None = None

    def to_request(self, inputs: list[fr.Input], add_special_tokens: bool) -> fr.EncodeRequest:
        """As :meth:`EmbeddingRequest.to_request`, for any task, with the plugins' options."""
        return fr.EncodeRequest(inputs=inputs, task=self.task, dimensions=self.dimensions, normalize=self.normalize,
                                use_activation=self.use_activation, precision=self.precision, ranges=self.ranges,
                                options=self.plugin_options(), tokenization=self.tokenization(add_special_tokens))


_JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string"}
BodyT = TypeVar("BodyT", bound=BaseModel)


def with_plugin_options(base: type[BodyT], options: RequestOptions) -> type[BodyT]:
    """``base`` (``/pooling``'s, ``/score``'s or ``/rerank``'s body) with one optional body field
    per plugin request option, so the OpenAPI schema shows them (with their JSON type). The
    fields take any JSON value: the runtime's
    :class:`~poolrunner.core.plugin_api.options.RequestOptions` checks it, so a wrong type gets
    the message the Python API and the CLI give, naming the plugin."""
    fields: dict[str, Any] = {
        entry.option.name: (
            Any,
            Field(default=None, json_schema_extra={"type": _JSON_TYPES[entry.option.type]},
                  description=f"{entry.option.help} Plugin {entry.plugin!r}; tasks "
                              f"{sorted(entry.option.tasks)}; default {entry.option.default!r}."),
        )
        for entry in options
    }
    if not fields:
        return base
    model = create_model(base.__name__, __base__=base, __doc__=base.__doc__, **fields)
    model.plugin_option_names = frozenset(fields)
    return model


class ClassificationRequest(_Request, _Chat):
    """vLLM's ``/classify``: texts, token ids, ``[text, text_pair]`` pairs (cross-encoders, pair
    classifiers; a list may mix pairs and texts), or a chat as ``messages``; or infinity's body,
    which sends ``raw_scores`` (its client always does) and gets infinity's answer."""

    input: PairInputs = None
    use_activation: StrictBool | None = None
    raw_scores: StrictBool | None = Field(
        default=None, description="infinity's: true answers the raw logits (use_activation false); its body "
                                  "gets infinity's answer (every label's score per input, best first).")

    def api(self) -> Literal["infinity", "vllm"]:
        """``"infinity"`` for infinity's body (``raw_scores``), else ``"vllm"``.

        :raises ApiError: 400 for ``raw_scores`` with ``use_activation`` (one switch, two names).
        """
        if self.raw_scores is None:
            return "vllm"
        if self.use_activation is not None:
            raise ApiError(400, "raw_scores (infinity's) and use_activation (vLLM's) set the same thing: send one",
                           param="raw_scores")
        return "infinity"

    def to_request(self, inputs: list[fr.Input], add_special_tokens: bool) -> fr.ClassifyRequest:
        """As :meth:`EmbeddingRequest.to_request`; ``raw_scores`` skips the activation."""
        use_activation = False if self.raw_scores else self.use_activation
        return fr.ClassifyRequest(inputs=inputs, use_activation=use_activation,
                                  tokenization=self.tokenization(add_special_tokens))


ScoreSide = json_inputs(StrictStr | list[StrictStr])
"""One side of a score request: a text, or a list of texts (checked by the core)."""

SCORE_FORMS: tuple[tuple[str, str], ...] = (
    ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"),
)
"""The field pairs of vLLM's score bodies, newest first; a request uses exactly one."""


class ScoreRequest(_Request):
    """vLLM's ``/score``: the first side against the second as 1:1, 1:N or N:N, sent as one of
    :data:`SCORE_FORMS` (``queries``/``documents`` today; ``items``, ``data_1``/``data_2`` and
    ``text_1``/``text_2`` from older clients). Text only: vLLM's multimodal items are refused."""

    queries: ScoreSide = None
    documents: ScoreSide = None
    items: ScoreSide = None
    data_1: ScoreSide = None
    data_2: ScoreSide = None
    text_1: ScoreSide = None
    text_2: ScoreSide = None
    use_activation: StrictBool | None = None
    max_tokens_per_doc: StrictInt | None = Field(
        default=None, description="vLLM's: keep each document's (second side's) first tokens; special tokens not "
                                  "counted; 0 or none: whole documents.")

    def sides(self) -> tuple[tuple[str, str], ScoreSide, ScoreSide]:
        """The form used (its two field names) and its two sides.

        :raises ApiError: 400 unless the body sets exactly the two fields of one form.
        """
        given = [name for name in _SCORE_FIELDS if getattr(self, name) is not None]
        for form in SCORE_FORMS:
            if set(given) == set(form):
                return form, getattr(self, form[0]), getattr(self, form[1])
        forms = ", ".join(f"{first} + {second}" for first, second in SCORE_FORMS)
        raise ApiError(400, f"send exactly one pair of fields ({forms}); got {', '.join(given) or 'none of them'}",
                       param=given[0] if given else None)

    def to_request(self) -> fr.ScoreRequest:
        """The scoring this body asks for; errors name its fields (``documents[2]``, ``text_2``).

        :raises ApiError: as :meth:`sides`.
        """
        form, first, second = self.sides()
        return fr.ScoreRequest(queries=first, documents=second, sides=form, use_activation=self.use_activation,
                               max_tokens_per_doc=_none_for_zero(self.max_tokens_per_doc),
                               options=self.plugin_options(), tokenization=self.tokenization())


_SCORE_FIELDS = tuple(dict.fromkeys(name for form in SCORE_FORMS for name in form))


class RerankDocumentInput(BaseModel):
    """A document sent as an object (Cohere v1, Jina): ``text`` is ranked; Cohere v1 keeps any
    other field, so they come back in the result's ``document``."""

    model_config = ConfigDict(extra="allow")

    text: StrictStr


def _document_objects(documents: Any) -> Any:
    """``documents`` with each ``{"text": ...}`` object read as a :class:`RerankDocumentInput`;
    items of other kinds are left for the core to name.

    :raises PydanticCustomError: for an object without a string ``text``, naming its index.
    """
    if not isinstance(documents, list):
        return documents
    objects = {index: item for index, item in enumerate(documents) if isinstance(item, dict)}
    for index, item in objects.items():
        if not isinstance(item.get("text"), str):
            raise PydanticCustomError("document_object", 'item {index} is an object without a "text" string; send '
                                      'a text or {"text": ...}', {"index": index})
    return [RerankDocumentInput.model_validate(objects[index]) if index in objects else item
            for index, item in enumerate(documents)]


RerankDocuments = Annotated[json_inputs(StrictStr | list[StrictStr | RerankDocumentInput]),
                            AfterValidator(_document_objects)]
"""Rerank's ``documents``: a text, or a list of texts and ``{"text": ...}`` objects."""


class RerankRequest(_Request):
    """vLLM's, Jina's and Cohere's (v1 and v2) rerank body; TEI's (``texts``); or infinity's
    (``documents`` with ``raw_scores``, which its client always sends).

    ``documents`` is a list of texts or ``{"text": ...}`` objects, or one text (one document, as
    vLLM takes it). ``max_tokens_per_doc`` keeps each document's first tokens (special tokens
    not counted); the query is never cut. TEI's body has ``texts`` and its own fields instead;
    ``raw_scores`` (TEI's and infinity's) skips the cross-encoder's activation. :meth:`api` tells
    which body it is, and so the answer's shape.
    """

    query: json_inputs(StrictStr)  # the core's check: `query must be a string, got None`
    documents: RerankDocuments = None
    top_n: StrictInt | None = Field(default=None, description="Keep the best top_n; 0 or none: all (vLLM's 0; "
                                                              "infinity's body takes no 0).")
    return_documents: StrictBool | None = Field(
        default=None, description="Default true: each result carries its document (vLLM always, Jina by default); "
                                  "false leaves them out (Cohere v1's default).")
    max_tokens_per_doc: StrictInt | None = Field(
        default=None, description="Keep each document's first tokens (Cohere, vLLM); special tokens not counted; "
                                  "0 or none: whole documents (vLLM's 0).")
    use_activation: StrictBool | None = Field(
        default=None, description="vLLM's: false scores raw logits (a cross-encoder's, without its sigmoid).")
    priority: StrictInt | None = Field(default=None, description="Cohere v2's, vLLM's: lower runs first (default 0).")
    texts: json_inputs(list[StrictStr] | None) = Field(default=None,
                                                       description="TEI's documents; the answer is then TEI's.")
    raw_scores: StrictBool | None = Field(
        default=None, description="TEI, infinity: scores without the activation; with documents, the body and the "
                                  "answer are infinity's.")
    return_text: StrictBool | None = Field(default=None, description="TEI: each result carries its text.")
    truncate: StrictBool | None = Field(default=None, description="TEI: cut over-long pairs to the model maximum.")
    truncation_direction: Literal["Left", "Right", "left", "right"] | None = Field(
        default=None, description="TEI: which end truncate removes (default: the folder's side, Right unless its "
                                  "tokenizer_config.json says Left).")

    def api(self) -> Literal["tei", "infinity", "rerank"]:
        """``"tei"`` for TEI's body (``texts``), ``"infinity"`` for infinity's (``documents`` and
        ``raw_scores``), else ``"rerank"`` (vLLM, Jina, Cohere).

        :raises ApiError: 400 for a body that mixes TEI's fields with the others, that has neither
            list, or infinity's body with document objects (infinity's documents are texts).
        """
        tei = [name for name in _TEI_RERANK_FIELDS if name in self.model_fields_set]
        rerank = [name for name in _RERANK_FIELDS if name in self.model_fields_set]
        if tei and rerank:
            raise ApiError(400, f"{', '.join(rerank)} cannot be combined with TEI's fields ({', '.join(tei)}): send "
                                "documents (vLLM, Jina, Cohere, infinity) or texts (TEI)", param=rerank[0])
        if self.texts is None and self.documents is None:
            raise ApiError(400, "send documents (vLLM, Jina, Cohere, infinity) or texts (TEI)", param="documents")
        if self.texts is None and tei:
            raise ApiError(400, f"{', '.join(tei)} belong to TEI's body, which sends texts", param=tei[0])
        if self.texts is not None:
            return "tei"
        if self.raw_scores is None:
            return "rerank"
        if self.use_activation is not None:
            raise ApiError(400, "raw_scores (infinity's) and use_activation (vLLM's) set the same thing: send one",
                           param="raw_scores")
        if isinstance(self.documents, list) and any(isinstance(d, RerankDocumentInput) for d in self.documents):
            raise ApiError(400, "infinity's body (raw_scores) takes documents as texts, not objects",
                           param="documents")
        return "infinity"

    def document_list(self) -> Any:
        """``documents`` as a list (one text is one document); a value of another kind as it is,
        for the core to name.

        :raises ApiError: 400 for a document object's other field holding text that is not valid
            Unicode (a lone surrogate): results send those fields back, and could not be written.
        """
        if not isinstance(self.documents, list):  # one text is one document; anything else: the core's error
            return [self.documents] if isinstance(self.documents, str) else self.documents
        documents = list(self.documents)
        for index, document in enumerate(documents):
            extra = document.model_extra if isinstance(document, RerankDocumentInput) else None
            for name, value in (extra or {}).items():
                try:
                    json.dumps(value, ensure_ascii=False).encode("utf-8")
                except UnicodeEncodeError:
                    raise ApiError(400, f"documents[{index}].{name} is not valid Unicode text: it holds a lone "
                                        "surrogate (half of a UTF-16 pair); send whole characters",
                                   param="documents") from None
        return documents

    def to_tei_request(self, auto_truncate: bool) -> fr.RerankRequest:
        """TEI's ranking (``texts``): every text; a cross-encoder's score is the sigmoid of its
        logit whatever the folder names, as TEI's, and ``raw_scores`` skips it; ``truncate``
        (default: the server's ``auto_truncate``) keeps the model maximum of each pair."""
        return fr.RerankRequest(query=self.query, documents=self.texts or [], sides=("query", "texts"),
                                use_activation=False if self.raw_scores else None, activation="labels",
                                return_documents=bool(self.return_text),
                                tokenization=tei_tokenization(self.truncate, self.truncation_direction, auto_truncate))

    def to_request(self, documents: Any) -> fr.RerankRequest:
        """The ranking of :meth:`document_list`'s ``documents`` (vLLM's, Jina's, Cohere's,
        infinity's body). A cross-encoder scores with the folder's activation (vLLM's rule), or
        on infinity's body the sigmoid of its logit whatever the folder names (infinity's);
        ``raw_scores`` / ``use_activation: false`` skip it."""
        if isinstance(documents, list):
            documents = [d.text if isinstance(d, RerankDocumentInput) else d for d in documents]
        # vLLM's schema sends 0 for "all" and "whole documents" (infinity's top_n must be positive,
        # so its 0 goes on to the core's check); infinity's body answers no
        # documents unless asked, the others (vLLM's, Jina's) answer them unless told not to.
        infinity = self.raw_scores is not None
        return_documents = bool(self.return_documents) if infinity else self.return_documents is not False
        return fr.RerankRequest(
            query=self.query, documents=documents, top_n=self.top_n if infinity else _none_for_zero(self.top_n),
            return_documents=return_documents, max_tokens_per_doc=_none_for_zero(self.max_tokens_per_doc),
            use_activation=False if self.raw_scores else self.use_activation,
            activation="labels" if infinity else "model", options=self.plugin_options(),
            tokenization=self.tokenization())


def _none_for_zero(value: int | None) -> int | None:
    """vLLM's "not set" (0) as the core's (``None``); any other value as sent, for the core's check."""
    return None if value == 0 else value


_TEI_RERANK_FIELDS = ("texts", "return_text", "truncate", "truncation_direction")  # raw_scores: infinity's too
_RERANK_FIELDS = ("documents", "top_n", "return_documents", "max_tokens_per_doc", "truncate_prompt_tokens",
                  "truncation_side", "use_activation")


class TokenizeRequest(_Chat):
    """vLLM's ``/tokenize``: ``prompt``, or its chat form ``messages`` (rendered with the model's
    chat template; vLLM's defaults there: the generation prompt added, no special tokens); or
    TEI's (``inputs``: a text or texts). The answer follows the body."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    inputs: StrictStr | list[StrictStr] | None = None
    add_generation_prompt: StrictBool = Field(
        default=True, description="messages: end with the template's generation prompt (vLLM's tokenize default).")
    add_special_tokens: StrictBool | None = Field(
        default=None, description="Add the tokenizer's special tokens (default true for prompt and inputs, false "
                                  "for messages: the chat template writes its own).")
    return_token_strs: StrictBool | None = Field(default=None, description="vLLM: also answer each token's string.")
    tools: list[dict[str, Any]] | None = Field(
        default=None, description="messages: tool definitions the chat template renders (vLLM's tokenize).")
    prompt_name: StrictStr | None = Field(default=None, description="TEI: the model's prompt of this name goes "
                                                                      "first; spans count from its start.")

    def api(self) -> Literal["tei", "vllm"]:
        """``"tei"`` for ``inputs``, ``"vllm"`` for ``prompt`` or ``messages``.

        :raises ApiError: 400 unless exactly one of them is sent, for TEI with vLLM's fields, or
            for the chat fields without ``messages``.
        """
        given = [name for name in ("prompt", "messages", "inputs") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ApiError(400, "send prompt or messages (vLLM) or inputs (TEI), exactly one of them",
                           param=given[1] if len(given) > 1 else "prompt")
        if self.inputs is not None and self.return_token_strs is not None:
            raise ApiError(400, "return_token_strs belongs to vLLM's body, which sends prompt or messages",
                           param="return_token_strs")
        if self.inputs is None and self.prompt_name is not None:
            raise ApiError(400, "prompt_name belongs to TEI's body, which sends inputs", param="prompt_name")
        chat_fields = self.chat_fields()
        if self.messages is None and chat_fields:
            raise ApiError(400, f"{chat_fields[0]} applies to messages, not to {given[0]}", param=chat_fields[0])
        return "tei" if self.inputs is not None else "vllm"

    def to_request(self, chat: tuple[str, bool] | None = None) -> fr.TokenizeRequest:
        """vLLM's (``prompt``, or ``chat``: ``messages`` rendered and whether to add special tokens;
        ids, and token strings when asked) or TEI's (``inputs``: tokens with spans) tokenization.

        :raises ApiError: as :meth:`api`.
        """
        special = self.add_special_tokens is not False
        if self.api() == "tei":
            texts = [self.inputs] if isinstance(self.inputs, str) else self.inputs
            return fr.TokenizeRequest(texts=texts, with_tokens=True,  # type: ignore[arg-type]
                                      tokenization=fr.Tokenization(add_special_tokens=special,
                                                                   prompt_name=self.prompt_name))
        text, special = chat if chat is not None else (self.prompt, special)
        return fr.TokenizeRequest(texts=[text], with_tokens=bool(self.return_token_strs),  # type: ignore[list-item]
                                  tokenization=fr.Tokenization(add_special_tokens=special))


class DetokenizeRequest(_Body):
    """vLLM's ``/detokenize``: token ids back to text, special tokens kept."""

    model: StrictStr | None = None
    tokens: TokenIds


class Usage(BaseModel):
    """OpenAI's usage, with vLLM's ``completion_tokens`` (always 0: pooling generates nothing),
    which clients written for vLLM read."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Vector


class EmbeddingResponse(BaseModel):
    """OpenAI's embeddings answer, with vLLM's ``id`` and ``created``."""

    id: str
    object: Literal["list"] = "list"
    created: int
    data: list[EmbeddingData]
    model: str
    usage: Usage


class PoolingData(BaseModel):
    object: Literal["pooling"] = "pooling"
    index: int
    data: PoolingArray | dict[str, PoolingArray] = Field(
        description="The task's output, or one array per name for named outputs (SPLADE's "
                    "{token_ids, weights}); integer arrays are JSON ints, or with encoding_format=base64 "
                    "int64 bytes; float arrays embed_dtype bytes (default float32), in endianness order.")


class ClassificationData(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class _ListResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    usage: Usage


class PoolingResponse(_ListResponse):
    data: list[PoolingData]


class ClassificationResponse(_ListResponse):
    data: list[ClassificationData]


class ScoreResponse(_ListResponse):
    data: list[ScoreData]


class RerankDocument(BaseModel):
    """A result's document: ``text``, plus any other field a Cohere v1 document object had."""

    model_config = ConfigDict(extra="allow")

    text: str


class RerankData(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class ApiVersion(BaseModel):
    version: str


class BilledUnits(BaseModel):
    search_units: int


class RerankMeta(BaseModel):
    """Cohere's ``meta``: the API version and the billed units (one search unit per 100 documents)."""

    api_version: ApiVersion
    billed_units: BilledUnits


class RerankResponse(BaseModel):
    """vLLM's and Jina's rerank answer; ``meta`` (Cohere) on ``/v1/rerank`` and ``/v2/rerank`` only."""

    id: str
    model: str
    usage: Usage
    results: list[RerankData]
    meta: RerankMeta | None = None


class TeiRank(BaseModel):
    """One of TEI's ``/rerank`` results; ``text`` only with ``return_text``."""

    index: int
    score: float
    text: str | None = None


class TeiToken(BaseModel):
    """One of TEI's ``/tokenize`` tokens: ``start``/``stop`` are UTF-8 byte offsets into the
    input, ``None`` for the special tokens the tokenizer adds (whose ``text`` is the token)."""

    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "poolrunner"
    max_model_len: int
    task: str
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's card)


class LoadLoraAdapterRequest(_Body):
    """vLLM's ``POST /v1/load_lora_adapter`` body (``model``: which served model, default the first)."""

    lora_name: str
    lora_path: str
    model: str | None = None


class UnloadLoraAdapterRequest(_Body):
    """vLLM's ``POST /v1/unload_lora_adapter`` body."""

    lora_name: str
    lora_int_id: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
