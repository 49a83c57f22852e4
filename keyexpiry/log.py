"""Loguru set up once, at the entry point; library modules only call `logger`."""

from __future__ import annotations

import sys
from typing import Any

from loguru import logger

from keyexpiry.errors import ConfigError


def _format(record: Any) -> str:
    extra = record["extra"]
    task = ""
    if "key" in extra:
        task = " [{extra[key]} #{extra[attempt]}]"
    return (
        "<green>{time:YYYY-MM-DD HH:mm:ss.SSS}</green> <level>{level: <7}</level>"
        + task
        + " {message}\n{exception}"
    )


LOG_FORMATS = ("text", "json")


def configure_logging(
    level: str = "INFO", *, colorize: bool | None = None, log_format: str = "text"
) -> None:
    """Send keyexpiry's log to stderr at `level`; every task line shows its key and attempt.

    `log_format="json"`: one JSON object per line (loguru's serialisation) for log shippers; a
    task's key, attempt, the listener id and lateness are in `record.extra`.
    """
    if log_format not in LOG_FORMATS:
        raise ConfigError(f"log format {log_format!r}: use one of {', '.join(LOG_FORMATS)}")
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
