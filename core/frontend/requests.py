"""What a caller asks of a runtime: one frozen object per operation, each field checked once.

Every surface builds one of these: ``Runtime``'s methods from their keywords, the CLI from its
flags, HTTP bodies with ``to_request()``, Ray jobs from their ``request_options``.
:meth:`Frontend.plan <poolrunner.core.frontend.plans.Frontend.plan>` turns it into engine
requests and an answer. A new per-request field is one attribute here (its check beside it), one
HTTP body field and one CLI flag.

The pooling fields (``dimensions``, ``normalize``, ``use_activation``, ``step_tag_id``,
``returned_token_ids``) are :class:`~poolrunner.core.types.PoolingParams`' own and are checked
there, when the plan builds the params; everything else is checked here, when the object is made.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from numbers import Number
from typing import Any, ClassVar, Literal, TypeVar

import attrs
import numpy as np
from attrs import field, frozen

from poolrunner.core.errors import InvalidRequestError
from poolrunner.core.frontend.quantize import Precision, as_ranges, check_precision, check_ranges
from poolrunner.core.inputs.images import ImageURL as ImageURL  # re-exported: surfaces reach images through here
from poolrunner.core.inputs.images import is_image
from poolrunner.core.types import PoolingTask, PromptInput, TruncationSide
from poolrunner.core.validators import shown

Input = PromptInput | tuple[str, str] | Any
"""One input: a text, token ids (``prompt_token_ids``), a ``(text, text_pair)`` pair, or an image
(:mod:`poolrunner.core.inputs.images`: a PIL image, bytes, a path, an ``ImageURL``)."""


# ---- checks: each raises InvalidRequestError naming the field, the value and what is allowed ----


def _truncation(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
    # The model's own limits (max_model_len, special tokens) are checked by the tokenizer.
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise InvalidRequestError(f"{attribute.name} must be an integer, got {value!r}", param=attribute.name)


def _side(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
    if value not in ("left", "right", None):
        raise InvalidRequestError(f"{attribute.name} must be 'left' or 'right', got {value!r}", param=attribute.name)


def _optional_text(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise InvalidRequestError(f"{attribute.name} must be a string, got {shown(value)}", param=attribute.name)


def _flag(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{attribute.name} must be true or false, got {value!r}", param=attribute.name)


ActivationRule = Literal["model", "labels"]
"""Which activation turns a classifier's logits into scores (unless ``use_activation=False``):
``"model"``, the model's (``classify``: the head's rule, vLLM's ``classify``; pair scores: the
activation a cross-encoder's folder names, as sentence-transformers' ``CrossEncoder.predict`` and
vLLM's ``score`` apply it); ``"labels"``,
by the label count alone, a sigmoid of one logit and a softmax over several, whatever the
folder names (TEI's and infinity's APIs: :func:`~poolrunner.core.activation.label_count_activation`)."""


def _activation_rule(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
    if value not in ("model", "labels"):
        raise InvalidRequestError(f"{attribute.name} must be 'model' or 'labels', got {shown(value)}",
                                  param=attribute.name)


def _optional_positive(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InvalidRequestError(f"{attribute.name} must be a positive integer, got {value!r}", param=attribute.name)


def _precision(_instance: object, _attribute: attrs.Attribute, value: Any) -> None:
    check_precision(value)


# ---- the shared part ----


@frozen(kw_only=True)
class Tokenization:
    """How each text of a request becomes ``prompt_token_ids``; shared by every operation.

    :ivar truncate_prompt_tokens: ``None``: no truncation (a longer input is an error, or, with
        ``max_embed_len``, embedded in windows); ``k``: keep ``k`` tokens; ``-1``: keep the
        model maximum (vLLM's field).
    :ivar truncation_side: ``right`` keeps the start, ``left`` keeps the end; ``None``: the
        folder's own (``tokenizer_config.json``'s ``truncation_side``, ``right`` unless it says
        ``left``), as sentence-transformers and vLLM keep.
    :ivar prompt: A literal prefix for every text.
    :ivar prompt_name: The name of one of the model's prompts (sentence-transformers').
    :ivar add_special_tokens: ``False`` tokenizes without the tokenizer's special tokens (vLLM's).
    :ivar lora: The name of a loaded LoRA adapter to run with (vLLM's ``lora_request``; over HTTP
        the body's ``model``); ``None``: the base model. Here because every operation takes it.
    :raises InvalidRequestError: for a value of the wrong type, or both ``prompt`` and ``prompt_name``.
    """

    truncate_prompt_tokens: int | None = field(default=None, validator=_truncation)
    truncation_side: TruncationSide | None = field(default=None, validator=_side)
    prompt: str | None = field(default=None, validator=_optional_text)
    prompt_name: str | None = field(default=None, validator=_optional_text)
    add_special_tokens: bool = field(default=True, validator=_flag)
    lora: str | None = field(default=None, validator=_optional_text)

    def encoding(self) -> dict[str, Any]:
        """The fields that shape ``prompt_token_ids`` (``InputProcessor.encode``'s keywords):
        all but :attr:`lora`, which picks weights, not tokens."""
        return attrs.asdict(self, filter=lambda a, _v: a.name != "lora")

    def __attrs_post_init__(self) -> None:
        if self.prompt is not None and self.prompt_name is not None:
            raise InvalidRequestError("pass either prompt or prompt_name, not both", param="prompt")


TOKENIZATION_FIELDS = frozenset(f.name for f in attrs.fields(Tokenization))

R = TypeVar("R", bound="_Request")


class _Request:
    """What every operation's object shares: :meth:`of`, which sorts flat keywords into fields."""

    takes_plugin_options: ClassVar[bool] = False
    input_fields: ClassVar[tuple[str, ...]] = ("inputs",)
    """The fields holding what is pooled (texts, pairs), as against how it is pooled."""

    @classmethod
    def field_names(cls) -> frozenset[str]:
        """Every field :meth:`of` takes by name, the input fields and ``options`` aside: what a
        CLI flag or a Ray job's ``request_options`` may set."""
        own = {f.name for f in attrs.fields(cls)} - {"tokenization", "options", *cls.input_fields}
        return frozenset(own) | TOKENIZATION_FIELDS

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """The default of each of :meth:`field_names`."""
        fields = [*attrs.fields(cls), *attrs.fields(Tokenization)]
        return {f.name: f.default for f in fields if f.name in cls.field_names()}

    @classmethod
    def of(cls: type[R], **values: Any) -> R:
        """The request from flat keywords, as the surfaces hold them: :class:`Tokenization`'s
        fields go into ``tokenization``; with :attr:`takes_plugin_options`, any other unknown
        name is a plugin's request option (checked when the plan is made).

        :raises InvalidRequestError: for an unknown name, another operation's field (``dimensions``
            on a score), or a value its field refuses.
        """
        own = {f.name for f in attrs.fields(cls)} - {"tokenization", "options"}
        tokenization = {name: values.pop(name) for name in TOKENIZATION_FIELDS & set(values)}
        fields = {name: values.pop(name) for name in own & set(values)}
        if values and not cls.takes_plugin_options:
            raise InvalidRequestError(f"unknown request field {sorted(values)[0]!r} ({cls.__name__} takes "
                                      f"{sorted(own | TOKENIZATION_FIELDS)})")
        foreign = sorted(REQUEST_FIELDS & set(values))  # another operation's field, not a plugin's option
        if foreign:
            raise InvalidRequestError(f"request field {foreign[0]!r} does not apply to {cls.__name__} (it takes "
                                      f"{sorted(own | TOKENIZATION_FIELDS)} and the plugins' request options)",
                                      param=foreign[0])
        extra = {"options": values} if cls.takes_plugin_options else {}
        return cls(**fields, tokenization=Tokenization(**tokenization), **extra)  # type: ignore[call-arg]


def _options(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return dict(value or {})


def is_pair(item: object) -> bool:
    """A ``(text, text_pair)`` tuple."""
    return isinstance(item, tuple) and len(item) == 2 and all(isinstance(text, str) for text in item)


def is_token_ids(value: object) -> bool:
    """A non-empty list or tuple of integers (numpy's too; booleans are not token ids)."""
    return (isinstance(value, list | tuple) and len(value) > 0
            and all(isinstance(item, int | np.integer) and not isinstance(item, bool) for item in value))


def is_single(inputs: object) -> bool:
    """One input rather than a sequence of them: a text, one token-id list (ints, as the HTTP
    routes read it), one ``(text, text_pair)`` tuple or one image."""
    return isinstance(inputs, str) or is_pair(inputs) or is_token_ids(inputs) or is_image(inputs)


def _is_sequence(value: Any) -> bool:
    """Iterable as a list of inputs: not bytes (one value) nor a mapping (a body's object)."""
    return isinstance(value, Iterable) and not isinstance(value, bytes | Mapping)


def _is_numbers(value: object) -> bool:
    """A non-empty list or tuple of numbers only: meant as one token-id list even when some are not
    integers, so that tokenizing names the bad id rather than taking each number for an input."""
    return isinstance(value, list | tuple) and len(value) > 0 and all(isinstance(item, Number) for item in value)


class Items(tuple):  # type: ignore[type-arg]
    """A request's inputs once :func:`as_items` has read them. Marked, so that reading them again
    (``attrs.evolve`` runs converters anew) keeps them: two texts would otherwise read as one
    ``(text, text_pair)`` input."""

    __slots__ = ()


def as_items(inputs: Input | Sequence[Input]) -> tuple[Input, ...]:
    """``inputs`` as a tuple of inputs (see :func:`is_single`); inputs already read are kept.

    :raises InvalidRequestError: for a value that is neither one input nor a sequence (a number, ``None``).
    """
    if isinstance(inputs, Items):
        return inputs
    if is_single(inputs) or _is_numbers(inputs):  # a list of numbers is one token-id list, bad ids and all
        return Items((inputs,))
    if not _is_sequence(inputs):
        raise InvalidRequestError(f"input must be a text, a token-id list, a (text, text_pair) pair, an image, "
                                  f"or a list of them; got {shown(inputs)} ({type(inputs).__name__})", param="input")
    return Items(inputs)


# ---- one object per operation ----


@frozen(kw_only=True)
class EncodeRequest(_Request):
    """Pool each input with ``task`` (``Runtime.encode``; ``embed`` is this with ``task="embed"``).

    :ivar inputs: Texts, token-id lists, ``(text, text_pair)`` pairs, or, for a text-image model
        and ``embed``, images, mixed in any order (one of them: one input).
    :ivar task: ``None``: the runtime's default task.
    :ivar options: The plugins' request options for ``task`` (SPLADE's ``top_k``...), checked
        against their declarations when the plan is made.
    :ivar precision: ``float32``, or a quantized precision for ``embed``
        (:mod:`poolrunner.core.frontend.quantize`), applied after ``dimensions`` and normalization.
    :ivar ranges: ``[2, d]`` minima and maxima for ``int8`` / ``uint8``; ``None``: calibrated on
        this request's embeddings.
    :raises InvalidRequestError: for an unknown precision, or ``ranges`` with another precision
        (a quantized precision for a task other than ``embed`` is the plan's error).
    """

    takes_plugin_options: ClassVar[bool] = True

    inputs: tuple[Input, ...] = field(converter=as_items)
    task: PoolingTask | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    step_tag_id: int | None = None
    returned_token_ids: Sequence[int] | None = None
    precision: Precision = field(default="float32", validator=_precision)
    ranges: Any = field(default=None, eq=False)
    options: Mapping[str, Any] = field(factory=dict, converter=_options)
    tokenization: Tokenization = field(factory=Tokenization)

    def __attrs_post_init__(self) -> None:
        check_ranges(self.precision, self.ranges)  # the task's own check waits for the plan, which knows it

    def pooling(self) -> dict[str, Any]:
        """The :class:`~poolrunner.core.types.PoolingParams` fields this request sets."""
        return {"dimensions": self.dimensions, "normalize": self.normalize, "use_activation": self.use_activation,
                "step_tag_id": self.step_tag_id, "returned_token_ids": self.returned_token_ids}

    def calibration(self) -> np.ndarray | None:
        """:attr:`ranges` as a float32 array (:func:`~poolrunner.core.frontend.quantize.as_ranges`).

        :raises InvalidRequestError: for ragged lists, values that are not finite float32 numbers,
            or a minimum above its maximum.
        """
        return None if self.ranges is None else as_ranges(self.ranges)


def pairs_as_tuples(value: Any) -> Any:
    """``value`` with each ``[text, text_pair]`` item of a list of inputs read as a pair (a
    tuple): sentence-transformers' ``CrossEncoder.predict`` takes pairs as lists, and JSON has no
    tuples. A flat list of texts stays texts; anything else is left as it is, for the checks."""
    if not isinstance(value, list | tuple) or is_token_ids(value) or is_pair(value):
        return value
    return [tuple(item) if isinstance(item, list) and len(item) == 2 and all(isinstance(text, str) for text in item)
            else item for item in value]


@frozen(kw_only=True)
class ClassifyRequest(_Request):
    """Score each input over the model's labels (``Runtime.classify``).

    :ivar inputs: Texts, token-id lists, or ``(text, text_pair)`` pairs (one of them: one input);
        in a list, ``[text, text_pair]`` lists are pairs too (:func:`pairs_as_tuples`).
    :ivar use_activation: ``False``: raw logits instead of probabilities.
    :ivar activation: Which activation gives the probabilities (:data:`ActivationRule`).
    """

    inputs: tuple[Input, ...] = field(converter=lambda inputs: as_items(pairs_as_tuples(inputs)))
    use_activation: bool | None = None
    activation: ActivationRule = field(default="model", validator=_activation_rule)
    tokenization: Tokenization = field(factory=Tokenization)


def _side_items(value: Any) -> Any:
    """A score side as given when it is one item (a text, an image) or a list or tuple; any other
    iterable (a numpy array, a generator) as a list; anything else as given, for the check."""
    if isinstance(value, str | list | tuple) or is_image(value) or not _is_sequence(value):
        return value
    return list(value)


def _score_side(instance: ScoreRequest, attribute: attrs.Attribute, value: Any) -> None:
    """A text, an image, or a sequence of them (each item is checked when paired)."""
    if not isinstance(value, str) and not is_image(value) and not _is_sequence(value):
        name = instance.sides[0 if attribute.name == "queries" else 1]
        raise InvalidRequestError(f"{name} must be a string or a list of strings, got {shown(value)}", param=name)


@frozen(kw_only=True)
class ScoreRequest(_Request):
    """The relevance of each (query, document) pair: 1:1, 1:N or N:N (``Runtime.score``).

    :ivar queries: One text, or a list of them (images too, for a text-image model).
    :ivar documents: One text, or a list of them (images too, for a text-image model).
    :ivar sides: What the caller calls the two sides, for errors (``documents[2]``).
    :ivar use_activation: ``False``: a cross-encoder's raw logit.
    :ivar activation: Which activation gives a cross-encoder's score (:data:`ActivationRule`).
    :ivar max_tokens_per_doc: Cut each document to its first this many tokens, special tokens
        not counted, before pairing (Cohere's and vLLM's field); the query is never cut.
    :ivar options: The plugins' request options for the runtime's task (BGE-M3's weights).
    """

    takes_plugin_options: ClassVar[bool] = True
    input_fields: ClassVar[tuple[str, ...]] = ("queries", "documents")

    queries: str | Sequence[str] = field(converter=_side_items, validator=_score_side)
    documents: str | Sequence[str] = field(converter=_side_items, validator=_score_side)
    sides: tuple[str, str] = ("queries", "documents")
    use_activation: bool | None = None
    activation: ActivationRule = field(default="model", validator=_activation_rule)
    max_tokens_per_doc: int | None = field(default=None, validator=_optional_positive)
    options: Mapping[str, Any] = field(factory=dict, converter=_options)
    tokenization: Tokenization = field(factory=Tokenization)


@frozen(kw_only=True)
class RerankRequest(_Request):
    """``documents`` ranked by relevance to ``query``, best first (``Runtime.rerank``).

    :ivar sides: As :attr:`ScoreRequest.sides` (TEI's body calls the documents ``texts``).
    :ivar use_activation: As :attr:`ScoreRequest.use_activation`.
    :ivar activation: As :attr:`ScoreRequest.activation`.
    :ivar top_n: Keep the best ``top_n``; ``None``: all.
    :ivar return_documents: Include each document's text in its result.
    :ivar max_tokens_per_doc: As :attr:`ScoreRequest.max_tokens_per_doc`.
    :ivar options: As :attr:`ScoreRequest.options`.
    :ivar query: A text, or, for a text-image model, an image (then the documents are usually
        texts: the reverse search).
    :ivar documents: Texts, or, for a text-image model, images (or both, mixed).
    :raises InvalidRequestError: for a query that is neither a text nor an image, documents
        given as one string, or a ``top_n`` that is not a positive integer.
    """

    takes_plugin_options: ClassVar[bool] = True
    input_fields: ClassVar[tuple[str, ...]] = ("query", "documents")

    query: Input = field()
    documents: Sequence[Input] = field()
    sides: tuple[str, str] = ("query", "documents")
    use_activation: bool | None = None
    activation: ActivationRule = field(default="model", validator=_activation_rule)
    top_n: int | None = field(default=None, validator=_optional_positive)
    return_documents: bool = field(default=False, validator=_flag)
    max_tokens_per_doc: int | None = field(default=None, validator=_optional_positive)
    options: Mapping[str, Any] = field(factory=dict, converter=_options)
    tokenization: Tokenization = field(factory=Tokenization)

    @query.validator
    def _query(self, _attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, str) and not is_image(value):  # an image for a text-only model: the plan's error
            raise InvalidRequestError(f"query must be a string, got {shown(value)}", param="query")

    @documents.validator
    def _documents(self, _attribute: attrs.Attribute, value: Any) -> None:
        name = self.sides[1]
        if isinstance(value, str):
            raise InvalidRequestError(f"{name} must be a list of strings, not one string", param=name)
        if not _is_sequence(value):
            raise InvalidRequestError(f"{name} must be a list of strings, got {shown(value)}", param=name)

    def score_request(self) -> ScoreRequest:
        """The scoring this ranking orders: the query against each document."""
        return ScoreRequest(queries=self.query, documents=list(self.documents), sides=self.sides,
                            use_activation=self.use_activation, activation=self.activation,
                            max_tokens_per_doc=self.max_tokens_per_doc,
                            options=self.options, tokenization=self.tokenization)


@frozen(kw_only=True)
class TokenizeRequest(_Request):
    """Each text's ``prompt_token_ids`` (vLLM's ``/tokenize``): untruncated unless the
    tokenization's ``truncate_prompt_tokens`` says otherwise, and of any length (within
    ``max_input_chars``): a text longer than ``max_model_len`` is counted, not refused, as vLLM's
    ``/tokenize`` counts it.

    :ivar texts: The texts.
    :ivar with_tokens: Also each token's string and character span (TEI's ``/tokenize``,
        vLLM's ``return_token_strs``); never truncated.
    """

    input_fields: ClassVar[tuple[str, ...]] = ("texts",)

    texts: tuple[str, ...] = field(converter=tuple)
    with_tokens: bool = field(default=False, validator=_flag)
    tokenization: Tokenization = field(factory=Tokenization)


Request = EncodeRequest | ClassifyRequest | ScoreRequest | RerankRequest | TokenizeRequest

REQUEST_FIELDS = frozenset(
    name for cls in (EncodeRequest, ClassifyRequest, ScoreRequest, RerankRequest, TokenizeRequest)
    for name in (f.name for f in attrs.fields(cls)) if name not in ("tokenization", "options")
) | TOKENIZATION_FIELDS
"""Every per-request field name of every operation: no plugin option may take one."""
