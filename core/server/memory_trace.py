"""A debugging aid for finding memory growth in a running server (issue 31's soak): off unless
``POOLRUNNER_TRACEMALLOC_DIR`` names a folder.

Then :func:`start_from_environment` starts :mod:`tracemalloc` (frames per traceback from
``POOLRUNNER_TRACEMALLOC_FRAMES``, default 8) and a daemon thread writes a snapshot,
``snapshot-NNNN.tracemalloc`` (:meth:`tracemalloc.Snapshot.dump`), at once and every
``POOLRUNNER_TRACEMALLOC_EVERY`` seconds (default 300). :func:`growth` compares two of them.
Tracing slows every allocation and costs memory of its own: never on in production.
"""

from __future__ import annotations

import logging
import os
import threading
import tracemalloc
from pathlib import Path

logger = logging.getLogger(__name__)

DIR_ENV = "POOLRUNNER_TRACEMALLOC_DIR"
EVERY_ENV = "POOLRUNNER_TRACEMALLOC_EVERY"
FRAMES_ENV = "POOLRUNNER_TRACEMALLOC_FRAMES"


def start_from_environment() -> threading.Thread | None:
    """Start tracing and the snapshot thread when ``POOLRUNNER_TRACEMALLOC_DIR`` is set; else nothing.

    :returns: The snapshot thread, or ``None`` when tracing is off.
    :raises ValueError: for an every or frames value that is not a positive number.
    """
    folder = os.environ.get(DIR_ENV)
    if not folder:
        return None
    every, frames = float(os.environ.get(EVERY_ENV, "300")), int(os.environ.get(FRAMES_ENV, "8"))
    if every <= 0 or frames < 1:
        raise ValueError(f"{EVERY_ENV} and {FRAMES_ENV} must be positive, got {every} and {frames}")
    Path(folder).mkdir(parents=True, exist_ok=True)
    tracemalloc.start(frames)
    logger.warning("tracemalloc is on (%s): a snapshot every %g s into %s; this slows the server", DIR_ENV, every,
                   folder)
    thread = threading.Thread(target=_snapshots, args=(Path(folder), every), name="poolrunner-tracemalloc",
                              daemon=True)
    thread.start()
    return thread


def _snapshots(folder: Path, every: float) -> None:
    count = 0
    while True:
        tracemalloc.take_snapshot().dump(str(folder / f"snapshot-{count:04d}.tracemalloc"))
        count += 1
        threading.Event().wait(every)


def growth(before: str | Path, after: str | Path, top: int = 15, key: str = "traceback") -> list[str]:
    """The ``top`` allocation sites that grew most from snapshot ``before`` to ``after``, one line
    each (size difference, count difference, then the traceback, innermost frame last)."""
    old, new = (tracemalloc.Snapshot.load(str(path)) for path in (before, after))
    lines = []
    for stat in new.compare_to(old, key)[:top]:
        frames = " <- ".join(f"{frame.filename}:{frame.lineno}" for frame in reversed(stat.traceback))
        lines.append(f"{stat.size_diff / 2**20:+8.2f} MiB {stat.count_diff:+8d} blocks  {frames}")
    return lines
