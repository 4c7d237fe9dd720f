"""The three surfaces of every operation, as the by-operation tests drive them: the Python API
(a :class:`poolrunner.Runtime`), the command line in process (``poolrunner.core.cli.main.main``)
and HTTP (a real server, ``poolrunner.core.testing.server.ServerThread``).

Only public surfaces: runtime methods, command-line arguments, HTTP bodies. Every command runs in
float32, as the tests' runtimes do, so the three answer from the same weights in the same dtype.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from poolrunner.core.cli.main import main

RTOL, ATOL = 1e-5, 1e-6
"""float32 tolerance between surfaces: each may batch the inputs its own way."""

SPLADE = importlib.util.find_spec("poolrunner_splade") is not None
"""poolrunner-splade (a plugin task with a request option, ``top_k``) is installed."""
needs_splade = pytest.mark.skipif(not SPLADE, reason="poolrunner-splade is not installed (see README's test install)")


def cli(argv: Sequence[str], output: Path) -> Path:
    """Run ``poolrunner ARGV --dtype float32 -o OUTPUT`` in this process; it must exit 0.

    :returns: ``output``.
    """
    status = main([*argv, "--dtype", "float32", "-o", str(output)])
    assert status == 0, f"poolrunner {' '.join(argv)} exited {status} (its error is in the captured stderr)"
    return output


def cli_records(argv: Sequence[str], output: Path) -> list[dict[str, Any]]:
    """:func:`cli` writing JSON Lines (``output`` must end in ``.jsonl``): one dict per record."""
    return [json.loads(line) for line in cli(argv, output).read_text(encoding="utf-8").splitlines()]


def post(url: str, path: str, body: dict[str, Any]) -> Any:
    """POST ``body`` as JSON to ``url + path``; the answer must be a 200. Returns its JSON."""
    answer = httpx.post(url + path, json=body, timeout=60)
    assert answer.status_code == 200, f"{path}: {answer.status_code} {answer.text}"
    return answer.json()


def assert_close(actual: Any, expected: Any) -> None:
    """Equal to float32 tolerance (:data:`RTOL`, :data:`ATOL`), shapes included. ``ATOL`` is for
    values up to 1 in magnitude and grows with the largest expected one: float32's rounding is
    relative to the operands, so an unnormalized hidden state's small entries (sums of terms near
    3) differ by more than 1e-6 between two correct summation orders (the CPU's vector width)."""
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL * scale)


def assert_rows_close(actual: Sequence[Any], expected: Sequence[Any]) -> None:
    """:func:`assert_close` per input, for ragged results (one array per input)."""
    assert len(actual) == len(expected), (len(actual), len(expected))
    for got, want in zip(actual, expected, strict=True):
        assert_close(got, want)
