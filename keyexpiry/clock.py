"""The one clock of keyexpiry: due times and "is it due yet" come from Redis's clock.

Application hosts may be skewed; Redis is the one server every creator and listener shares, and it
is the clock that actually expires the keys (`SET ... PXAT due_ms`). Reading `TIME` on every call
would cost a round trip, so `RedisClock` reads it once and advances it with the local monotonic
clock, re-reading it now and then to follow drift.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from typing import Protocol

import redis


def monotonic_s() -> float:
    """Local monotonic seconds: for durations and deadlines, never for due times."""
    return time.monotonic()


def iso_ms(ms: float) -> str:
    """Epoch milliseconds as ISO 8601 in UTC with its offset, to the millisecond
    (`2026-11-26T21:42:00.000+00:00`): how every log line shows a point in time. A value no date
    can hold (a row written by hand) shows as `<ms> ms (not a date)`: logging it never fails."""
    try:
        return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat(timespec="milliseconds")
    except (ValueError, OverflowError, OSError, TypeError):
        return f"{ms} ms (not a date)"


_RESYNC_RETRY_S = 1.0
SYNC_TRIES = 5
"""Readings of Redis `TIME` a sync takes at most, keeping the one with the shortest round trip."""
SYNC_GOOD_RTT_S = 0.002
"""A reading whose round trip took no longer is kept at once (off by 1 ms at most)."""


class Clock(Protocol):
    """Anything that tells the shared time in epoch milliseconds."""

    def now_ms(self) -> int:
        """Epoch milliseconds on the shared clock."""
        ...


class RedisClock:
    """Redis server time (epoch ms), extrapolated locally between syncs every `resync_s` seconds."""

    def __init__(self, client: redis.Redis, *, resync_s: float = 30.0) -> None:
        self._client = client
        self._resync_s = resync_s
        self._lock = threading.Lock()
        self._base_ms = 0.0
        self._base_mono_s = -1e18
        self._retry_mono_s = -1e18

    def sync(self) -> None:
        """Read Redis `TIME`, placing it at the midpoint of the round trip.

        Where in the round trip Redis read its clock is unknown, so the reading is off by up to
        half of it: a round trip stretched by a stall (the GIL held by another thread, the
        process stopped, a loaded machine) left a listener's clock off by 10 ms for 30 s, and
        the soak found runs whose start came 7 ms after their end. A slow reading is taken
        again, up to `SYNC_TRIES` times, and the one with the shortest round trip kept, as NTP
        does."""
        best: tuple[float, float, float] | None = None  # (round trip s, base ms, base mono s)
        for _ in range(SYNC_TRIES):
            before = time.monotonic()
            seconds, micros = self._client.time()
            after = time.monotonic()
            reading = (after - before, seconds * 1000.0 + micros / 1000.0, (before + after) / 2)
            if best is None or reading[0] < best[0]:
                best = reading
            if best[0] <= SYNC_GOOD_RTT_S:
                break
        assert best is not None
        with self._lock:
            self._base_ms, self._base_mono_s = best[1], best[2]

    def now_ms(self) -> int:
        """Epoch milliseconds on Redis's clock.

        Once synced, a resync that fails (Redis away) keeps extrapolating and tries again a
        second later: a worker asking the time must not fail because Redis is restarting.
        """
        mono = time.monotonic()
        if mono - self._base_mono_s > self._resync_s and mono >= self._retry_mono_s:
            try:
                self.sync()
            except (redis.RedisError, OSError):
                if self._base_mono_s < 0:
                    raise  # never synced: there is no time to extrapolate from
                self._retry_mono_s = mono + _RESYNC_RETRY_S
            mono = time.monotonic()
        return int(self._base_ms + (mono - self._base_mono_s) * 1000.0)

    def extrapolated_ms(self) -> int:
        """`now_ms` without the periodic resync: never waits on Redis once synced (for the
        heartbeat, which must not stall behind an unreachable Redis)."""
        if self._base_mono_s < 0:
            return self.now_ms()
        return int(self._base_ms + (time.monotonic() - self._base_mono_s) * 1000.0)

    def offset_ms(self) -> float:
        """How far Redis's clock is ahead of this host's wall clock (negative: behind)."""
        self.sync()
        return self.now_ms() - time.time() * 1000.0


class ManualClock:
    """A clock tests move by hand, so no test sleeps to make time pass."""

    def __init__(self, now_ms: int = 1_700_000_000_000) -> None:
        self._now_ms = now_ms

    def now_ms(self) -> int:
        """The time last set or advanced to."""
        return self._now_ms

    def advance(self, delta_ms: int) -> None:
        """Move the clock forward by `delta_ms`."""
        self._now_ms += delta_ms
