"""The shared clock: Redis's `TIME`, extrapolated locally (a stand-in client for the readings,
a real paused redis-server for a resync that cannot finish)."""

from __future__ import annotations

import time
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from keyexpiry.bench.servers import wait_until
from keyexpiry.clock import SYNC_TRIES, RedisClock, monotonic_s
from tests.conftest import RedisFactory


class _StallingTime:
    """Answers TIME with this host's clock (the same as a local redis-server's), stalling
    `stall_s` between the request and the reading on the first `stalls` calls: the round trip
    of a thread that lost the GIL, or a process stopped, while it asked."""

    def __init__(self, stall_s: float, stalls: int) -> None:
        self.stall_s, self.stalls, self.calls = stall_s, stalls, 0

    def time(self) -> tuple[int, int]:
        self.calls += 1
        if self.calls <= self.stalls:
            time.sleep(self.stall_s)  # the reading comes late, its request went out early
        now_us = time.time_ns() // 1000
        return now_us // 1_000_000, now_us % 1_000_000


def _offset_ms(clock: RedisClock) -> float:
    return clock.now_ms() - time.time() * 1000


def test_a_reading_stretched_by_a_stall_is_taken_again() -> None:
    fake: Any = _StallingTime(stall_s=0.06, stalls=1)
    clock = RedisClock(fake)
    clock.sync()
    assert fake.calls == 2
    # Placed at the midpoint of a 60 ms round trip it would be 30 ms ahead.
    assert abs(_offset_ms(clock)) < 10


def test_a_sync_gives_up_after_its_tries_and_keeps_the_quickest_reading() -> None:
    fake: Any = _StallingTime(stall_s=0.02, stalls=100)
    clock = RedisClock(fake)
    clock.sync()
    assert fake.calls == SYNC_TRIES


def test_a_resync_meeting_a_paused_redis_holds_no_caller(redis_factory: RedisFactory) -> None:
    server = redis_factory()
    # No retries: the resync gives up after one socket timeout.
    client = redis.Redis.from_url(server.url(), socket_timeout=1, retry=Retry(NoBackoff(), 0))
    clock = RedisClock(client, resync_s=0.0)  # every call is due for a resync
    try:
        clock.now_ms()  # the first reading waits for Redis: nothing to extrapolate from yet
        server.pause()
        # A resync meets the paused server and waits out the socket timeout: on a thread of its
        # own, while every caller extrapolates.
        began_s = monotonic_s()
        for _ in range(3):
            clock.now_ms()
        blocked_s = monotonic_s() - began_s
        assert blocked_s < 0.5, f"asking the time waited {blocked_s:.1f} s for a paused Redis"
        # (asking on: a resync begun before the pause took effect may have finished)
        wait_until(
            lambda: clock.now_ms() > 0 and clock.syncs_failed >= 1,
            5,
            message="the resync never gave up",
        )
        server.resume()
        failed = clock.syncs_failed

        def fresh() -> bool:
            clock.now_ms()
            base = clock._base
            return base is not None and monotonic_s() - base[1] < 0.5

        # Redis back: the next resync succeeds, and the time read is Redis's again.
        wait_until(fresh, 10, message="no resync after Redis came back")
        assert clock.syncs_failed == failed
        assert abs(_offset_ms(clock)) < 50
    finally:
        server.resume()
        client.close()
