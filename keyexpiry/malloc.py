"""What a long-running listener asks of the C allocator (glibc's malloc) so its memory levels off.

A listener runs some thirty threads. glibc gives threads that allocate at the same time arenas
of their own, up to eight per core, and an arena keeps what was freed in it for reuse by that
arena alone: each burst a fault brings (a peer's share taken over, a backlog claimed after a
stall, a reconnect's reconciliation) leaves its high-water mark in whichever arenas served it.
The soaks saw it as RSS climbing 78 -> 92 MB over a listener's first ten minutes of faults (the
Cluster and Patroni hours, 2026-11-28), in allocations Python's own allocator does not hold (its
objects are the small ones; buffers of drivers and large lists and strings are glibc's), and
smaller with `MALLOC_ARENA_MAX=2`. Sidekiq gives Ruby processes the same advice.

Two calls, both glibc's and both no-ops elsewhere: at start, at most `ARENAS` arenas (unless
`MALLOC_ARENA_MAX` is set: the operator's choice stands); and every `TRIM_EVERY_S`,
`malloc_trim(0)`, which hands the free pages of every arena back to the kernel. With two
arenas, threads that allocate at once (drivers' C code allocates with the GIL released) wait
on each other's lock a little more: no change showed in the throughput benchmark
(docs/PERFORMANCE.md).
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from typing import Any

from loguru import logger

ARENAS = 2
"""Arenas a listener's threads share (glibc's `M_ARENA_MAX`)."""
TRIM_EVERY_S = 60.0
"""How often a listener returns freed memory to the kernel."""
_M_ARENA_MAX = -8  # malloc.h


@cache
def _libc() -> Any | None:
    """glibc, or None on another C library (musl, macOS), where these calls do not exist."""
    if not hasattr(os, "confstr"):
        return None
    try:
        if not str(os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return None
        libc = ctypes.CDLL("libc.so.6")
    except (OSError, ValueError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


def _operator_chose() -> bool:
    """Whether the environment sets the number of arenas (glibc read it at start)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return bool(os.environ.get("MALLOC_ARENA_MAX")) or "glibc.malloc.arena_max" in tunables


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's arenas at `arenas` for threads that allocate from now on. Call it before
    threads start: glibc fixes its limit once a ninth arena exists, and a later call, though
    it says yes, changes nothing. Returns whether the cap was set: not on another C library,
    and not when the environment sets it (`MALLOC_ARENA_MAX`, or `glibc.malloc.arena_max` in
    `GLIBC_TUNABLES`)."""
    libc = _libc()
    if libc is None or _operator_chose():
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, arenas))


def trim() -> bool:
    """Hand the free pages of every arena back to the kernel (`malloc_trim(0)`, a few ms at a
    listener's size, each arena locked in turn); returns whether any memory was released
    (False on another C library)."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


class Trimmer:
    """Calls `trim` once per `every_s` from a periodic `tick` (the listener's self-check)."""

    def __init__(self, every_s: float = TRIM_EVERY_S) -> None:
        self.every_s = every_s
        self._last_s: float | None = None
        self.trims = 0
        """Trims that released memory."""

    def tick(self, now_s: float) -> None:
        """Trim if `every_s` passed since the last one (the first tick only starts the count)."""
        if self._last_s is None:
            self._last_s = now_s
            return
        if now_s - self._last_s < self.every_s:
            return
        self._last_s = now_s
        try:
            released = trim()
        except (OSError, AttributeError) as exc:  # pragma: no cover - a libc without it
            logger.debug("malloc_trim failed: {}", exc)
            return
        self.trims += int(released)
