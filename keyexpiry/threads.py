"""Threads that never die silently: a loop that raises is logged, counted and started again.

A listener whose recorder or watchdog died would stay up, log "done", and stop recording outcomes:
half alive is worse than dead. Every long-lived thread of a listener runs through `spawn`.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections import deque
from collections.abc import Callable
from functools import cache
from typing import Any

from loguru import logger

from keyexpiry.clock import monotonic_s

_RESTART_PAUSE_S = 0.1
"""Pause before a loop that raised starts again, so a failure that repeats cannot spin a core."""
REPEATS = 3
"""Unexpected exceptions of one thread within `REPEAT_WINDOW_S` that make it a failing thread
(not ready): one is a bug met once; the same loop raising again and again is a listener that
no longer does that part of its job, however alive its threads are."""
REPEAT_WINDOW_S = 60.0


_PR_SET_NAME = 15  # linux/prctl.h
_NATIVE_NAME_BYTES = 15
"""Linux keeps 15 bytes of a thread's name (and a NUL)."""


@cache
def _prctl() -> Any | None:
    """libc's `prctl`, on Linux only (None elsewhere: names stay Python's own)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        return None


def name_native(name: str) -> None:
    """Give the calling thread `name` where the operating system shows it too (`top -H`,
    `ps -L`, /proc/<pid>/task/<tid>/comm), cut to 15 bytes: a listener's CPU can then be read
    thread by thread from outside (which of claimer, recorder, driver, workers uses it)."""
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_NAME, name.encode()[:_NATIVE_NAME_BYTES], 0, 0, 0)


class ThreadErrors:
    """How many unexpected exceptions the listener's threads survived (for status and tests),
    and which threads keep raising (for readiness)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.by_thread: dict[str, int] = {}
        self._recent: dict[str, deque[float]] = {}

    def add(self, name: str) -> None:
        """Count one unexpected exception in thread `name`."""
        with self._lock:
            self.count += 1
            self.by_thread[name] = self.by_thread.get(name, 0) + 1
            self._recent.setdefault(name, deque(maxlen=REPEATS)).append(monotonic_s())

    def repeating(self, now_s: float | None = None) -> list[str]:
        """Threads whose last `REPEATS` unexpected exceptions all fell within the last
        `REPEAT_WINDOW_S`: a loop failing over and over, not a bug met once."""
        now_s = monotonic_s() if now_s is None else now_s
        with self._lock:
            return sorted(
                name
                for name, times in self._recent.items()
                if len(times) == REPEATS and now_s - times[0] <= REPEAT_WINDOW_S
            )


def spawn(
    name: str, loop: Callable[[], object], *, stopped: threading.Event, errors: ThreadErrors
) -> threading.Thread:
    """Start daemon thread `keyexpiry-{name}` (`ke-{name}` to the operating system) running
    `loop` until it returns; when it raises, log the exception, count it and run `loop` again
    (unless `stopped` is set)."""

    def supervised() -> None:
        name_native(f"ke-{name}")
        while True:
            try:
                loop()
                return
            except Exception:
                errors.add(name)
                logger.opt(exception=True).error(
                    "unexpected error in the {} thread; it carries on", name
                )
            if stopped.wait(_RESTART_PAUSE_S):
                return

    thread = threading.Thread(target=supervised, name=f"keyexpiry-{name}", daemon=True)
    thread.start()
    return thread


class Backoff:
    """Capped exponential waits between retries of a failing step: `next_s()` gives the wait
    and doubles it, `reset()` after a success."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self._initial_s = initial_s
        self._max_s = max_s
        self._next_s = initial_s

    def next_s(self) -> float:
        """The wait before the next try (doubled for the one after, up to the cap)."""
        wait_s = self._next_s
        self._next_s = min(wait_s * 2, self._max_s)
        return wait_s

    def reset(self) -> None:
        """The step worked: the next failure waits the initial time again."""
        self._next_s = self._initial_s
