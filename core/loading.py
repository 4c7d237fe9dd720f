"""The load sequence: from a :class:`RuntimeConfig` to a model ready to serve.

plugin manager -> model folder, config, tokenizer -> the plugin a folder format needs
(``claim_model_folder``) -> :class:`ModelConfig` -> task check (before
the slow weight load, so a wrong task fails fast) -> device -> weights in each candidate dtype
(the CPU's ``auto`` probes bfloat16 against float32), prepacked for oneDNN on the CPU -> pooler,
runner, scheduler, engine.
:class:`~poolrunner.core.runtime.Runtime` serves what this returns; nothing here serves.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from attrs import frozen
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from poolrunner.core import memory, precision
from poolrunner.core.config import ModelOverrides, RuntimeConfig, default_max_input_chars, default_token_budget
from poolrunner.core.engine.engine import Engine
from poolrunner.core.engine.runner import ModelRunner
from poolrunner.core.engine.scheduler import Scheduler
from poolrunner.core.errors import ModelLoadError, PluginConflictError, UnsupportedTaskError
from poolrunner.core.frontend import chunking
from poolrunner.core.hooks import Hooks
from poolrunner.core.inputs import score_template
from poolrunner.core.inputs.images import ImageInputs, ImageLimits
from poolrunner.core.inputs.pages import PageInputs
from poolrunner.core.inputs.score_template import ScoreTemplate
from poolrunner.core.inputs.tokenize import InputProcessor
from poolrunner.core.kernels import (
    cpu_kernels,
    cuda_attention,
    fused_deberta,
    fused_mpnet,
    fused_norms,
    fused_rotary,
    onednn,
)
from poolrunner.core.model import bert_layers, decoder_layers, families, loader, metadata, siglip, token_logits
from poolrunner.core.model.hf_overrides import apply_hf_overrides
from poolrunner.core.model.towers import TextImageModel
from poolrunner.core.plugin_api.options import RequestOptions
from poolrunner.core.selection import required_plugin, resolve_task, select_pooler, served_tasks
from poolrunner.core.types import ModelConfig, PoolingParams, PoolingRequest, PoolingTask

logger = logging.getLogger(__name__)


@frozen(kw_only=True, eq=False)
class LoadedModel:
    """Everything a runtime serves with.

    :ivar config: The settings it was loaded with.
    :ivar hooks: The frozen plugin manager (``hooks.manager``) and typed calls into it.
    :ivar model_config: What poolrunner knows of the model.
    :ivar task: The default task (the one named at load, else the model's default).
    :ivar tasks: Every task served: the named one alone, else each task the model's head and the
        plugins allow whose pooler could be built (requests choose theirs).
    :ivar device: Where the model runs.
    :ivar precision: How it computes (``dtype="auto"`` resolved).
    :ivar inputs: Prompts, tokenization and truncation for this model.
    :ivar options: The request options the plugins declare (``request_options``).
    :ivar engine: Scheduler, runner and pooler, ready for requests.
    :ivar score_template: What formats each (query, document) pair before a cross-encoder scores
        it (``config.score_template``, or the built-in the folder asks for); ``None``: pairs as they are.
    :ivar images: A text-image model's image inputs (its own image processor), or a page-retrieval
        model's (:class:`PageInputs`: its own processor); ``None``: text only.
    :ivar image_score: ``(logit_scale, logit_bias)`` of a text-image family that scores a (text,
        image) pair ``sigmoid(cosine * exp(logit_scale) + logit_bias)`` (SigLIP); ``None``: cosine.
    """

    config: RuntimeConfig
    hooks: Hooks
    model_config: ModelConfig
    task: PoolingTask
    tasks: frozenset[PoolingTask]
    device: torch.device
    precision: precision.Precision
    inputs: InputProcessor
    options: RequestOptions
    engine: Engine
    score_template: ScoreTemplate | None = None
    images: ImageInputs | None = None
    image_score: tuple[float, float] | None = None


def load(config: RuntimeConfig, plugins: Sequence[object] = ()) -> LoadedModel:
    """Load ``config``'s model with its plugins (``plugins`` registered beside the built-ins and,
    if ``config.load_entrypoints``, the installed entry points).

    :raises ModelLoadError: if the model cannot be loaded or is refused, or ``config.max_embed_len``
        does not fit it (see :func:`~poolrunner.core.frontend.chunking.check_config`).
    :raises UnsupportedTaskError: if ``config.task`` is not served for this model by the plugins.
    :raises PluginLoadError: if a plugin fails to import or names an unknown hook.
    :raises PluginConflictError: if two plugins declare one request option.
    """
    hooks = _plugins(config, plugins)
    path = metadata.resolve_model_path(config.model, config.revision)
    hf_config, tokenizer, model_config = read_model(path, hooks, config.overrides, config.hf_overrides)
    if config.chat_template is not None:  # the one the HTTP messages are rendered with
        tokenizer.chat_template = config.chat_template
    task = resolve_task(hooks, model_config, config.task)
    template = score_template.for_runtime(config.score_template, model_config, task, _special_tokens(tokenizer))
    wanted = [task] if config.task else [task, *sorted(served_tasks(hooks, model_config) - {task})]
    chunking.check_config(config.max_embed_len, model_config, wanted)
    options = hooks.request_options(model_config=model_config)
    device = loader.resolve_device(config.device)
    max_input_chars = config.max_input_chars or default_max_input_chars(config.max_embed_len
                                                                        or model_config.max_model_len)
    inputs = InputProcessor(tokenizer, model_config, max_input_chars=max_input_chars)
    images = _image_inputs(path, hf_config, model_config, config.image_limits())
    build = functools.partial(_build_engine, config, path, hf_config, hooks, model_config, wanted, device)
    fast_path = config.compile == "auto" and onednn.supported(device, torch.float32)
    mixed_path = fast_path and onednn.supported(device, torch.bfloat16)  # bf16 products, as bf16-mixed's
    if config.dtype == "auto" and precision.native_bf16(device):
        candidates = precision.AUTO_CANDIDATES if mixed_path else (precision.BFLOAT16,)
        engine, chosen = precision.choose_cpu_precision(build, _probe_requests(inputs, wanted, options), candidates)
        memory.release_memory()  # glibc keeps the freed probe engines' pages (up to ~1 GiB at 137M parameters)
    elif config.dtype == precision.INT8.name:
        _check_int8(config, device, mixed_path)
        engine, chosen = precision.quantize_checked(build, _probe_requests(inputs, wanted, options, words_from=1),
                                                    _probe_requests(inputs, wanted, options))
        memory.release_memory()
    else:
        chosen = _explicit_precision(config, hf_config, device, mixed_path)
        engine = build(chosen)
    tasks = frozenset(engine.runner.poolers)
    logger.info("loaded %s (%s) for tasks %s (default %r) on %s as %s", path, model_config.architecture,
                sorted(tasks), task, device, chosen.name)
    return LoadedModel(config=config, hooks=hooks, model_config=model_config, task=task,
                       tasks=tasks, device=device, precision=chosen, inputs=inputs, options=options, engine=engine,
                       score_template=template, images=images, image_score=_image_score(engine))


def _image_score(engine: Engine) -> tuple[float, float] | None:
    """A sigmoid-scored text-image family's ``(logit_scale, logit_bias)`` (SigLIP), from its weights."""
    backbone = engine.runner.backbone
    return backbone.pair_score() if isinstance(backbone, TextImageModel) else None


def _image_inputs(path: Path, hf_config: PretrainedConfig, model_config: ModelConfig,
                  limits: ImageLimits) -> ImageInputs | None:
    """A text-image model's image inputs, its processor checked to give the family's pixel shape;
    a page-retrieval model's, its own processor (:class:`PageInputs`)."""
    if model_config.images_in_prompt:
        return PageInputs.load(path, limits=limits)
    if not model_config.image_positions:
        return None
    towers = metadata.text_image_towers(hf_config.model_type)
    shape = towers.pixel_shape(hf_config, model_config.image_positions)
    return ImageInputs.load(path, hf_config.vision_config, limits, shape=shape)


def _explicit_precision(
    config: RuntimeConfig, hf_config: PretrainedConfig, device: torch.device, mixed_path: bool,
) -> precision.Precision:
    """The precision a ``dtype`` other than a measured ``auto`` names.

    :param mixed_path: Whether the CPU fast path runs bfloat16 products here.
    :raises ModelLoadError: for ``bf16-mixed`` off that path, which alone runs it.
    """
    if config.dtype == "auto":
        return precision.PRECISIONS[str(loader.auto_dtype(hf_config, device)).removeprefix("torch.")]
    if config.dtype == precision.BF16_MIXED.name and not mixed_path:
        raise ModelLoadError(f"dtype {config.dtype!r} needs {_the_fast_path(config, device)}")
    return precision.PRECISIONS[config.dtype]


def _the_fast_path(config: RuntimeConfig, device: torch.device) -> str:
    """What a dtype that only the CPU fast path runs needs, and what this runtime has instead."""
    bf16 = onednn.supported(device, torch.bfloat16)
    return (f"the CPU fast path (compile='auto' on a CPU whose oneDNN multiplies bfloat16: AVX-512 BW/VL/DQ or "
            f"AVX-NE-CONVERT); this runtime has device {device.type!r}, compile={config.compile!r} and "
            f"{'' if bf16 else 'no '}oneDNN bfloat16 products")


def _check_int8(config: RuntimeConfig, device: torch.device, mixed_path: bool) -> None:
    """:raises ModelLoadError: where ``dtype="int8"`` cannot run: it needs the CPU fast path, a
        CPU with native bf16 and poolrunner's kernels."""
    if not mixed_path:
        reason = _the_fast_path(config, device)
    elif not precision.native_bf16(device):
        reason = "a CPU that multiplies bfloat16 natively (AVX512-BF16 or AMX)"
    elif torch.bfloat16 not in cpu_kernels.supported_dtypes():
        reason = "poolrunner's CPU kernels, which could not be built here (see the warning above)"
    else:
        if cpu_kernels.has_amx():
            # Both products run on AMX tiles there, bound by memory more than arithmetic: int8's
            # int32 outputs are twice bf16's bytes, and its two passes around them come on top.
            logger.warning("dtype 'int8' is slower than 'bfloat16' on this CPU (AMX): its products are no faster "
                           "than bfloat16's and it adds a quantization and a conversion pass "
                           "(all-MiniLM-L6-v2: 0.6-0.7x bfloat16's speed; bench/README.md)")
        return
    raise ModelLoadError(f"dtype 'int8' needs {reason}")


def declared_options(config: RuntimeConfig, plugins: Sequence[object] = ()) -> RequestOptions:
    """The request options the plugins declare for ``config``'s model; no weights are loaded.

    :raises ModelLoadError: if the folder cannot be read or describes something poolrunner refuses.
    """
    hooks = _plugins(config, plugins)
    path = metadata.resolve_model_path(config.model, config.revision)
    _, _, model_config = read_model(path, hooks, config.overrides, config.hf_overrides)
    return hooks.request_options(model_config=model_config)


def _plugins(config: RuntimeConfig, plugins: Sequence[object]) -> Hooks:
    return Hooks.build(plugins=plugins, load_entrypoints=config.load_entrypoints, disable=config.disable_plugins)


def read_model(
    path: Path, hooks: Hooks, overrides: ModelOverrides,
    hf_overrides: Mapping[str, Any] | None = None,
) -> tuple[PretrainedConfig, PreTrainedTokenizerBase, ModelConfig]:
    """A local folder's config (``hf_overrides`` applied), tokenizer and :class:`ModelConfig`, with
    the plugin its format needs as ``hooks``' plugins judge it (``claim_model_folder``) and the
    token-logit classifier the overrides ask for; no weights are loaded.

    :raises ModelLoadError: if the folder cannot be read or describes something poolrunner refuses.
    """
    hf_config = families.load_hf_config(path)
    folder_architecture = families.architecture_name(hf_config)
    apply_hf_overrides(hf_config, hf_overrides or {}, path)
    families.check_config(path, hf_config)
    architecture = families.architecture_name(hf_config)
    tokenizer = loader.load_tokenizer(path)
    logits = token_logits.read_token_logits(hf_config, tokenizer, folder_architecture, path)
    required = required_plugin(hooks, path, architecture)
    families.architecture_class(architecture, hf_config.model_type, path, claimed=required is not None)
    model_config = metadata.load_model_config(path, hf_config, tokenizer.model_max_length, overrides, required)
    if logits is not None:
        model_config = attrs.evolve(model_config, token_logits=logits)
    if hf_config.model_type in siglip.SIGLIP_FAMILIES and model_config.image_positions:
        model_config = attrs.evolve(model_config, text_padding=siglip.text_padding(path, hf_config, tokenizer))
    return hf_config, tokenizer, model_config


def _special_tokens(tokenizer: PreTrainedTokenizerBase) -> dict[str, str]:
    """The tokenizer's named special tokens (``bos_token``...) as strings, for templates."""
    return {name: str(value) for name, value in tokenizer.special_tokens_map.items() if isinstance(value, str)}


def _build_engine(
    config: RuntimeConfig, path: Path, hf_config: PretrainedConfig, hooks: Hooks,
    model_config: ModelConfig, tasks: list[PoolingTask], device: torch.device, chosen: precision.Precision,
) -> Engine:
    """Load the weights in ``chosen``'s dtype, prepack them for oneDNN where the fast path runs,
    and assemble the poolers, runner, scheduler and engine.

    ``tasks[0]`` is the default task: its pooler must build. Another task whose pooler cannot be
    built (no plugin offers one, two conflict, the folder lacks a file it needs) is left out of
    the served set, with a log line; a request for it then gets the usual clear error.
    """
    model = loader.load_model(path, hf_config, chosen.weights, device, model_config.token_logits,
                              claimed=model_config.required_plugin is not None,
                              image_positions=model_config.image_positions, text_padding=model_config.text_padding)
    # Built here, at load, so that no request waits for a compile.
    kernels = cpu_kernels.supported_dtypes() if config.compile == "auto" and device.type == "cpu" else frozenset()
    # On CUDA, flash attention's variable-length kernel takes each dtype it serves (cuda_attention).
    native_attention = chosen.weights in kernels or (
        config.compile == "auto" and device.type == "cuda" and cuda_attention.available())
    products = chosen.weights if chosen.matmul == torch.int8 else chosen.matmul
    if (config.compile == "auto" and onednn.supported(device, chosen.weights) and onednn.supported(device, products)
            and onednn.pays(chosen.matmul)):
        # Served adapters add their term to a layer's output, before its activation: none fused.
        onednn.prepack(model.base_model, chosen.matmul, fuse=not config.lora_enabled)
    fused_norms.fuse_rms_norms(model.base_model, kernels)
    fused_rotary.fuse_rotary(model.base_model, kernels)
    # Served adapters find their layers by name and slice each layer's rows by adapter: every
    # layer stays transformers' modules, every row is computed.
    direct = config.compile == "auto" and not config.lora_enabled
    if config.compile == "auto":
        fused_mpnet.fuse_mpnet_attention(model.base_model, join_projections=direct)
        fused_deberta.fuse_deberta_attention(model.base_model, kernels)
    rows_layer = direct and (bert_layers.run_layers_directly(model.base_model)
                             or decoder_layers.run_layers_directly(model.base_model))
    poolers = {}
    for task in tasks:
        try:
            poolers[task] = select_pooler(hooks, model_config, task, model, config.pooler_plugin).to(device)
        except (UnsupportedTaskError, PluginConflictError, ModelLoadError) as exc:
            if task == tasks[0]:
                raise
            logger.info("task %r is not served: %s", task, exc)
    bf16_tiles = (device.type == "cpu" and chosen.weights == chosen.matmul == torch.bfloat16
                  and cpu_kernels.has_amx())
    budget = config.max_num_batched_tokens or default_token_budget(device.type, bf16_tiles)
    if device.type == "cpu":
        memory.keep_step_buffers(memory.step_block_bytes(model, budget))
    runner = ModelRunner(model, poolers, hooks, model_config, default_task=tasks[0],
                         bucket_tokens=device.type == "cpu", native_attention=native_attention,
                         rows_layer=rows_layer)
    scheduler = Scheduler(max_num_batched_tokens=budget, max_num_seqs=config.max_num_seqs,
                          chunked_prefill=runner.causal)
    async_scheduling = device.type == "cuda" if config.async_scheduling is None else config.async_scheduling
    return Engine(runner, scheduler, hooks, model_config, device, async_scheduling=async_scheduling)


def _probe_requests(inputs: InputProcessor, tasks: Sequence[PoolingTask],
                    options: RequestOptions, words_from: int = 0) -> list[PoolingRequest]:
    """:func:`~poolrunner.core.precision.probe_texts` as requests of each of ``tasks``
    (with their options' defaults), each at most ``LONG_PROBE_TOKENS`` long: every task the
    runtime serves is held to the bar, not only its default one."""
    texts = precision.probe_texts(inputs.tokenizer, inputs.model_config.max_model_len, words_from)
    keep = min(inputs.model_config.max_model_len, precision.LONG_PROBE_TOKENS)
    encoded = inputs.encode(texts, truncate_prompt_tokens=keep)
    return [
        PoolingRequest(request_id=f"probe-{task}-{i}", prompt_token_ids=ids,
                       params=PoolingParams(task=task, extra_kwargs=options.resolve(task, {})))
        for task in tasks for i, ids in enumerate(encoded)
    ]
