"""Small helpers shared by test modules (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from poolrunner.core import hookimpl

MIN_COSINE = 0.9999
"""The fp32 parity bar against an independent reference (vLLM's strict bar)."""


def bf16_products() -> bool:
    """Whether this CPU's oneDNN multiplies bfloat16 (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): not on
    an AVX2-only CPU, where ``bf16-mixed`` is refused at load and bfloat16 layers are not packed."""
    import torch

    from poolrunner.core.kernels import onednn

    return onednn.supported(torch.device("cpu"), torch.bfloat16)


def pretend_amx(monkeypatch: Any, amx: bool) -> None:
    """Have torch report AMX tiles (``amx``) or none to poolrunner's choices for the rest of a test,
    once this CPU's own kernels are built: a process holds one build of them (a second registers
    the ``poolrunner_cpu`` operators again, which aborts), and AMX's tile code cannot run here
    without tiles."""
    import torch

    from poolrunner.core.kernels import cpu_kernels

    cpu_kernels.supported_dtypes()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)


def run_requests(runtime: Any, requests: Sequence[Any]) -> dict[str, Any]:
    """Run ``PoolingRequest``s as given through ``runtime``'s public serving loop
    (:meth:`poolrunner.Runtime.serving`): ``{request_id: output}``. They are admitted together, so
    they share steps as the budget allows; raises what ``Serving.run`` raises
    (``InvalidRequestError`` at admission, and then none of them ran)."""
    import asyncio

    with runtime.serving() as serving:
        outputs = asyncio.run(serving.run(list(requests)))
    return {request.request_id: output for request, output in zip(requests, outputs, strict=True)}


def assert_engine_empty(runtime: Any) -> None:
    """No request is held or queued in ``runtime``'s engine: what every finished, refused, aborted
    or failed request must leave behind. The one helper outside ``tests/engine/`` that reads the
    private engine: no hook sees a request the engine forgot to release."""
    engine = runtime._engine
    assert not engine.requests and not engine.scheduler.has_unfinished(), "a request left state behind"


class ModelSpy:
    """A test plugin that keeps what its runtime loaded, as the ``get_pooler`` hook sees it (a
    wrapper: it answers nothing itself). Register it with ``Runtime(..., plugins=[spy])``.

    :ivar model: The loaded model, head included, after oneDNN prepacking and RMSNorm fusing; its
        ``base_model`` is the backbone every step runs. A load that probes dtypes builds and
        drops other models first: the one served is built last.
    :ivar poolers: The pooler chosen for each task, by whichever plugin offered it.
    """

    def __init__(self) -> None:
        self.model: Any = None
        self.poolers: dict[str, Any] = {}

    @hookimpl(wrapper=True)
    def get_pooler(self, task: str, model: Any) -> Any:
        pooler = yield
        self.model = model
        if pooler is not None:
            self.poolers[task] = pooler
        return pooler


def cosine_rows(a: Any, b: Any) -> np.ndarray:
    """Row-wise cosine similarity of two ``[n, d]`` (or ``[d]``) arrays, in float64."""
    a = np.atleast_2d(np.asarray(a, dtype=np.float64))
    b = np.atleast_2d(np.asarray(b, dtype=np.float64))
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def normalized(x: np.ndarray) -> np.ndarray:
    """L2-normalize along the last axis."""
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def assert_captures_equal(model: Any, reference: Any, ids: Any) -> None:
    """``model`` (a transformers backbone whose layers poolrunner changed) gives ``reference``'s
    last hidden state, and, when transformers captures them, its hidden states and attentions."""
    import torch

    with torch.inference_mode():
        plain = model(ids)
        want = reference(ids, output_hidden_states=True, output_attentions=True)
        got = model(ids, output_hidden_states=True, output_attentions=True)
    for name in ("hidden_states", "attentions"):
        assert len(got[name]) == len(want[name])
        for a, b in zip(got[name], want[name], strict=True):
            torch.testing.assert_close(a, b)
    torch.testing.assert_close(plain.last_hidden_state, want.last_hidden_state)


@contextlib.contextmanager
def captured_logs(caplog: Any) -> Iterator[None]:
    """Records of poolrunner's and uvicorn's loggers into ``caplog``, even where an earlier test's
    ``log_config`` stopped them propagating to the root logger."""
    loggers = [logging.getLogger(name) for name in ("poolrunner", "uvicorn", "asyncio")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(caplog.handler)
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(caplog.handler)
            logger.setLevel(level)


def image_features(reference: Any, image: Any) -> np.ndarray:
    """A text-image family's normalized ``get_image_features`` of ``image`` (``reference``: the
    ``(model, tokenizer, image_processor)`` of transformers), ``[embedding_size]`` float32."""
    import torch

    model, _, processor = reference
    with torch.inference_mode():
        features = model.get_image_features(**processor(images=image, return_tensors="pt")).pooler_output
    return torch.nn.functional.normalize(features, dim=-1)[0].numpy()


PARITY_ATOL = 1e-4
"""The fp32 max-abs bar of the image families' parity tests (issue 28)."""


def assert_parity(got: Any, want: Any, label: str, *, atol: float | None = PARITY_ATOL) -> None:
    """Rows of ``got`` against the reference ``want`` (``[rows, dim]``, or one vector; ``got`` an
    array the Python API gave, float32, or numbers an answer decoded): the same shape, cosine >=
    :data:`MIN_COSINE` per row and max abs <= ``atol`` (``None``: the cosine alone); prints the
    deviation (``pytest -s``)."""
    assert not isinstance(got, np.ndarray) or got.dtype == np.float32, (label, got.dtype)
    got, want = np.atleast_2d(np.asarray(got, dtype=np.float32)), np.atleast_2d(np.asarray(want))
    assert got.shape == want.shape, (label, got.shape, want.shape)
    cosine = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    deviation = float(np.abs(got - want).max())
    print(f"deviation {label}: max abs {deviation:.2e}, min cosine {cosine.min():.8f}")
    assert cosine.min() >= MIN_COSINE and (atol is None or deviation <= atol), (label, cosine.min(), deviation)
