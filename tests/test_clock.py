"""The shared clock: Redis's `TIME`, extrapolated locally (pure logic: a stand-in client)."""

from __future__ import annotations

import time
from typing import Any

from keyexpiry.clock import SYNC_TRIES, RedisClock


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
