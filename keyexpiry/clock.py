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
        # (Redis ms, local monotonic s) of one reading, swapped whole: two attributes set one
        # after the other could be read torn by a thread asking the time in between.
        self._base: tuple[float, float] | None = None
        self._retry_mono_s = -1e18
        self._syncing = False
        self._closed = False
        self.syncs_failed = 0
        """Background resyncs that failed (Redis away, paused or stalled)."""

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
            if self._closed:
                # A reading now would connect the closed client again, for good.
                raise redis.ConnectionError("the clock's Redis client is closed")
            before = time.monotonic()
            seconds, micros = self._client.time()
            after = time.monotonic()
            reading = (after - before, seconds * 1000.0 + micros / 1000.0, (before + after) / 2)
            if best is None or reading[0] < best[0]:
                best = reading
            if best[0] <= SYNC_GOOD_RTT_S:
                break
        assert best is not None
        self._base = (best[1], best[2])

    def now_ms(self) -> int:
        """Epoch milliseconds on Redis's clock.

        Only the first call waits for Redis (there is no time to extrapolate from before it;
        it raises when Redis does not answer). Later resyncs run on a thread of their own while
        every caller goes on extrapolating: on a Cluster the clock is one node's, and a resync
        that met that node paused held each thread that asked the time for the socket
        timeout (the Cluster soak: a listener's claims and its unheard primary's ledger runs
        stopped for a whole 10 s pause of that node). A resync that fails is tried again a
        second later.
        """
        base = self._base
        if base is None:
            self.sync()
            base = self._base
            assert base is not None
        mono = time.monotonic()
        if mono - base[1] > self._resync_s and mono >= self._retry_mono_s:
            self._resync_in_background()
        return int(base[0] + (mono - base[1]) * 1000.0)

    def close(self) -> None:
        """Start no more readings: the runtime is closing the client, and a resync begun after
        that would connect it again, a connection nothing would close."""
        self._closed = True

    def _resync_in_background(self) -> None:
        with self._lock:
            if self._syncing or self._closed:
                return
            self._syncing = True
        try:
            threading.Thread(target=self._resync, name="keyexpiry-clock-sync", daemon=True).start()
        except RuntimeError:
            # No thread to be had (a thread limit, the interpreter shutting down): extrapolate
            # on, and try again later.
            self._retry_mono_s = time.monotonic() + _RESYNC_RETRY_S
            with self._lock:
                self._syncing = False

    def _resync(self) -> None:
        try:
            self.sync()
        except Exception:
            # Redis away, or its client closed under this thread (the runtime closing):
            # the time stays extrapolated, as it was.
            self.syncs_failed += 1
            self._retry_mono_s = time.monotonic() + _RESYNC_RETRY_S
        finally:
            with self._lock:
                self._syncing = False

    def extrapolated_ms(self) -> int:
        """`now_ms` without starting a resync (for the heartbeat)."""
        base = self._base
        if base is None:
            return self.now_ms()
        return int(base[0] + (time.monotonic() - base[1]) * 1000.0)

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
