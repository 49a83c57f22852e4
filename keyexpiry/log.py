"""Loguru set up once, at the entry point; library modules only call `logger`."""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Hashable
from typing import Any

from loguru import logger

from keyexpiry.errors import ConfigError
from keyexpiry.printable import printable, printable_lines


def _format(record: Any) -> str:
    """The text log's line: the message, key and traceback with their control characters
    escaped (`keyexpiry.printable`), since they carry text from outside (a handler's error,
    a tag, a forged key): an ESC or BEL would reach the reader's terminal, a newline would
    let that text pass for a log line of its own. The message is one line; a traceback's
    lines are all indented, so only a real log line starts at the left edge.

    The escaped texts go into the record's `extra` (fresh for each record), as loguru's own
    documentation does for a computed field: loguru parses colour tags in the format itself,
    so text from outside is only ever substituted into it."""
    extra = record["extra"]
    task = ""
    if "key" in extra:
        extra["printable_key"] = printable(str(extra["key"]))
        task = " [{extra[printable_key]} #{extra[attempt]}]"
    extra["printable_message"] = printable(record["message"])
    tail = ""
    if record["exception"] is not None:
        kind, value, tb = record["exception"]
        text = "".join(traceback.format_exception(kind, value, tb)).rstrip("\n")
        extra["printable_exception"] = "  " + printable_lines(text, "  ") + "\n"
        tail = "{extra[printable_exception]}"
    return (
        # ISO 8601 with the offset: lines from hosts (or Django settings) in other zones line up.
        "<green>{time:YYYY-MM-DDTHH:mm:ss.SSSZ}</green> <level>{level: <7}</level>"
        + task
        + " {extra[printable_message]}\n"
        + tail
    )


LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "SUCCESS", "WARNING", "ERROR", "CRITICAL")
"""loguru's levels, any case: what `configure_logging` and `Settings.log_level` take."""


def check_log_level(level: object) -> str:
    """`level` when it is one of `LOG_LEVELS` (any case); else a ConfigError naming them."""
    if not isinstance(level, str) or level.upper() not in LOG_LEVELS:
        raise ConfigError(f"log level {level!r}: use one of {', '.join(LOG_LEVELS)}")
    return level


def configure_logging(
    level: str = "INFO", *, colorize: bool | None = None, log_format: str = "text"
) -> None:
    """Send keyexpiry's log to stderr at `level`; every task line shows its key and attempt.

    `log_format="json"`: one JSON object per line (loguru's serialisation) for log shippers; a
    task's key, attempt, the listener id and lateness are in `record.extra`.
    """
    if log_format not in LOG_FORMATS:
        raise ConfigError(f"log format {log_format!r}: use one of {', '.join(LOG_FORMATS)}")
    check_log_level(level)
    logger.remove()
    json = log_format == "json"
    logger.add(
        _write_stderr,
        level=level.upper(),
        format="{message}" if json else _format,
        serialize=json,
        colorize=False if json else sys.stderr.isatty() if colorize is None else colorize,
        backtrace=False,
        diagnose=False,  # diagnose would print local variables: passwords
    )


def _write_stderr(message: str) -> None:
    # Looked up at each write: whoever swapped sys.stderr (a test runner, a daemon wrapper) may
    # have closed the stream that was current at configuration time.
    sys.stderr.write(message)


class SaidOnce:
    """What was already said, to say a recurring thing once (a row re-armed every lease check,
    a refused key expiring again): remembers up to `limit` items, forgetting the oldest first,
    so that a flood of distinct ones costs bounded memory (and, past it, a line again)."""

    def __init__(self, limit: int = 10_000) -> None:
        self._seen: dict[Hashable, None] = {}
        self._limit = limit
        self._lock = threading.Lock()  # two threads repair overdue rows on a Cluster

    def first(self, item: Hashable) -> bool:
        """True the first time `item` is seen (then remembered), False after."""
        with self._lock:
            if item in self._seen:
                return False
            self._seen[item] = None
            if len(self._seen) > self._limit:
                del self._seen[next(iter(self._seen))]
            return True


class Tally:
    """A thing that may recur without end (a forged event, a dropped wake), said at most once
    per `every_s`: the first time as it happens, then counted and summed up in one line once
    `every_s` has passed. A flood costs a line a minute and a counter, never a line an event
    (one a key wrote 150 MB of log in 20 s and held the GIL the listener's reader needed)."""

    def __init__(self, every_s: float = 60.0) -> None:
        self.total = 0
        """Everything counted since start (for metrics)."""
        self._every_s = every_s
        self._unsaid = 0
        self._said_s: float | None = None

    def add(self, n: int, now_s: float) -> bool:
        """Count `n` more; True when the caller should say them now (nothing was said for
        `every_s`), False when they wait for `unsaid`'s summary."""
        self.total += n
        if self._said_s is None or now_s - self._said_s >= self._every_s:
            self._said_s = now_s
            return True
        self._unsaid += n
        return False

    def unsaid(self, now_s: float) -> int:
        """How many were counted and not said, once `every_s` has passed since the last line
        (then the caller says them, and the count starts again); 0 until then."""
        if not self._unsaid or self._said_s is None or now_s - self._said_s < self._every_s:
            return 0
        n, self._unsaid, self._said_s = self._unsaid, 0, now_s
        return n
