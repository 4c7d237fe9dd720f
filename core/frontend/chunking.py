"""Long ``embed`` inputs in windows, as vLLM's chunked processing (``max_embed_len``) does.

With ``RuntimeConfig.max_embed_len`` set, an ``embed`` input (a text or token ids, not a pair)
longer than the model's ``max_model_len`` and at most ``max_embed_len`` tokens long is not an
error: :meth:`Frontend.prepare <poolrunner.core.frontend.plans.Frontend.prepare>` turns it into one
:class:`WindowedRequest`, and the runtime's two run paths (``Runtime._run`` and
``Serving.run``, which every surface uses) :func:`expand` it into engine requests and combine
their outputs. Nothing else changes: an input within ``max_model_len`` is the ordinary request
of today, and the engine never sees an input over ``max_model_len``.

The rules, and where they follow vLLM (``vllm/entrypoints/pooling/embed/io_processor.py``):

* **Windows.** The tokenized input, special tokens included, is cut into consecutive slices of
  ``max_model_len`` tokens (the last one shorter): vLLM's ``chunk_list(prompt_token_ids,
  max_model_len)``. No special tokens are added per window: the first window starts with the
  tokenizer's ``[CLS]`` (or BOS), the last ends with its ``[SEP]`` (or EOS), the ones between
  have neither. As vLLM, so every token of the input is in exactly one window and the usage
  (``num_tokens``, ``usage.prompt_tokens``) is the input's own token count; token-id inputs are
  split the same way without knowing which ids are special. A prompt prefix lands in the first
  window only.
* **Each window** runs as its own engine request with the input's options, through the model's
  own pooler: MEAN pooling, the Dense layers, and normalization when it is on (vLLM runs its
  chunks with the request's pooling parameters, so its chunk vectors are normalized too).
  Matryoshka ``dimensions`` is left out of the windows and applied after combining.
* **Combination**: the mean of the window vectors weighted by each window's token count, in
  float32 (vLLM's aggregation). Then poolrunner's usual tail: the Matryoshka slice
  ``[:dimensions]``, then L2 normalization when it is on. vLLM stops at the weighted mean, and
  slices each chunk before normalizing it. So with normalization off poolrunner's vector is
  vLLM's; with it on and no ``dimensions`` it is vLLM's scaled to norm 1 (same direction, same
  cosines; vLLM's norm is below 1); with both, the two differ slightly. poolrunner keeps its
  guarantees for every input: a normalized embedding has norm 1, and a sliced one equals
  ``normalize(full[:dimensions])``.
* **Only MEAN pooling** (refused at load otherwise, see :func:`check_config`): with
  normalization off, the token-weighted mean of window means is the mean over every token of
  the input, whereas a CLS or LAST vector belongs to one window only. vLLM accepts any pooling
  and averages anyway. Decoders usually pool LAST, so they are refused; a decoder loaded with
  ``pooling_type="MEAN"`` is windowed like an encoder (each window its own prompt, chunked
  prefill within a window).

It is an approximation of embedding the whole text: tokens attend only within their window, and
the model never saw positions past ``max_model_len``. sentence-transformers truncates instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch
import torch.nn.functional as F
from attrs import field, frozen

from poolrunner.core.errors import ModelLoadError, PromptTooLongError
from poolrunner.core.frontend.requests import Tokenization
from poolrunner.core.inputs.tokenize import InputProcessor
from poolrunner.core.matryoshka import check_dimensions
from poolrunner.core.plugin_api.output import RequestOutput
from poolrunner.core.types import ModelConfig, PoolingParams, PoolingRequest, PoolingTask, PromptInput
from poolrunner.core.validators import positive_int

TASK = "embed"


@frozen(kw_only=True)
class WindowedRequest(PoolingRequest):
    """An ``embed`` input longer than ``max_model_len``: run as :meth:`windows`, answered by
    :meth:`combine`. Never admitted to the engine itself (it would be too long).

    :ivar window: Tokens per window: the model's ``max_model_len``.
    :ivar normalize: L2-normalize the combined vector (the request's own setting, resolved).
    """

    window: int = field(validator=positive_int)
    normalize: bool

    def windows(self) -> list[PoolingRequest]:
        """One engine request per window, in order: the same options, ``dimensions`` aside."""
        params = attrs.evolve(self.params, dimensions=None)
        ids = self.prompt_token_ids
        return [PoolingRequest(request_id=f"{self.request_id}#window{k}",
                               prompt_token_ids=ids[start:start + self.window], params=params)
                for k, start in enumerate(range(0, len(ids), self.window))]

    def combine(self, outputs: Sequence[RequestOutput]) -> torch.Tensor:
        """The windows' vectors (in window order) averaged, weighted by their token counts, then
        sliced to ``dimensions`` and normalized (when on): ``[d]`` float32 on the CPU."""
        ids = self.prompt_token_ids
        counts = torch.tensor([len(ids[start:start + self.window]) for start in range(0, len(ids), self.window)],
                              dtype=torch.float32)
        if len(outputs) != len(counts):
            raise RuntimeError(f"request {self.request_id!r}: {len(outputs)} outputs for {len(counts)} windows")
        vectors = torch.stack([output.detach().to("cpu", torch.float32) for output in outputs])  # type: ignore[union-attr]
        vector = (vectors * counts.unsqueeze(1)).sum(0) / counts.sum()
        if self.params.dimensions is not None:
            vector = vector[: self.params.dimensions]
        return F.normalize(vector, p=2, dim=-1) if self.normalize else vector


def expand(requests: Sequence[PoolingRequest]) -> tuple[list[PoolingRequest], Callable[[list[RequestOutput]],
                                                                                         list[RequestOutput]]]:
    """The engine requests that answer ``requests`` (each :class:`WindowedRequest` replaced by
    its windows), and the function that turns their outputs (in that order) into one output per
    request of ``requests``. Without windowed requests: ``requests`` as they are and identity."""
    if not any(isinstance(request, WindowedRequest) for request in requests):
        return list(requests), _same
    engine_requests: list[PoolingRequest] = []
    spans: list[tuple[int, int]] = []
    for request in requests:
        parts = request.windows() if isinstance(request, WindowedRequest) else [request]
        spans.append((len(engine_requests), len(engine_requests) + len(parts)))
        engine_requests.extend(parts)

    def combine(outputs: list[RequestOutput]) -> list[RequestOutput]:
        return [request.combine(outputs[start:stop]) if isinstance(request, WindowedRequest) else outputs[start]
                for request, (start, stop) in zip(requests, spans, strict=True)]

    return engine_requests, combine


def _same(outputs: list[RequestOutput]) -> list[RequestOutput]:
    return outputs


def check_config(max_embed_len: int | None, model_config: ModelConfig, tasks: Sequence[PoolingTask]) -> None:
    """Refuse a ``max_embed_len`` this model cannot honour, before its weights load.

    :param tasks: The tasks the runtime is to serve.
    :raises ModelLoadError: when ``embed`` is not among ``tasks``, the model's ``embed`` pooling is
        not MEAN, or ``max_embed_len`` is not above ``max_model_len``.
    """
    if max_embed_len is None:
        return
    name, limit = model_config.name, model_config.max_model_len
    if TASK not in tasks:
        raise ModelLoadError(
            f"max_embed_len={max_embed_len} applies to the embed task only, and this runtime serves "
            f"{sorted(tasks)} for model {name}: leave max_embed_len unset"
        )
    if model_config.pooling_type != "MEAN":
        raise ModelLoadError(
            f"max_embed_len={max_embed_len} needs MEAN pooling, but model {name} pools {model_config.pooling_type} "
            "for embed: the windows of a long input are combined by a token-weighted mean, which suits MEAN pooling "
            "alone (a CLS or LAST vector lies in one window only); leave max_embed_len unset and truncate long "
            "inputs instead"
        )
    if max_embed_len <= limit:
        raise ModelLoadError(
            f"max_embed_len={max_embed_len} must be greater than max_model_len={limit} of model {name}: inputs up "
            "to max_model_len already run whole; raise it or leave it unset"
        )


class LongInputs:
    """Tokenizes ``embed`` inputs up to ``max_embed_len`` tokens and builds their requests.

    :param inputs: The runtime's input processor (its tokenizer, prompts, token-id checks and
        lock are shared).
    :param max_embed_len: The longest input accepted, in tokens (above ``max_model_len``).
    """

    def __init__(self, inputs: InputProcessor, max_embed_len: int) -> None:
        self.model_config = inputs.model_config
        self.window = inputs.model_config.max_model_len
        self.max_embed_len = max_embed_len
        self._inputs = inputs.without_length_limit()  # checked below against max_embed_len, own message

    def encode(self, items: Sequence[PromptInput], tokenization: Tokenization) -> list[tuple[int, ...]]:
        """Tokenize ``items`` (texts or token ids, never truncated) as the runtime's input
        processor does, up to ``max_embed_len`` tokens each (``tokenization`` as for
        :meth:`InputProcessor.encode`, without ``truncate_prompt_tokens``).

        :raises InvalidRequestError: as :meth:`InputProcessor.encode`, and
            :class:`PromptTooLongError` naming both limits for an input over ``max_embed_len``.
        """
        encoded = self._inputs.encode(items, **attrs.evolve(tokenization, truncate_prompt_tokens=None).encoding())
        for index, ids in enumerate(encoded):
            if len(ids) > self.max_embed_len:
                raise PromptTooLongError(
                    f"input {index} has {len(ids)} tokens, more than max_embed_len={self.max_embed_len} (inputs "
                    f"over max_model_len={self.window} of {self.model_config.name} are embedded in windows of "
                    f"{self.window} tokens, up to max_embed_len); shorten it or pass truncate_prompt_tokens "
                    "(-1 keeps the model maximum)"
                )
        return encoded

    def request(self, request_id: str, ids: tuple[int, ...], params: PoolingParams) -> PoolingRequest:
        """The request of one ``embed`` input: an ordinary one within ``max_model_len``, else a
        :class:`WindowedRequest` (``dimensions`` checked here, since its windows go without).

        :raises InvalidRequestError: for ``dimensions`` the model does not accept.
        """
        if len(ids) <= self.window:
            return PoolingRequest(request_id=request_id, prompt_token_ids=ids, params=params)
        check_dimensions(self.model_config, params.dimensions, self.model_config.embedding_size)
        return WindowedRequest(request_id=request_id, prompt_token_ids=ids, params=params, window=self.window,
                               normalize=self.normalize(params))

    def normalize(self, params: PoolingParams) -> bool:
        """Whether an ``embed`` output is normalized: the rule of the built-in embed pooler
        (``normalize``, else vLLM's ``use_activation``, else the model's default)."""
        for choice in (params.normalize, params.use_activation, self.model_config.normalize):
            if choice is not None:
                return choice
        return True
