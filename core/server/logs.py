"""Logging of ``poolrunner serve``: uvicorn's loggers and poolrunner's own, at one level, in text
or JSON (one object per line, by python-json-logger).

Each answered request logs one line on ``poolrunner.access`` (see
:func:`~poolrunner.core.server.middleware.GuardMiddleware`): request id, method, route, status,
input and token counts and latency, never the request's text or the API key. It replaces
uvicorn's access log, which has none of those counts.

Warnings and errors that repeat are rate-limited (:class:`RepeatFilter`): a flood of one error
(a client hammering a closed port, no file descriptors left) logs a few lines a minute, not
megabytes of tracebacks.
"""

from __future__ import annotations

import contextlib
import logging
import logging.config
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The keys every JSON line has; a record's ``extra`` fields (the access line's counts) follow.
_JSON = "%(asctime)s %(levelname)s %(name)s %(message)s"


class RepeatFilter(logging.Filter):
    """Lets through the first ``limit`` warnings or errors of one kind (logger, level, message
    template, exception type) in each ``window`` seconds; the next one becomes a one-line summary
    (no traceback) saying the rest are dropped, and the first one of the next window says how
    many were. Info and debug records (the access lines) always pass.

    :param limit: Records of one kind let through per window, >= 1.
    :param window: Seconds.
    :param clock: Seconds, monotonic (tests pass their own).
    """

    MAX_KINDS = 1024
    """Kinds remembered; past it, those whose window ended are forgotten."""

    def __init__(self, limit: int = 10, window: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.limit = limit
        self.window = window
        self._clock = clock
        self._kinds: dict[tuple[Any, ...], tuple[float, int]] = {}  # kind -> (window start, records in it)
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        kind = (record.name, record.levelno, str(record.msg), record.exc_info[0] if record.exc_info else None)
        with self._lock:
            count, dropped = self._count(kind, self._clock())
        if count <= self.limit:
            if count == 1 and dropped:
                _rewrite(record, f"{record.getMessage()} ({dropped} more like it were dropped in the previous "
                                 f"{self.window:g} s)", keep_traceback=True)
            return True
        if count == self.limit + 1:
            _rewrite(record, f"{record.getMessage()} (logged {self.limit} times in {self.window:g} s: more like "
                             "it are dropped for the rest of that time)", keep_traceback=False)
            return True
        return False

    def _count(self, kind: tuple[Any, ...], now: float) -> tuple[int, int]:
        """This record's number in its kind's window, and how many records the window before dropped."""
        if len(self._kinds) >= self.MAX_KINDS:
            self._kinds = {key: value for key, value in self._kinds.items() if now - value[0] < self.window}
        start, count = self._kinds.get(kind, (now, 0))
        dropped = 0
        if now - start >= self.window:
            start, dropped, count = now, max(0, count - self.limit - 1), 0
        self._kinds[kind] = (start, count + 1)
        return count + 1, dropped


def _rewrite(record: logging.LogRecord, message: str, *, keep_traceback: bool) -> None:
    record.msg, record.args = message, None
    if not keep_traceback:
        record.exc_info, record.exc_text, record.stack_info = None, None, None


class StderrHandler(logging.StreamHandler):
    """Writes each record to the ``sys.stderr`` of that moment, not the one at configuration:
    a server started in-process (tests, notebooks) may outlive a swapped-out stream."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass  # StreamHandler.__init__ assigns it; the property always answers sys.stderr


def log_config(level: str, log_format: str) -> dict[str, Any]:
    """A :func:`logging.config.dictConfig` for uvicorn's ``log_config``: uvicorn's and
    poolrunner's loggers at ``level`` on stderr, ``text`` or ``json`` lines, repeated warnings and
    errors rate-limited (:class:`RepeatFilter`, asyncio's too: it reports failed accepts).

    :raises ValueError: for a level or format not in :data:`LOG_LEVELS` / :data:`LOG_FORMATS`.
    """
    if level not in LOG_LEVELS or log_format not in LOG_FORMATS:
        raise ValueError(f"log level must be one of {list(LOG_LEVELS)} and format one of {list(LOG_FORMATS)}, "
                         f"got {level!r} and {log_format!r}")
    formatter: dict[str, Any] = {"format": _TEXT}
    if log_format == "json":
        formatter = {"()": "pythonjsonlogger.json.JsonFormatter", "format": _JSON,
                     "rename_fields": {"asctime": "time", "levelname": "level", "name": "logger"}}
    logger = {"handlers": ["stderr"], "level": level.upper(), "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": formatter},
        "filters": {"repeats": {"()": RepeatFilter}},
        "handlers": {"stderr": {"()": StderrHandler, "formatter": "default", "filters": ["repeats"]}},
        "loggers": {
            "uvicorn": logger,
            "uvicorn.error": {"level": level.upper()},  # propagates to "uvicorn"
            "uvicorn.access": {"handlers": [], "level": "CRITICAL", "propagate": False},
            "poolrunner": logger,
            "asyncio": {**logger, "level": "WARNING"},
        },
    }


@contextlib.contextmanager
def configured(level: str, log_format: str) -> Iterator[None]:
    """Logging as :func:`log_config` says for the block, then the loggers it touched as they were:
    ``poolrunner serve`` run in-process (tests, notebooks) leaves no handlers behind."""
    config = log_config(level, log_format)
    loggers = [logging.getLogger(name) for name in config["loggers"]]
    saved = [(lg, lg.handlers[:], lg.filters[:], lg.level, lg.propagate, lg.disabled) for lg in loggers]
    logging.config.dictConfig(config)
    try:
        yield
    finally:
        for lg, handlers, filters, level_, propagate, disabled in saved:
            lg.handlers[:], lg.filters[:] = handlers, filters
            lg.setLevel(level_)
            lg.propagate, lg.disabled = propagate, disabled
