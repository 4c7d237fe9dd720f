"""User settings of a runtime, validated at construction."""

from __future__ import annotations

from attrs import converters, field, frozen, validators

from poolrunner.core.types import POOLING_TASKS, POOLING_TYPES, PoolingTask, PoolingType

DTYPES = ("auto", "float32", "bfloat16", "float16")


def _positive(_instance: object, attribute: object, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")  # type: ignore[attr-defined]


@frozen(kw_only=True)
class ModelOverrides:
    """Explicit settings that win over the model folder's own.

    :ivar pooling_type: Sequence pooling for ``embed`` (``CLS``, ``MEAN`` or ``LAST``).
    :ivar normalize: Default of per-request normalization.
    :ivar max_model_len: Longest accepted prompt, tokens; at most what the model supports.
    :ivar is_matryoshka: Accept ``dimensions`` for a model whose config does not say so.
    :ivar matryoshka_dimensions: The allowed ``dimensions`` (implies ``is_matryoshka``).
    """

    pooling_type: PoolingType | None = field(
        default=None, validator=validators.optional(validators.in_(POOLING_TYPES))
    )
    normalize: bool | None = None
    max_model_len: int | None = field(default=None, validator=_positive)
    is_matryoshka: bool | None = None
    matryoshka_dimensions: tuple[int, ...] | None = field(
        default=None, converter=converters.optional(tuple)
    )


@frozen(kw_only=True)
class RuntimeConfig:
    """How a :class:`~poolrunner.Runtime` loads and runs its model.

    :ivar model: Local model folder; ``None`` is the default model (all-MiniLM-L6-v2).
    :ivar task: Task to serve; ``None`` picks the model's default.
    :ivar dtype: ``auto`` (float32 on CPU, the config's half-precision dtype on CUDA),
        ``float32``, ``bfloat16`` or ``float16``.
    :ivar device: ``auto`` (CUDA when present, else CPU) or a torch device string.
    :ivar pooler_plugin: Plugin whose pooler to use when several non-built-in plugins offer one.
    :ivar max_num_batched_tokens: Token budget of one step (one forward pass).
    :ivar max_num_seqs: Most requests in one step.
    :ivar overrides: Settings that win over the model folder's.
    """

    model: str | None = None
    task: PoolingTask | None = field(
        default=None, validator=validators.optional(validators.in_(POOLING_TASKS))
    )
    dtype: str = field(default="auto", validator=validators.in_(DTYPES))
    device: str = "auto"
    pooler_plugin: str | None = None
    max_num_batched_tokens: int = field(default=8192, validator=_positive)
    max_num_seqs: int = field(default=256, validator=_positive)
    overrides: ModelOverrides = field(factory=ModelOverrides)
