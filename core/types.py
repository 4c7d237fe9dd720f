"""Frozen value objects that cross the hook boundary.

Everything a plugin receives is immutable (attrs ``@frozen``), so no plugin can change another
plugin's input; derive variants with :func:`attrs.evolve`. The per-step objects (requests in the
engine, the packed batch, pooling metadata) live in :mod:`poolrunner.core.plugin_api`.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, get_args

from attrs import converters, field, fields, frozen, validators

from poolrunner.core.errors import InvalidRequestError
from poolrunner.core.validators import (
    non_negative_int,
    non_negative_ints,
    optional_bool,
    positive_int,
    task_name,
)

if TYPE_CHECKING:
    from pathlib import Path

BuiltinTask = Literal["embed", "classify", "token_embed", "token_classify", "embed&token_classify"]
"""The tasks core knows: one vector, one label distribution, per-token vectors, per-token
distributions, or a dense vector plus per-token weights (BGE-M3 style)."""

POOLING_TASKS: tuple[BuiltinTask, ...] = get_args(BuiltinTask)

PoolingTask: TypeAlias = str
"""What a request asks of a model: a :data:`BuiltinTask`, or a task a plugin declares in its
``supported_tasks`` (such as ``"sparse_embed"``), named as :data:`PLUGIN_TASK_NAME` allows."""

PLUGIN_TASK_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
"""How a plugin-declared task is spelled: a lowercase identifier of at most 64 characters."""

# vLLM's order of preference when the user names no task (see ModelConfig.default_task).
TASK_PREFERENCE: tuple[PoolingTask, ...] = (
    "embed&token_classify", "embed", "classify", "token_embed", "token_classify",
)

PoolingType = Literal["CLS", "MEAN", "LAST", "MAX", "WEIGHTEDMEAN", "MEAN_SQRT_LEN", "ALL", "STEP"]
"""How hidden states become an output: first token, masked mean (fp32), last real token,
per-dimension maximum over the tokens, mean weighted by position (weights ``1..n``), token sum
divided by ``sqrt(n)`` (the six are sentence-transformers' Pooling modes ``cls``, ``mean``,
``lasttoken``, ``max``, ``weightedmean``, ``mean_sqrt_len_tokens``), every token, or only
step-tag tokens (process-reward models)."""

POOLING_TYPES: tuple[PoolingType, ...] = get_args(PoolingType)

SEQUENCE_POOLING_TYPES: tuple[PoolingType, ...] = ("CLS", "MEAN", "LAST", "MAX", "WEIGHTEDMEAN", "MEAN_SQRT_LEN")
"""The pooling types that give one vector per sequence, and so may be concatenated."""

POOLING_TYPE_SEPARATOR = "+"
"""Joins sequence pooling types whose vectors are concatenated, in that order: ``"MEAN+MAX"``
is ``[mean, max]`` of width ``2 * hidden_size`` (sentence-transformers' Pooling with several
modes). Only a model's own metadata selects a combination; an override names one type."""


def pooling_type_parts(pooling_type: str) -> tuple[str, ...]:
    """The types a :attr:`ModelConfig.pooling_type` concatenates, in order: ``"MEAN+MAX"`` ->
    ``("MEAN", "MAX")``, ``"CLS"`` -> ``("CLS",)``. Nothing is validated here."""
    return tuple(pooling_type.split(POOLING_TYPE_SEPARATOR))


def _pooling_type(_instance: object, attribute: Any, value: Any) -> None:
    """A :data:`PoolingType`, or two or more :data:`SEQUENCE_POOLING_TYPES` joined by ``+``."""
    if value in POOLING_TYPES:
        return
    parts = pooling_type_parts(value) if isinstance(value, str) else ()
    if len(parts) > 1 and all(part in SEQUENCE_POOLING_TYPES for part in parts):
        return
    raise InvalidRequestError(
        f"{attribute.name} must be one of {list(POOLING_TYPES)}, or two or more of "
        f"{list(SEQUENCE_POOLING_TYPES)} joined by {POOLING_TYPE_SEPARATOR!r}, got {value!r}"
    )


TruncationSide = Literal["left", "right"]

PromptInput = str | Sequence[int]
"""A text, or an already tokenized prompt (special tokens included)."""


def _frozen_mapping(value: Mapping[Any, Any] | None) -> Mapping[Any, Any]:
    return MappingProxyType(dict(value or {}))


@frozen(kw_only=True)
class PoolingParams:
    """Per-request pooling options.

    :ivar task: The pooling task this request asks for: a built-in task or one a plugin declares.
    :ivar dimensions: Matryoshka output size ``d``: the pooled vector is sliced to ``[:d]`` and
        then normalized (when normalization is on). Only Matryoshka models accept it; checked
        against the model when the request is admitted. ``None`` keeps the full size.
    :ivar normalize: L2-normalize the output. ``None`` uses the model's default (on for
        ``embed``, unless a sentence-transformers folder has no ``Normalize`` module).
    :ivar use_activation: Apply the classification activation (sigmoid or softmax, by the
        model's head). ``None`` and ``True`` apply it; ``False`` returns raw logits.
    :ivar step_tag_id: STEP pooling (``token_classify``, process-reward models): keep only the
        rows whose prompt token is this id.
    :ivar returned_token_ids: STEP pooling: keep only these label columns (the activation then
        runs over them alone).
    :ivar extra_kwargs: The request options plugins declare (``request_options`` hook), checked
        and with defaults filled in by the runtime before the request reaches the engine;
        ``None`` when the task takes none. Read-only. vLLM's ``PoolingParams.extra_kwargs``.
    :ivar lora_id: The LoRA adapter this request runs with (vLLM's ``lora_int_id``, given by
        the runtime when the adapter loads: :class:`LoraRequest`); ``None`` runs the base model.
        Set by the front end from the request's ``lora`` name, never by a caller.
    """

    task: PoolingTask = field(validator=task_name(POOLING_TASKS, PLUGIN_TASK_NAME))
    dimensions: int | None = field(default=None, validator=positive_int)
    normalize: bool | None = field(default=None, validator=optional_bool)
    use_activation: bool | None = field(default=None, validator=optional_bool)
    step_tag_id: int | None = field(default=None, validator=non_negative_int)
    returned_token_ids: tuple[int, ...] | None = field(
        default=None, converter=converters.optional(tuple), validator=non_negative_ints
    )
    extra_kwargs: Mapping[str, Any] | None = field(
        default=None, converter=converters.optional(_frozen_mapping), hash=False
    )
    lora_id: int | None = field(default=None, validator=positive_int)

    def given(self) -> frozenset[str]:
        """Names of the core options set on this request (not ``None``; ``task`` and the plugins'
        :attr:`extra_kwargs` aside)."""
        return frozenset(
            f.name for f in fields(PoolingParams)
            if f.name not in ("task", "extra_kwargs", "lora_id") and getattr(self, f.name) is not None
        )


def _token_ids(value: Any) -> tuple[int, ...]:
    # operator.index accepts any integer (numpy's too) and rejects floats and strings.
    return tuple(operator.index(token) for token in value)


@frozen(kw_only=True)
class PoolingRequest:
    """One tokenized input and what to compute from it.

    :ivar request_id: Unique among the requests in flight.
    :ivar prompt_token_ids: Token ids, ``[num_tokens]``, special tokens included; at least one.
    :ivar token_type_ids: Optional segment ids of the same length (paired inputs of encoders).
    :ivar params: The pooling options.
    :ivar pixel_values: An image input: ``[3, height, width]`` float32 from the model's image
        processor; ``prompt_token_ids`` are then placeholders, one per position the image takes
        (:attr:`ModelConfig.image_positions`). ``None`` for text. A page-retrieval model's page
        (:attr:`ModelConfig.images_in_prompt`) holds its processor's own pixel values instead
        (ColPali ``[3, height, width]``, ColQwen2 ``[num_patches, patch_dim]``) and its
        processor's own prompt (image tokens and text).
    :ivar image_kwargs: An image input's other image-processor outputs, by name, each one image's
        (SigLIP2: ``pixel_attention_mask`` ``[image_positions]`` int and ``spatial_shapes`` ``[2]``
        int64); ``None`` when the processor gives only ``pixel_values`` (CLIP, SigLIP).
    :raises ValueError: On an empty prompt or mismatched ``token_type_ids`` length.
    """

    request_id: str = field(validator=validators.min_len(1))
    prompt_token_ids: tuple[int, ...] = field(converter=_token_ids, validator=validators.min_len(1))
    token_type_ids: tuple[int, ...] | None = field(
        default=None, converter=converters.optional(_token_ids)
    )
    params: PoolingParams = field(validator=validators.instance_of(PoolingParams))
    pixel_values: Any = field(default=None, eq=False, repr=False)
    image_kwargs: Mapping[str, Any] | None = field(default=None, eq=False, repr=False)

    @token_type_ids.validator
    def _same_length(self, _attribute: Any, value: tuple[int, ...] | None) -> None:
        if value is not None and len(value) != len(self.prompt_token_ids):
            raise ValueError(
                f"request {self.request_id!r}: token_type_ids has {len(value)} entries but "
                f"prompt_token_ids has {len(self.prompt_token_ids)}"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


@frozen(kw_only=True)
class LoraRequest:
    """A LoRA adapter as the runtime serves it (vLLM's ``LoRARequest``).

    :ivar name: What requests call it (``lora=NAME``, the HTTP ``model`` field).
    :ivar lora_id: Its number, unique in the runtime, at least 1 (vLLM's ``lora_int_id``):
        what engine requests carry (:attr:`PoolingParams.lora_id`).
    :ivar path: The PEFT folder (``adapter_config.json``, ``adapter_model.safetensors``).
    :ivar prompts: The folder's own sentence-transformers prompts
        (``config_sentence_transformers.json``), which requests naming the adapter use instead of
        the base model's; ``None``: the folder has no ``modules.json``, the base model's apply.
    :ivar default_prompt_name: The folder's ``default_prompt_name`` (with :attr:`prompts`).
    """

    name: str = field(validator=validators.min_len(1))
    lora_id: int = field(validator=positive_int)
    path: Path
    prompts: dict[str, str] | None = field(default=None, hash=False)
    default_prompt_name: str | None = None

    def prompt(self, prompt_name: str | None) -> str | None:
        """The literal prompt of ``prompt_name`` (else of :attr:`default_prompt_name`) from the
        adapter's own prompts; ``None`` when the adapter has none of its own.

        :raises InvalidRequestError: (param ``prompt_name``) for a name the adapter does not define.
        """
        if self.prompts is None:
            return None
        name = prompt_name or self.default_prompt_name
        if name is None:
            return ""
        if name not in self.prompts:
            raise InvalidRequestError(f"prompt_name {name!r} is not defined by LoRA adapter {self.name!r} "
                                      f"({self.path / 'config_sentence_transformers.json'}); defined: "
                                      f"{sorted(self.prompts)}", param="prompt_name")
        return self.prompts[name]


@frozen(kw_only=True)
class DenseLayerSpec:
    """A sentence-transformers ``Dense`` module applied after pooling: ``y = act(W x + b)``.

    :ivar path: Folder holding the layer's weights (``model.safetensors`` or ``pytorch_model.bin``).
    :ivar activation: Name of an activation class under ``torch.nn`` (``"Identity"``, ``"Tanh"``...).
    """

    path: str
    in_features: int
    out_features: int
    bias: bool
    activation: str


@frozen(kw_only=True)
class RequiredPlugin:
    """A plugin a model folder cannot run without, as the folder itself declares it.

    :ivar name: The plugin's registration (entry-point) name, e.g. ``"splade"``.
    :ivar dist: The distribution that provides it, e.g. ``"poolrunner-splade"``.
    :ivar reason: What in the folder asks for it, for error messages.
    """

    name: str
    dist: str
    reason: str


@frozen(kw_only=True)
class TokenLogits:
    """A causal LM served as a classifier from its next-token logits (vLLM's ``hf_overrides``
    ``classifier_from_token``, ``method``, ``is_original_qwen3_reranker``), as LLM rerankers
    (Qwen3-Reranker, bge-reranker-v2-gemma, mxbai-rerank-v2) score a pair.

    :ivar tokens: The vocabulary entries whose logits are read, as the overrides name them.
    :ivar token_ids: Their ids in the tokenizer's vocabulary, in the same order.
    :ivar method: ``from_2_way_softmax``: two tokens ``(negative, positive)``, one label whose
        logit is ``logit[positive] - logit[negative]`` (so its sigmoid is the two-way softmax's
        positive probability); ``no_post_processing``: one label per token, its logit.
    """

    tokens: tuple[str, ...] = field(converter=tuple)
    token_ids: tuple[int, ...] = field(converter=tuple)
    method: str

    @property
    def labels(self) -> tuple[str, ...]:
        """Label names: the positive token (two-way: one label), else the tokens (one label each)."""
        return self.tokens[1:] if self.method == "from_2_way_softmax" else self.tokens


@frozen(kw_only=True)
class TextPadding:
    """How a text-image family's text tower takes a prompt (SigLIP, SigLIP2): padded to
    ``length`` with ``pad_token_id`` on the tokenizer's padding side, as transformers'
    zero-shot-image-classification pipeline tokenizes it (``padding="max_length"``); the family
    pools the last position.

    :ivar length: The padded length, the text tower's ``max_position_embeddings`` (64).
    :ivar pad_token_id: The tokenizer's pad id.
    :ivar left: The tokenizer pads on the left (``padding_side``; Gemma's, SigLIP2's), else right.
    :ivar attention_mask: Whether the pads are masked: the folder's tokenizer returns an
        ``attention_mask`` (its ``model_input_names``), which the pipeline passes to the model.
    """

    length: int
    pad_token_id: int
    left: bool
    attention_mask: bool


@frozen(kw_only=True)
class ModelConfig:
    """What poolrunner knows about the loaded model, without any transformers object.

    Built once at load by :func:`poolrunner.core.model.metadata.load_model_config` from the
    folder's ``config.json`` and, when present, its sentence-transformers files; explicit user
    settings override both.

    :ivar name: How the model is shown to users (its folder path).
    :ivar architecture: ``config.architectures[0]``, e.g. ``"BertModel"``.
    :ivar hidden_size: Width of the backbone's hidden states.
    :ivar embedding_size: Width of the ``embed`` output before any Matryoshka slice (after Dense).
    :ivar max_model_len: Longest accepted prompt, in tokens.
    :ivar is_causal: A decoder whose config keeps causal attention (not `is_causal: false` or
        `use_bidirectional_attention`); chunked prefill also needs every layer's mask to agree.
    :ivar model_tasks: Tasks the model itself can do (from its head); plugins decide which are served.
    :ivar pooling_type: Default sequence pooling for ``embed``: a :data:`PoolingType`, or sequence
        pooling types joined by ``+`` whose vectors are concatenated in that order (a
        sentence-transformers Pooling module with several modes; see :attr:`pooling_modes`).
    :ivar normalize: Default of :attr:`PoolingParams.normalize` for ``embed``.
    :ivar matryoshka_dimensions: Allowed ``dimensions`` when the model declares a list.
    :ivar is_matryoshka: Whether ``dimensions`` is accepted at all.
    :ivar dense_layers: sentence-transformers Dense projections, applied in order after pooling.
    :ivar prompts: Named prompt prefixes (``config_sentence_transformers.json``).
    :ivar default_prompt_name: Prompt used when the caller names none.
    :ivar lowercase: sentence-transformers' ``do_lower_case`` (``sentence_bert_config.json``): text
        is lowercased, prompts included, by a ``Lowercase`` normalizer put first in the tokenizer's
        pipeline, as sentence-transformers does it (single texts and both texts of a pair alike);
        token-id inputs are taken as given.
    :ivar similarity_fn_name: How the model's embeddings compare (``cosine``, ``dot``,
        ``euclidean``, ``manhattan``): a sentence-transformers folder's own, else ``cosine``.
    :ivar labels: Label names of a classification head, by class index (``id2label``).
    :ivar problem_type: Hugging Face ``problem_type`` of the head (``single_label_classification``,
        ``multi_label_classification``, ``regression``), when the config sets it.
    :ivar classifier_activation: Activation a sentence-transformers cross-encoder names in its
        config (a ``torch.nn`` class name): its pair scores' (``score``, ``rerank``), in place of
        the rule from ``labels``/``problem_type``, which ``classify`` keeps (vLLM's split).
    :ivar token_weight_head: File of a BGE-M3 style token-weight head (``sparse_linear.pt``), a
        ``Linear(hidden_size, 1)`` state dict, when the folder has one.
    :ivar type_vocab_size: Number of token types the model embeds (0 when it has none); paired
        inputs carry ``token_type_ids`` only when this is at least 2.
    :ivar required_plugin: The plugin the folder declares it needs (a sentence-transformers
        ``SparseEncoder`` or PyLate pipeline, say); only that plugin then serves the model, and
        the load fails naming its distribution when it is not installed.
    :ivar token_logits: A causal LM classifying from the logits of a few vocabulary tokens
        (:class:`TokenLogits`, from ``hf_overrides``); its ``classify`` head is those rows of the
        LM head, read at the last token. ``None`` for every other model.
    :ivar image_positions: A text-image model (CLIP): the positions one image takes in a step,
        its vision tower's sequence length (patches, plus CLS), which the scheduler counts
        against ``max_num_batched_tokens``; ``None`` for a model without a vision tower, or
        whose images are part of a prompt (:attr:`images_in_prompt`).
    :ivar images_in_prompt: A page-retrieval model (ColPali, ColQwen2): a page is its processor's
        prompt (image tokens and text, as many positions as that prompt has tokens) with its
        pixels on the request; every input, query or page, gives one vector per token.
    :ivar text_padding: A text-image family whose text tower runs padded prompts (SigLIP,
        SigLIP2: :class:`TextPadding`); ``None`` for every other model.
    :ivar hf_config: The raw ``config.json`` contents (``hf_overrides`` applied), read-only, for
        plugins that need more.
    """

    name: str
    path: str
    architecture: str
    model_type: str
    hidden_size: int
    embedding_size: int
    max_model_len: int
    is_causal: bool
    model_tasks: frozenset[PoolingTask] = field(converter=frozenset)
    pooling_type: str = field(validator=_pooling_type)
    normalize: bool = True
    matryoshka_dimensions: tuple[int, ...] | None = field(
        default=None, converter=converters.optional(tuple)
    )
    is_matryoshka: bool = False
    dense_layers: tuple[DenseLayerSpec, ...] = field(default=(), converter=tuple)
    prompts: Mapping[str, str] = field(
        factory=dict, converter=_frozen_mapping, eq=False, hash=False
    )
    default_prompt_name: str | None = None
    lowercase: bool = False
    similarity_fn_name: str = "cosine"
    labels: tuple[str, ...] = field(default=(), converter=tuple)
    problem_type: str | None = None
    classifier_activation: str | None = None
    type_vocab_size: int = 0
    token_weight_head: str | None = None
    required_plugin: RequiredPlugin | None = None
    token_logits: TokenLogits | None = None
    image_positions: int | None = None
    images_in_prompt: bool = False
    text_padding: TextPadding | None = None
    hf_config: Mapping[str, Any] = field(
        factory=dict, converter=_frozen_mapping, eq=False, hash=False, repr=False
    )

    @property
    def token_classify_weights(self) -> bool:
        """``token_classify`` answers BGE-M3's token weights, ``[n]`` a request: a backbone with a
        :attr:`token_weight_head`, not a ``*ForTokenClassification`` head (``[num_tokens,
        num_labels]``)."""
        return self.token_weight_head is not None and not self.architecture.endswith("ForTokenClassification")

    @property
    def pooling_modes(self) -> tuple[PoolingType, ...]:
        """The pooling types :attr:`pooling_type` concatenates, in order (one for a single type)."""
        return pooling_type_parts(self.pooling_type)  # type: ignore[return-value]  # validated

    @staticmethod
    def pooled_size(hidden_size: int, pooling_type: str | None) -> int:
        """Width of a sequence-pooled vector before any Dense layer: ``hidden_size`` per
        concatenated mode, as sentence-transformers' ``Pooling.get_embedding_dimension``;
        ``None`` (a folder without a Pooling module: CLS or LAST) is one mode."""
        return hidden_size * (len(pooling_type_parts(pooling_type)) if pooling_type else 1)


PluginSource = Literal["builtin", "entrypoint", "programmatic"]


@frozen(kw_only=True)
class PluginInfo:
    """A registered plugin as ``poolrunner plugins`` lists it.

    :ivar name: Registration name; also the name used to disable it.
    :ivar source: ``builtin`` (ships with poolrunner), ``entrypoint`` (``poolrunner.plugins``
        group) or ``programmatic`` (passed in code).
    :ivar dist: Distribution that provides it, when known.
    :ivar version: That distribution's version, when known.
    :ivar hooks: Names of the hooks it implements, sorted.
    """

    name: str
    source: PluginSource
    dist: str | None = None
    version: str | None = None
    hooks: tuple[str, ...] = ()

    def describe(self) -> str:
        origin = f"{self.dist} {self.version}" if self.dist else self.source
        return f"{self.name} ({origin})"
