"""Task classes with flow rules; each run samples itself in a Redis of the test's own (named by
`SAMPLE_REDIS_ENV`), so runs in any listener process are counted together: how many run at
once (the highest count seen by a handler as it starts), and each run's start and end."""

from __future__ import annotations

import os
import time

import redis

from keyexpiry import current, exposed, task

SAMPLE_REDIS_ENV = "KEYEXPIRY_TEST_SAMPLE_REDIS"
HOLD_MS_ENV = "KEYEXPIRY_TEST_HOLD_MS"
"""How long each sampled run lasts (default 50 ms)."""

# One hash tag: the script's keys share a slot on any Redis.
_ENTER = """
local n = redis.call('INCR', KEYS[1])
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end
return n
"""
_clients: dict[str, redis.Redis] = {}


def sample_redis() -> redis.Redis:
    """The sampling Redis of this process."""
    url = os.environ[SAMPLE_REDIS_ENV]
    client = _clients.get(url)
    if client is None:
        client = _clients[url] = redis.Redis.from_url(url)
    return client


def now_key(name: str) -> str:
    return f"{{flowtest}}:{name}:now"


def max_key(name: str) -> str:
    """The most runs of `name` seen at once."""
    return f"{{flowtest}}:{name}:max"


def runs_key(name: str) -> str:
    """`key start_ms end_ms` of each run of `name`, in the order they ended."""
    return f"{{flowtest}}:{name}:runs"


def _sampled(*names: str) -> None:
    r = sample_redis()
    for name in names:
        r.eval(_ENTER, 2, now_key(name), max_key(name))
    started_ms = time.time() * 1000
    try:
        time.sleep(int(os.environ.get(HOLD_MS_ENV, "50")) / 1000)
    finally:
        ended_ms = time.time() * 1000
        pipe = r.pipeline(transaction=False)
        for name in names:
            pipe.decr(now_key(name))
            pipe.rpush(runs_key(name), f"{current().key} {started_ms:.3f} {ended_ms:.3f}")
        pipe.execute()


def reset() -> None:
    """Forget every sample."""
    r = sample_redis()
    for key in r.scan_iter("{flowtest}:*"):
        r.delete(key)


def max_at_once(name: str) -> int:
    return int(sample_redis().get(max_key(name)) or 0)


def runs(name: str) -> list[tuple[str, float, float]]:
    """(key, start ms, end ms) of each run of `name`."""
    out = []
    for raw in sample_redis().lrange(runs_key(name), 0, -1):
        key, start, end = raw.decode().split(" ")
        out.append((key, float(start), float(end)))
    return out


@task
class Shaped:
    """One method per flow rule, and one without (for comparison and pauses)."""

    @exposed(concurrency=2)
    def limited(self, n: int) -> None:
        _sampled("limited")

    @exposed(rate="20/s")
    def paced(self, n: int) -> None:
        _sampled("paced")

    @exposed(one_at_a_time="order_id")
    def per_order(self, order_id: int, step: int) -> None:
        _sampled(f"order{order_id}", "per_order")

    @exposed
    def plain(self, n: int) -> None:
        _sampled("plain")
