"""`async def` task methods the tests schedule; they note what they saw in this process."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Any

from keyexpiry import current, exposed, task

CALLS: Counter[str] = Counter()
"""How many times each key's handler was entered."""
cancelled: list[str] = []
"""Keys whose coroutine saw CancelledError."""
SEEN: dict[str, tuple[object, ...]] = {}
"""What `AsyncProbe.context` read of `current()`, by key."""
EVENTS: list[tuple[str, float]] = []
"""What `AsyncProbe.stubborn` did, when (monotonic s)."""
SPANS: list[tuple[float, float]] = []
"""(start, end) monotonic seconds of each `AsyncProbe.nap`."""
_lock = threading.Lock()
_active = 0
peak = 0
"""The most `AsyncProbe.nap` coroutines in flight at once."""


def reset() -> None:
    """Forget every note (between tests)."""
    global _active, peak
    with _lock:
        CALLS.clear()
        cancelled.clear()
        SEEN.clear()
        SPANS.clear()
        EVENTS.clear()
        _active = peak = 0


def _note() -> None:
    with _lock:
        CALLS[current().key] += 1


@task
class AsyncProbe:
    """Coroutine handlers with the behaviours the listener must handle."""

    @exposed
    async def record(self, name: str) -> str:
        _note()
        await asyncio.sleep(0)
        return name

    @exposed(retry_schedule_s=[0.05, 0.05])
    async def fail_once(self, name: str) -> None:
        _note()
        await asyncio.sleep(0.01)
        if current().attempt == 1:
            raise RuntimeError(f"first attempt of {name} fails")

    @exposed(timeout_s=0.3, retry_schedule_s=[0.05])
    async def hang_first(self, name: str) -> None:
        _note()
        if current().attempt == 1:
            key = current().key
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(key)
                raise

    @exposed(timeout_s=0.3, retry_schedule_s=[0.05])
    async def stubborn(self, name: str) -> None:
        """Its first attempt swallows the cancellation and runs on for another 0.7 s."""
        attempt = current().attempt
        EVENTS.append((f"start {attempt}", time.monotonic()))
        if attempt == 1:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                await asyncio.sleep(0.7)
            EVENTS.append(("end 1", time.monotonic()))

    @exposed(timeout_s=60)
    async def long(self, name: str) -> None:
        """Awaits for a minute unless cancelled: for the listener's stop."""
        _note()
        key = current().key
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(key)
            raise

    @exposed
    async def context(self, name: str) -> None:
        before = current()
        await asyncio.sleep(0.01)
        after = current()
        in_thread = await asyncio.to_thread(lambda: current().key)
        SEEN[before.key] = (before.key, after.key, in_thread, before.attempt, before.due_at_ms)

    @exposed(retry_schedule_s=[])
    def sync_returning_a_coroutine(self, name: str) -> Any:
        """A plain method that forgot `async`: its coroutine would never run."""
        return asyncio.sleep(0)

    @exposed(timeout_s=10)
    async def nap(self, i: int, ms: int) -> None:
        global _active, peak
        start = time.monotonic()
        with _lock:
            _active += 1
            peak = max(peak, _active)
        await asyncio.sleep(ms / 1000)
        with _lock:
            _active -= 1
            SPANS.append((start, time.monotonic()))
