"""One resolution of a task's retry schedule and handler timeout: the row, then the method, then
the settings. An empty schedule is a real answer (no retries), never "use the default"."""

from __future__ import annotations

from keyexpiry.registry import ExposeOptions
from keyexpiry.settings import Settings


def schedule_s(
    row_schedule: tuple[float, ...] | None, options: ExposeOptions | None, settings: Settings
) -> tuple[float, ...]:
    """Delays before each retry: the task's own, else its method's, else the settings'."""
    if row_schedule is not None:
        return row_schedule
    if options is not None and options.retry_schedule_s is not None:
        return options.retry_schedule_s
    return settings.retry_schedule_s


def max_attempts(
    row_schedule: tuple[float, ...] | None, options: ExposeOptions | None, settings: Settings
) -> int:
    """The first run plus one per retry."""
    return 1 + len(schedule_s(row_schedule, options, settings))


def timeout_s(options: ExposeOptions, settings: Settings) -> float:
    """How long one run may take before it counts as failed."""
    return options.timeout_s if options.timeout_s is not None else settings.handler_timeout_s
