"""User settings of a runtime, validated at construction: the one object every caller builds.

The Python API (``Runtime(model, **options)``), the command line, Ray jobs, the plugin test kit
and the benchmark all build a :class:`RuntimeConfig`; adding an option is one field here (plus
its command-line flag).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any

import jinja2
from attrs import Attribute, asdict, converters, field, fields, frozen

from poolrunner.core.errors import InvalidRequestError
from poolrunner.core.inputs import score_template
from poolrunner.core.inputs.images import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_IMAGES_PER_REQUEST,
    MEDIA_FETCH_TIMEOUT,
    ImageLimits,
    check_host_names,
    host_names,
    positive_seconds,
)
from poolrunner.core.types import PLUGIN_TASK_NAME, POOLING_TASKS, POOLING_TYPES, PoolingTask, PoolingType
from poolrunner.core.validators import (
    check_adapter_name,
    fraction,
    json_object,
    one_of,
    optional_bool,
    positive_int,
    task_name,
)

DTYPES = ("auto", "float32", "bfloat16", "float16", "bf16-mixed", "int8")
COMPILE_MODES = ("auto", "off")
SPEED_ONLY = "poolrunner_speed_only"
"""Field metadata key: the setting changes how fast results come, never what they are (a Ray job
resumed with another value still writes the same results)."""


def _copied_dict(value: Any) -> Any:
    """A deep copy of a mapping as a dict (``None``: empty), so no caller can change a frozen
    config afterwards; anything else is left for the validator to refuse."""
    if value is None:
        return {}
    return copy.deepcopy(dict(value)) if isinstance(value, Mapping) else value


def _jinja_text(_instance: object, attribute: Attribute, value: Any) -> None:
    """attrs validator: ``None``, or Jinja text that parses (with the loop controls transformers'
    chat templates may use).

    :raises InvalidRequestError: naming the setting and the syntax error.
    """
    if value is None:
        return
    if not isinstance(value, str) or not ("{{" in value or "{%" in value):
        raise InvalidRequestError(f"{attribute.name} must be Jinja text (a template that reads messages), "
                                  f"got {value!r:.200}")
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(value)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequestError(f"{attribute.name} is not a valid Jinja template: {exc.message} "
                                  f"(line {exc.lineno})") from None


def _lora_modules(value: Any) -> dict[str, str]:
    """``{name: path}`` (paths as strings); a name must be a non-empty string."""
    modules = dict(value or {})
    for name, path in modules.items():
        try:
            check_adapter_name(name)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"lora_modules: {exc}") from None
        modules[name] = os.fspath(path)
    return modules


def check_device(device: Any) -> None:
    """``device`` must be ``auto``, ``cpu`` or a CUDA device that is here (``cuda``, ``cuda:N``
    below the device count): poolrunner runs on those two kinds. Checked where the model loads,
    before any weight is read (a Ray job's driver names its workers' device, which it need not
    have).

    :raises InvalidRequestError: naming the value and what would work.
    """
    if device == "auto":
        return
    import torch  # not at import: `poolrunner plugins` stays torch-free

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidRequestError(f"device {device!r} is not a torch device (try auto, cpu, cuda or cuda:0)",
                                  param="device") from None
    if parsed.type not in ("cpu", "cuda"):
        raise InvalidRequestError(f"device {device!r} is of type {parsed.type}; poolrunner runs on cpu or cuda "
                                  "(auto: CUDA when present, else the CPU)", param="device")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError(f"device {device!r} asks for CUDA, but no CUDA device is available; use cpu or auto",
                                  param="device")
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise InvalidRequestError(f"device {device!r} asks for CUDA device {parsed.index}, but this machine has "
                                  f"{count} (cuda:0..cuda:{count - 1})", param="device")


def _upper(value: Any) -> Any:
    """A name in upper case (``"cls"`` -> ``"CLS"``, as TEI's ``--pooling cls`` is written); anything else as it is."""
    return value.upper() if isinstance(value, str) else value


@frozen(kw_only=True)
class ModelOverrides:
    """Explicit settings that win over the model folder's own.

    :ivar pooling_type: Sequence pooling for ``embed`` (``CLS``, ``MEAN``, ``LAST``, ``MAX``,
        ``WEIGHTEDMEAN`` or ``MEAN_SQRT_LEN``; any case).
    :ivar normalize: Default of per-request normalization.
    :ivar max_model_len: Longest accepted prompt, tokens; at most what the model supports.
    :ivar is_matryoshka: Accept ``dimensions`` for a model whose config does not say so.
    :ivar matryoshka_dimensions: The allowed ``dimensions`` (implies ``is_matryoshka``).
    """

    pooling_type: PoolingType | None = field(default=None, converter=_upper,
                                             validator=one_of(POOLING_TYPES, optional=True))
    normalize: bool | None = field(default=None, validator=optional_bool)
    max_model_len: int | None = field(default=None, validator=positive_int)
    is_matryoshka: bool | None = None
    matryoshka_dimensions: tuple[int, ...] | None = field(
        default=None, converter=converters.optional(tuple)
    )


@frozen(kw_only=True)
class RuntimeConfig:
    """How a :class:`~poolrunner.Runtime` loads and runs its model.

    :ivar model: Local model folder, or a Hugging Face hub id (``ORG/NAME``) found in the local
        Hugging Face cache (never downloaded; see
        :func:`~poolrunner.core.model.metadata.resolve_model_path`); ``None`` is the default model
        (all-MiniLM-L6-v2).
    :ivar revision: Branch, tag or commit hash of a hub id ``model``; ``None`` is ``main``.
    :ivar task: Task to serve; ``None`` picks the model's default.
    :ivar dtype: ``auto`` (on CUDA the config's half-precision dtype; on a CPU with native bf16 the
        first of ``bfloat16`` and ``bf16-mixed`` that holds the accuracy bar, see
        :mod:`poolrunner.core.precision`, else float32), ``float32``, ``bfloat16``,
        ``float16``, ``bf16-mixed`` (float32 weights and activations, bfloat16 matrix products;
        the CPU with ``compile="auto"`` only) or ``int8`` (linear layers as dynamic int8
        products calibrated at load, the rest bfloat16, or float32 where bfloat16 activations
        alone miss the bar: :mod:`poolrunner.core.kernels.int8`; the CPU with ``compile="auto"``
        and native bf16 only; the layers whose int8 error the model cannot afford stay in
        bfloat16, chosen at load so that the probe outputs stay within cosine 0.999 of float32's;
        refused when even all of them in bfloat16 over float32 activations miss it).
    :ivar device: ``auto`` (CUDA when present, else CPU) or a torch device string.
    :ivar compile: ``auto``: on the CPU, linear layers run with weights prepacked for oneDNN once at
        load, bias and known activations fused into the matmul (:mod:`poolrunner.core.kernels.onednn`;
        float32 ones only with AVX-512: without it torch's own products are faster),
        and attention and RMSNorm in poolrunner's own kernels where they build
        (:mod:`poolrunner.core.kernels.cpu_kernels`); on CUDA, attention in half precision in
        flash attention's variable-length kernel (:mod:`poolrunner.core.kernels.cuda_attention`);
        ``off``: transformers' modules and torch's attention as they are.
    :ivar load_entrypoints: Load the ``poolrunner.plugins`` entry-point group.
    :ivar disable_plugins: Names of plugins to leave out (built-ins too).
    :ivar pooler_plugin: Plugin whose pooler to use when several non-built-in plugins offer one.
    :ivar async_scheduling: Launch the next step before collecting the previous step's results;
        ``None`` turns it on where it helps (CUDA, where copies overlap compute).
    :ivar max_num_batched_tokens: Token budget of one step (one forward pass); ``None`` picks
        :func:`default_token_budget` for the device (and, on the CPU, the products' dtype).
    :ivar max_num_seqs: Most requests in one step.
    :ivar batch_wait_fraction: While serving (:meth:`~poolrunner.Runtime.serving`: the server, Ray
        Serve replicas), how long a step may wait for the callers of the last one to send again,
        as a fraction of that step's duration: when the engine has run out of work and fewer calls
        are pending than were during the last step, the next step waits until as many are, or
        their requests fill a step; a lone caller never waits
        (:class:`~poolrunner.core.engine.loop.EngineLoop`). ``0`` (default): never wait; 0.25
        helps closed-loop clients that come back fast (bench/README.md, "the batch wait").
    :ivar max_embed_len: Accept ``embed`` inputs longer than the model's ``max_model_len``, up to
        this many tokens: each runs in windows of ``max_model_len`` tokens whose vectors are
        combined (vLLM's chunked processing; MEAN pooling only; see
        :mod:`poolrunner.core.frontend.chunking`). Must be above ``max_model_len``. ``None``: such inputs
        are an error unless truncated.
    :ivar max_input_chars: Longest text input, characters; a longer one is refused before it is
        tokenized, unless it is truncated and the kept tokens are found in a window of it
        (:mod:`poolrunner.core.inputs.cutting`). ``None``: :func:`default_max_input_chars` of
        ``max_embed_len``, else of the model's ``max_model_len``.
    :ivar hf_overrides: Keys set on the folder's transformers config before anything is read from
        it, as vLLM's ``hf_overrides`` (:mod:`poolrunner.core.model.hf_overrides`); with
        ``classifier_from_token`` (and ``method``, ``is_original_qwen3_reranker``) a causal LM
        classifies from those tokens' logits (:mod:`poolrunner.core.model.token_logits`).
    :ivar score_template: Jinja formatting each (query, document) pair into one prompt before a
        cross-encoder scores it, or the name of a built-in one (``qwen3_reranker``,
        ``bge_reranker_v2_gemma``); ``None``: the built-in the folder asks for, if any
        (:mod:`poolrunner.core.inputs.score_template`).
    :ivar chat_template: Jinja text rendering the ``messages`` of HTTP requests in place of the
        tokenizer's own chat template (vLLM's ``--chat-template``), e.g. for a folder without one;
        ``None``: the tokenizer's.
    :ivar lora_modules: LoRA adapters to load at start, name -> PEFT folder (vLLM's
        ``--lora-modules``); requests pick one by name (``lora=NAME``). Setting this or
        ``max_loras`` serves adapters: the linear layers are then prepacked without fused activations
        (an adapter's term comes before the activation), and ``dtype="int8"`` is refused.
    :ivar max_loras: Most adapters resident in the model at once (vLLM's ``--max-loras``);
        ``lora_modules`` may name more: past it the least recently used idle one is unloaded and
        loaded again from its folder when a request names it; while every resident one has
        requests in flight, a request needing another waits its turn. ``None``: as many as
        ``lora_modules`` (at least 1).
    :ivar max_lora_rank: Largest adapter rank served (vLLM's default, 16).
    :ivar max_image_bytes: Most bytes of one encoded image (a file, bytes, a data URL's payload,
        a download); a text-image model refuses a larger one naming it.
    :ivar max_image_pixels: Most pixels (width x height, as the image's header declares, read
        before any pixel is decoded: a decompression bomb never decodes) of one image.
    :ivar max_images_per_request: Most images in one request (a call of the Python API, one HTTP
        request, one chunk of a file on the command line).
    :ivar allowed_media_domains: Hosts whose ``http(s)`` image URLs are fetched (vLLM's
        ``--allowed-media-domains``, exact host names); empty (default): every remote URL is
        refused and nothing is downloaded.
    :ivar media_fetch_timeout: Seconds one image download may take to connect, and per read.
    :ivar overrides: Settings that win over the model folder's.

    The image settings make :meth:`image_limits`, the same on every surface
    (:class:`~poolrunner.core.inputs.images.ImageLimits` checks them).
    Fields marked :data:`SPEED_ONLY` change speed, never results.
    """

    model: str | None = field(default=None, converter=converters.optional(os.fspath))
    revision: str | None = None
    task: PoolingTask | None = field(
        default=None, validator=task_name(POOLING_TASKS, PLUGIN_TASK_NAME, optional=True)
    )
    dtype: str = field(default="auto", validator=one_of(DTYPES))
    device: str = field(default="auto", metadata={SPEED_ONLY: True})
    compile: str = field(default="auto", validator=one_of(COMPILE_MODES), metadata={SPEED_ONLY: True})
    load_entrypoints: bool = True
    disable_plugins: tuple[str, ...] = field(default=(), converter=tuple)
    pooler_plugin: str | None = None
    async_scheduling: bool | None = field(default=None, validator=optional_bool, metadata={SPEED_ONLY: True})
    max_num_batched_tokens: int | None = field(default=None, validator=positive_int, metadata={SPEED_ONLY: True})
    max_num_seqs: int = field(default=256, validator=positive_int, metadata={SPEED_ONLY: True})
    batch_wait_fraction: float = field(default=0.0, validator=fraction, metadata={SPEED_ONLY: True})
    max_embed_len: int | None = field(default=None, validator=positive_int)
    max_input_chars: int | None = field(default=None, validator=positive_int)
    hf_overrides: dict[str, Any] = field(factory=dict, converter=_copied_dict, validator=json_object, hash=False)
    score_template: str | None = field(default=None, validator=score_template.check_setting)
    chat_template: str | None = field(default=None, validator=_jinja_text)
    lora_modules: dict[str, str] = field(factory=dict, converter=_lora_modules, hash=False)
    max_loras: int | None = field(default=None, validator=positive_int)
    max_lora_rank: int = field(default=16, validator=positive_int)
    max_image_bytes: int = field(default=MAX_IMAGE_BYTES, validator=positive_int)
    max_image_pixels: int = field(default=MAX_IMAGE_PIXELS, validator=positive_int)
    max_images_per_request: int = field(default=MAX_IMAGES_PER_REQUEST, validator=positive_int)
    allowed_media_domains: tuple[str, ...] = field(default=(), converter=host_names, validator=check_host_names)
    media_fetch_timeout: float = field(default=MEDIA_FETCH_TIMEOUT, validator=positive_seconds)
    overrides: ModelOverrides = field(factory=ModelOverrides)

    def __attrs_post_init__(self) -> None:
        if self.lora_enabled and self.dtype == "int8":
            raise InvalidRequestError("dtype 'int8' does not serve LoRA adapters (lora_modules, max_loras): "
                                      "its calibrated int8 layers have no adapter term")

    @property
    def lora_enabled(self) -> bool:
        """Whether this runtime serves LoRA adapters."""
        return bool(self.lora_modules) or self.max_loras is not None

    @property
    def lora_capacity(self) -> int:
        """How many adapters may be resident at once (0: adapters are not served)."""
        if not self.lora_enabled:
            return 0
        return self.max_loras if self.max_loras is not None else max(len(self.lora_modules), 1)

    def image_limits(self) -> ImageLimits:
        """The image settings as :class:`~poolrunner.core.inputs.images.ImageLimits` (checked here already)."""
        return ImageLimits(max_bytes=self.max_image_bytes, max_pixels=self.max_image_pixels,
                           max_images=self.max_images_per_request, allowed_media_domains=self.allowed_media_domains,
                           fetch_timeout=self.media_fetch_timeout)

    @classmethod
    def from_options(cls, model: str | os.PathLike[str] | None = None, **options: Any) -> RuntimeConfig:
        """The flat keyword form ``Runtime(model, **options)`` takes: the names of
        :class:`ModelOverrides` fields go into :attr:`overrides`, the others are fields here.

        :raises TypeError: naming an option that is neither, and the known ones.
        """
        override_names = {a.name for a in fields(ModelOverrides)}
        own_names = {a.name for a in fields(cls)} - {"model", "overrides"}
        unknown = sorted(set(options) - override_names - own_names)
        if unknown:
            raise TypeError(
                f"unknown runtime option(s) {', '.join(map(repr, unknown))}; known: "
                f"{', '.join(sorted(own_names | override_names))}"
            )
        overrides = ModelOverrides(**{k: v for k, v in options.items() if k in override_names})
        return cls(model=model, overrides=overrides, **{k: v for k, v in options.items() if k in own_names})

    def recorded(self) -> dict[str, Any]:
        """The settings that decide results, as JSON-ready values, defaults left out (overrides
        flattened): what a Ray job records to tell a resumed job from a different one."""
        default = RuntimeConfig()
        values = {**_results_only(self), **asdict(self.overrides)}
        defaults = {**_results_only(default), **asdict(default.overrides)}
        return {name: value for name, value in sorted(values.items()) if value != defaults.get(name)}


def _results_only(config: RuntimeConfig) -> dict[str, Any]:
    return asdict(config, recurse=False, filter=lambda a, _v: not a.metadata.get(SPEED_ONLY) and a.name != "overrides")


INPUT_CHARS_PER_TOKEN = 32
"""Characters per token of the default ``max_input_chars``. English runs 4-5 characters a token and
code or URLs up to about 10; a token of more than 20-30 characters is rare outside pathological
input (runs of one character, base64), so a text over 32 per token almost never fits the model."""


def default_max_input_chars(max_tokens: int) -> int:
    """``max_input_chars`` when not set: :data:`INPUT_CHARS_PER_TOKEN` characters for each of the
    ``max_tokens`` an input may have (8192 for all-MiniLM-L6-v2's 256)."""
    return INPUT_CHARS_PER_TOKEN * max_tokens


# Measured on 2 CPU cores with all-MiniLM-L6-v2 (bench/embed_throughput.py): steps of 2048
# tokens ran 1.46x faster than steps of 8192 (matrix multiplies stay in cache); GPUs want
# large steps to fill the device.
CPU_TOKEN_BUDGET = 2048
TILES_TOKEN_BUDGET = 4096
"""The CPU's step budget where bf16 products run on AMX tiles: there they are fast enough that
each step's own costs show. Measured on 2 AMX Xeon cores, 4,096 against 2,048 tokens, interleaved
(6-8 rounds): all-MiniLM-L6-v2 bf16 documents 1.11x, paragraphs 1.05x, queries 1.00x, SmolLM2-135M
1.05x; float32 paragraphs 0.93x, documents 0.95x, bf16-mixed documents 0.97x, paragraphs 0.98x (those keep 2,048)."""
CUDA_TOKEN_BUDGET = 16384


def default_token_budget(device_type: str, bf16_tiles: bool = False) -> int:
    """The step budget used when ``max_num_batched_tokens`` is not set.

    :param bf16_tiles: The model runs in bf16 (activations and products) on a CPU with AMX tiles
        (:data:`TILES_TOKEN_BUDGET`).
    """
    if device_type == "cuda":
        return CUDA_TOKEN_BUDGET
    return TILES_TOKEN_BUDGET if bf16_tiles else CPU_TOKEN_BUDGET
