"""The runtime's numeric precision, and ``dtype="auto"`` on the CPU: the fastest precision that
holds the accuracy bar for this model, measured at load.

bf16 only pays on CPUs that multiply it natively (AVX512-BF16 or AMX); elsewhere it is emulated
and slower than fp32. Where it is native it is about twice as fast (a bf16 ``[2048, 384] x
[384, 1536]`` product: 430 against 190 GFLOP/s on 2 Zen 4 cores), but whether a model keeps its
accuracy in bf16 is a property of the model. So the choice is measured at load, on this machine:
the model runs probe texts (:func:`probe_texts`) in fp32 and then in each candidate of
:data:`AUTO_CANDIDATES`, fastest first, and the first whose every probe output stays within
:data:`MAX_RELATIVE_ERROR` of fp32 (an output of one value, a cross-encoder's score: within
:data:`MAX_SCORE_ERROR`, absolute) is kept; else fp32.

The candidates are bfloat16 (everything in bf16, as transformers runs a bf16 model) and
``bf16-mixed``: float32 weights and activations, only the matrix products in bf16 (their inputs
and outputs rounded to it; the name and the split are those of Lightning's
``precision="bf16-mixed"``). Rounding the residual stream,
LayerNorm, softmax and pooling to bf16 is what costs most of bf16's accuracy, and the products
are most of its speed: all-MiniLM-L6-v2 on 1,000 paragraphs and 600 single words, on 2 Zen 4
cores (AVX512-BF16, no AMX), against fp32: bf16 min cosine 0.99991 / 0.99984 (under the bar) at
755 texts/s, bf16-mixed 0.99998 / 0.99994 at 705 texts/s, fp32 470 texts/s.

The probe must contain the inputs bf16 handles worst, or a model that misses the bar passes it:
for all-MiniLM-L6-v2 six sentences stayed above cosine 0.9999 while single words reached
0.99984 (3.5% of 400 vocabulary words under the bar). So the probe adds
:data:`NUM_PROBE_WORDS` single words from the model's own vocabulary and one input as long as the
model takes (up to :data:`LONG_PROBE_TOKENS`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn

import torch
from attrs import frozen
from transformers import PreTrainedTokenizerBase

from poolrunner.core.block_replay import BlockReplay, block_of
from poolrunner.core.engine.engine import Engine
from poolrunner.core.errors import ModelLoadError
from poolrunner.core.kernels import cpu_kernels, int8
from poolrunner.core.plugin_api.output import RequestOutput
from poolrunner.core.types import PoolingRequest

logger = logging.getLogger(__name__)

@frozen
class Precision:
    """How the model computes: its weights' (and activations') dtype and its matmuls' dtype.

    :ivar name: The ``dtype`` option that selects it.
    """

    name: str
    weights: torch.dtype
    matmul: torch.dtype


FLOAT32 = Precision("float32", torch.float32, torch.float32)
BFLOAT16 = Precision("bfloat16", torch.bfloat16, torch.bfloat16)
FLOAT16 = Precision("float16", torch.float16, torch.float16)
BF16_MIXED = Precision("bf16-mixed", torch.float32, torch.bfloat16)
INT8 = Precision("int8", torch.bfloat16, torch.int8)
"""bfloat16 model, linear layers as dynamic int8 products (:mod:`poolrunner.core.kernels.int8`)."""
INT8_OVER_FLOAT32 = Precision("int8", torch.float32, torch.int8)
"""float32 model (weights and activations, as ``bf16-mixed``), linear layers as int8 products."""
INT8_ACTIVATIONS = (INT8, INT8_OVER_FLOAT32)
"""What ``dtype="int8"`` tries, fastest first: the first whose activations hold the int8 bar."""
PRECISIONS = {p.name: p for p in (FLOAT32, BFLOAT16, FLOAT16, BF16_MIXED, INT8)}
AUTO_CANDIDATES = (BFLOAT16, BF16_MIXED)
"""What ``auto`` tries on a CPU with native bf16, fastest first."""

MAX_RELATIVE_ERROR = 2e-4**0.5
"""Largest ``||bf16 - fp32|| / ||fp32||`` accepted per probe output, about 1.41%: for unit
vectors exactly the embedding bar ``cosine >= 0.9999``, applied alike to every task's output."""

MAX_INT8_RELATIVE_ERROR = 2e-3**0.5
"""The int8 bar, about 4.47%: cosine >= 0.999 for unit vectors."""

MAX_SCORE_ERROR = 1e-4
"""Largest ``|bf16 - fp32|`` accepted for an output of one value (a cross-encoder's score, a
regression): a relative bar would let a probability near 0.5 move by 7e-3, enough to swap
near-tied rerank results; 1e-4 is the parity bar against sentence-transformers' CrossEncoder."""

PROBE_TEXTS = (
    "Hello!",
    "What is the capital of France?",
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "Interest rates rose again this quarter, and economists expect inflation to ease slowly "
    "as supply chains recover and energy prices settle.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Photosynthesis converts light energy into chemical energy: chlorophyll absorbs sunlight, "
    "water is split, oxygen is released, and carbon dioxide is fixed into sugars in the Calvin "
    "cycle. It sustains nearly all life on Earth and shapes the composition of the atmosphere.",
)
"""Short and long, prose and code: bf16 error grows with length and with unusual tokens."""

NUM_PROBE_WORDS = 512
"""Single-word probes. all-MiniLM-L6-v2 in bf16 misses the bar on 3.5% of its vocabulary's words
on a Zen 4 CPU and on 2.8% (of 21,722) on an AMX Xeon, where 128 probe words all held it (max
0.998 of the bar) and ``auto`` chose bf16; 512 words miss a model failing on 2.8% of them with
probability about 5e-7, at a few milliseconds of load time."""

SENSITIVITY_TEXTS = 40
"""Calibration texts each layer's sensitivity is measured on: the first, the probe sentences and
short words (:func:`probe_texts`), so that one run per layer stays cheap."""

LONG_PROBE_TOKENS = 512
"""The long probe's length cap, in tokens (the model maximum when smaller): bounded load time."""


def probe_texts(tokenizer: PreTrainedTokenizerBase, max_model_len: int, words_from: int = 0) -> list[str]:
    """:data:`PROBE_TEXTS`, single words of the tokenizer's vocabulary (whole words, spread
    evenly over it, the same on every load), and one long text (callers truncate it to
    ``min(max_model_len, LONG_PROBE_TOKENS)`` tokens).

    :param words_from: Shifts the choice of words: another value gives other words (int8's
        calibration texts are the probe's with ``words_from=1``, so the probe judges held-out words).
    """
    vocabulary = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    stride = max(1, len(vocabulary) // (8 * NUM_PROBE_WORDS))
    words: list[str] = []
    for token, _ in vocabulary[::stride]:
        word = tokenizer.convert_tokens_to_string([token]).strip()
        if len(word) >= 2 and word.isalpha() and word not in words:
            words.append(word)
    step = max(1, len(words) // NUM_PROBE_WORDS)
    long_text = " ".join([PROBE_TEXTS[-1]] * (1 + min(max_model_len, LONG_PROBE_TOKENS) // 8))
    return [*PROBE_TEXTS, *words[words_from::step][:NUM_PROBE_WORDS], long_text]


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` is a CPU that multiplies bf16 natively (AVX512-BF16 or AMX tiles)."""
    if device.type != "cpu":
        return False
    return torch.cpu._is_avx512_bf16_supported() or cpu_kernels.has_amx()


def choose_cpu_precision(
    build: Callable[[Precision], Engine], probes: Sequence[PoolingRequest],
    candidates: Sequence[Precision] = AUTO_CANDIDATES,
) -> tuple[Engine, Precision]:
    """Build the engine in the first of ``candidates`` whose outputs on ``probes`` match fp32's,
    else in fp32.

    Each engine is freed before the next is built, so peak memory stays one model.

    :param build: Builds the whole engine (model, pooler, runner) in the given precision.
    :param probes: Requests of every task the runtime may serve (those of a task whose pooler
        was not built are left out); outputs are compared per request and per named output.
    :returns: The engine to serve with and its precision.
    """
    engine = build(FLOAT32)
    probes = _served(probes, engine)
    reference = _run(engine, probes)
    for candidate in candidates:
        del engine
        engine = build(candidate)
        excess = _excess(reference, _run(engine, probes), MAX_RELATIVE_ERROR)
        if excess <= 1:
            logger.info("dtype auto: %s (probe error %.3f of its bar against float32)", candidate.name, excess)
            return engine, candidate
        logger.info("dtype auto: not %s (probe error %.2f times its bar)", candidate.name, excess)
    del engine
    return build(FLOAT32), FLOAT32


def quantize_checked(
    build: Callable[[Precision], Engine], calibration: Sequence[PoolingRequest], probes: Sequence[PoolingRequest],
) -> tuple[Engine, Precision]:
    """Build the engine in int8 (:data:`INT8_ACTIVATIONS`: over bfloat16 activations where they
    hold the bar, else over float32's), calibrate it on ``calibration``, and keep in bfloat16 the
    fewest of its linear layers, most sensitive first, with which its outputs on ``probes`` stay
    within :data:`MAX_INT8_RELATIVE_ERROR` of float32's.

    The activations are chosen by the probe with every layer kept in bfloat16: the error that
    remains then is the activations' own, which no choice of int8 layers lowers.
    A layer's sensitivity is the error it alone in int8 causes in the model's outputs
    (:func:`_sensitivities`). How many of the most sensitive stay in bfloat16 is searched on the
    probe: none, then 1, 2, 4, ... until it passes, then bisected; a layer is kept whole
    (:meth:`~poolrunner.core.kernels.int8.Int8Linear.keep`). The load log names the layers kept.

    :returns: The engine and its precision (one of :data:`INT8_ACTIVATIONS`).
    :raises ModelLoadError: naming the probe error and the bar, when even every layer in
        bfloat16 over float32 activations misses it.
    """
    engine = build(FLOAT32)
    probes, calibration = _served(probes, engine), _served(calibration, engine)
    reference = _run(engine, probes)
    del engine
    engine, chosen, layers, all_kept = _int8_activations(build, calibration, probes, reference)
    tried = {len(layers): all_kept}
    errors = _sensitivities(engine, layers, calibration[:SENSITIVITY_TEXTS])
    order = sorted(errors, key=errors.__getitem__, reverse=True)

    def probe_with(kept: int) -> bool:
        """Whether the probe passes with the ``kept`` most sensitive layers in bfloat16."""
        for rank, name in enumerate(order):
            layers[name].keep(rank < kept)
        if kept not in tried:
            outputs = _run(engine, probes)
            tried[kept] = (_excess(reference, outputs, MAX_INT8_RELATIVE_ERROR), _relative_error(reference, outputs))
        return tried[kept][0] <= 1

    kept = _fewest_passing(probe_with, len(order))
    probe_with(len(order) if kept is None else kept)  # never None: all in bfloat16 passed
    _log_int8(chosen, order[:len(order) if kept is None else kept], errors, len(order), tried)
    return engine, chosen


def _int8_activations(
    build: Callable[[Precision], Engine], calibration: Sequence[PoolingRequest], probes: Sequence[PoolingRequest],
    reference: list[RequestOutput],
) -> tuple[Engine, Precision, dict[str, int8.Int8Linear], tuple[float, float]]:
    """The first of :data:`INT8_ACTIVATIONS` whose probe outputs hold the bar with every layer in
    bfloat16, built and calibrated (:func:`_calibrated`).

    :returns: The engine, its precision, its calibrated layers and that probe's ``(excess, error)``.
    :raises ModelLoadError: when none does.
    """
    for chosen in INT8_ACTIVATIONS:
        engine = build(chosen)
        layers = _calibrated(engine, calibration)
        outputs = _run(engine, probes)
        measured = (_excess(reference, outputs, MAX_INT8_RELATIVE_ERROR), _relative_error(reference, outputs))
        if measured[0] <= 1:
            return engine, chosen, layers, measured
        logger.info("dtype int8: not over %s activations (with every linear layer in bfloat16, %s)",
                    _dtype_name(chosen.weights), _miss(reference, outputs))
        count = len(layers)
        del engine, layers  # freed before the next is built
    _refuse_int8(_miss(reference, outputs), count)


def _calibrated(engine: Engine, calibration: Sequence[PoolingRequest]) -> dict[str, int8.Int8Linear]:
    """Calibrate ``engine``'s int8 layers on ``calibration`` (requests of tasks it serves).

    :returns: Its calibrated layers by name, every one kept in bfloat16.
    """
    backbone = engine.runner.backbone
    int8.calibrate(backbone, lambda: _run(engine, calibration))
    layers = {name: layer for name, layer in backbone.named_modules()
              if isinstance(layer, int8.Int8Linear) and layer.quantized}
    for layer in layers.values():
        layer.keep()
    return layers


def _sensitivities(engine: Engine, layers: dict[str, int8.Int8Linear],
                   texts: Sequence[PoolingRequest]) -> dict[str, float]:
    """Each layer's sensitivity: the mean squared relative error of the outputs on ``texts`` with
    that layer alone in int8, against every layer in bfloat16. One run per layer, which is why
    ``texts`` are few and short, and why the blocks before the layer's own replay the reference
    run's outputs (:mod:`~poolrunner.core.block_replay`: the same values, half the work); the
    errors of several layers roughly add up, as squares.

    :returns: Layer name -> sensitivity; every layer is left kept in bfloat16.
    """
    for layer in layers.values():
        layer.keep()
    backbone = engine.runner.backbone
    blocks = {name: block_of(backbone, name) for name in layers}
    replay = BlockReplay(backbone)
    with replay.recording({block[0] for block in blocks.values() if block is not None}):
        reference = _run(engine, texts)
    errors = {}
    for name, layer in layers.items():
        layer.keep(False)
        with replay.replaying(blocks[name]):
            outputs = _run(engine, texts)
        layer.keep()
        errors[name] = sum(_relative_error(ref, out) ** 2 for ref, out in zip(reference, outputs, strict=True))
        errors[name] /= max(1, len(texts))
    return errors


def _fewest_passing(passes: Callable[[int], bool], most: int) -> int | None:
    """The smallest ``k`` in ``[0, most]`` for which ``passes(k)``, assuming that more never hurts:
    doubling from 1, then bisecting; ``None`` when ``passes(most)`` fails."""
    if passes(0):
        return 0
    failed, k = 0, 1
    while k <= most and not passes(k):
        if k == most:
            return None
        failed, k = k, min(2 * k, most)
    if k > most:  # most == 0
        return None
    while k - failed > 1:
        middle = (failed + k) // 2
        failed, k = (failed, middle) if passes(middle) else (middle, k)
    return k


def _refuse_int8(miss: str, layers: int) -> NoReturn:
    """:param miss: :func:`_miss`'s words for what the probe found."""
    raise ModelLoadError(
        f"dtype 'int8' is refused for this model: on the probe texts, even with all {layers} linear layers in "
        f"bfloat16 over float32 activations, {miss}; use dtype 'auto' (it measures which precision holds the bar) "
        "or 'float32'"
    )


def _miss(reference: Sequence[RequestOutput], outputs: Sequence[RequestOutput]) -> str:
    """The output furthest past its bar (:func:`_excess`), in words: the error by the measure it is
    held to, and that bar."""
    ref, out = max(_leaves(reference, outputs), key=lambda pair: _excess(*pair, MAX_INT8_RELATIVE_ERROR))
    if _is_score(ref, out):
        return (f"a score is {abs(out.double().item() - ref.double().item()):.2g} away from float32's; the bar for "
                f"scores is {MAX_SCORE_ERROR:g} (absolute)")
    error = _relative_error(ref, out)
    if math.isinf(error):
        return "its outputs differ from float32's in shape or in integer values"
    return (f"its outputs are up to {error:.4f} away from float32's (relative error; for unit vectors cosine "
            f"{1 - error**2 / 2:.4f}); the bar is {MAX_INT8_RELATIVE_ERROR:.4f} "
            f"(cosine {1 - MAX_INT8_RELATIVE_ERROR**2 / 2:.4g})")


def _leaves(reference: RequestOutput | Sequence[RequestOutput],
            output: RequestOutput | Sequence[RequestOutput]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The tensor pairs of ``reference`` and ``output`` (one output, a dict of named ones, or a list)."""
    if isinstance(reference, list | tuple):
        for ref, out in zip(reference, output, strict=True):
            yield from _leaves(ref, out)
    elif isinstance(reference, dict):
        for name in reference:
            yield from _leaves(reference[name], output[name])  # type: ignore[index]
    else:
        yield reference, output  # type: ignore[misc]


def _is_score(reference: torch.Tensor, output: torch.Tensor) -> bool:
    """An output of one value (a score, a class probability of one label): held to
    :data:`MAX_SCORE_ERROR`, absolute."""
    return reference.is_floating_point() and reference.numel() == 1 and output.shape == reference.shape


def _log_int8(chosen: Precision, kept: Sequence[str], errors: dict[str, float], layers: int,
              tried: dict[int, tuple[float, float]]) -> None:
    activations = _dtype_name(chosen.weights)
    all_int8 = tried[0][1]
    if not kept:
        logger.info("dtype int8: all %d linear layers in int8 over %s activations, probe error %.4f <= %.4f "
                    "against float32", layers, activations, all_int8, MAX_INT8_RELATIVE_ERROR)
        return
    logger.info(
        "dtype int8: %d of %d linear layers stay in bfloat16 over %s activations, those whose int8 error alone "
        "moves the outputs most (%s: mean squared relative error on %d calibration texts); with them the probe "
        "error against float32 is %.4f <= %.4f, all in int8 it was %.4f (%d probe runs)",
        len(kept), layers, activations, ", ".join(f"{name} {errors[name]:.1e}" for name in kept), SENSITIVITY_TEXTS,
        tried[len(kept)][1], MAX_INT8_RELATIVE_ERROR, all_int8, len(tried),
    )


def _dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``: the name the ``dtype`` option uses."""
    return str(dtype).removeprefix("torch.")


def _served(requests: Sequence[PoolingRequest], engine: Engine) -> list[PoolingRequest]:
    """The requests of a task ``engine`` has a pooler for."""
    return [request for request in requests if request.params.task in engine.runner.poolers]


def _excess(reference: RequestOutput | Sequence[RequestOutput], output: RequestOutput | Sequence[RequestOutput],
            relative_bar: float) -> float:
    """The largest error of ``output`` (one output, a dict of named ones, or a list) against
    ``reference`` as a multiple of its bar (<= 1: every output holds it): an output of one value
    against :data:`MAX_SCORE_ERROR` (absolute), any other against ``relative_bar`` (relative)."""
    if not isinstance(reference, torch.Tensor):
        return max(_excess(ref, out, relative_bar) for ref, out in _leaves(reference, output))
    if _is_score(reference, output):  # type: ignore[arg-type]
        return abs(output.double().item() - reference.double().item()) / MAX_SCORE_ERROR  # type: ignore[union-attr]
    return _relative_error(reference, output) / relative_bar


def _run(engine: Engine, probes: Sequence[PoolingRequest]) -> list[RequestOutput]:
    outputs = dict(engine.run(probes))
    return [outputs[probe.request_id] for probe in probes]


def _relative_error(reference: RequestOutput | Sequence[RequestOutput],
                    output: RequestOutput | Sequence[RequestOutput]) -> float:
    """``||output - reference|| / ||reference||`` (the largest of a list or dict of outputs);
    infinite where the two cannot be compared element by element: shapes that differ (SPLADE
    keeps the non-zero weights, whose number bf16 may change) or integer outputs that differ
    (token ids)."""
    if isinstance(reference, list | tuple):
        return max(_relative_error(ref, out) for ref, out in zip(reference, output, strict=True))
    if isinstance(reference, dict):
        return max(_relative_error(reference[name], output[name]) for name in reference)  # type: ignore[index]
    if reference.shape != output.shape:  # type: ignore[union-attr]
        return math.inf
    if not reference.is_floating_point():  # type: ignore[union-attr]
        return 0.0 if torch.equal(reference, output) else math.inf  # type: ignore[arg-type]
    reference, output = reference.double(), output.double()  # type: ignore[union-attr]
    scale = torch.linalg.vector_norm(reference).item()
    return torch.linalg.vector_norm(output - reference).item() / max(scale, torch.finfo(torch.float32).tiny)
