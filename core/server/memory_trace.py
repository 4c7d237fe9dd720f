"""A debugging aid for finding memory growth in a running server (issue 31's soak): off unless
``POOLRUNNER_TRACEMALLOC_DIR`` names a folder.

Then :func:`start_from_environment` starts a daemon thread that, at once and every
``POOLRUNNER_TRACEMALLOC_EVERY`` seconds (default 300), appends glibc's heap figures
(``mallinfo2``: bytes in use, free inside the heap, in mmapped blocks) to ``mallinfo.csv``, which
tells a leak (in use grows) from memory glibc keeps (free grows), Python's or native; and, unless
``POOLRUNNER_TRACEMALLOC_FRAMES`` is 0 (default 8 frames per traceback), traces Python's
allocations with :mod:`tracemalloc` and writes a snapshot, ``snapshot-NNNN.tracemalloc``
(:meth:`tracemalloc.Snapshot.dump`), each time. :func:`growth` compares two snapshots.
Tracing slows every allocation and costs memory of its own: never on in production.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import tracemalloc
from pathlib import Path

logger = logging.getLogger(__name__)

DIR_ENV = "POOLRUNNER_TRACEMALLOC_DIR"
EVERY_ENV = "POOLRUNNER_TRACEMALLOC_EVERY"
FRAMES_ENV = "POOLRUNNER_TRACEMALLOC_FRAMES"


class _Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (``malloc.h``, glibc 2.33+): ten ``size_t`` fields."""

    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def start_from_environment() -> threading.Thread | None:
    """Start the snapshot thread (and tracing) when ``POOLRUNNER_TRACEMALLOC_DIR`` is set; else nothing.

    :returns: The snapshot thread, or ``None`` when off.
    :raises ValueError: for an every value that is not positive or a negative frames value.
    """
    folder = os.environ.get(DIR_ENV)
    if not folder:
        return None
    every, frames = float(os.environ.get(EVERY_ENV, "300")), int(os.environ.get(FRAMES_ENV, "8"))
    if every <= 0 or frames < 0:
        raise ValueError(f"{EVERY_ENV} must be positive and {FRAMES_ENV} at least 0, got {every} and {frames}")
    Path(folder).mkdir(parents=True, exist_ok=True)
    if frames:
        tracemalloc.start(frames)
    logger.warning("memory tracing is on (%s): every %g s into %s; this slows the server", DIR_ENV, every, folder)
    thread = threading.Thread(target=_snapshots, args=(Path(folder), every, bool(frames)),
                              name="poolrunner-tracemalloc", daemon=True)
    thread.start()
    return thread


def _snapshots(folder: Path, every: float, traced: bool) -> None:
    began, count = time.monotonic(), 0
    with (folder / "mallinfo.csv").open("w") as table:
        table.write("elapsed_s,heap_in_use_mib,heap_free_mib,mmapped_mib\n")
        while True:
            info = _mallinfo()
            if info is not None:
                table.write(f"{time.monotonic() - began:.0f},{info.uordblks / 2**20:.1f},"
                            f"{info.fordblks / 2**20:.1f},{info.hblkhd / 2**20:.1f}\n")
                table.flush()
            if traced:
                tracemalloc.take_snapshot().dump(str(folder / f"snapshot-{count:04d}.tracemalloc"))
            count += 1
            threading.Event().wait(every)


def _mallinfo() -> _Mallinfo2 | None:
    """glibc's ``mallinfo2()`` over all arenas, or ``None`` without it."""
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _Mallinfo2
    return function()


def growth(before: str | Path, after: str | Path, top: int = 15, key: str = "traceback") -> list[str]:
    """The ``top`` allocation sites that grew most from snapshot ``before`` to ``after``, one line
    each (size difference, count difference, then the traceback, innermost frame last)."""
    old, new = (tracemalloc.Snapshot.load(str(path)) for path in (before, after))
    lines = []
    for stat in new.compare_to(old, key)[:top]:
        frames = " <- ".join(f"{frame.filename}:{frame.lineno}" for frame in reversed(stat.traceback))
        lines.append(f"{stat.size_diff / 2**20:+8.2f} MiB {stat.count_diff:+8d} blocks  {frames}")
    return lines
