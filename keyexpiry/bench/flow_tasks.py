"""The flow scenario's handlers (`keyexpiry.bench.flow`): each flow rule, and the same handlers
without one, for the comparison in the same run.

Each run notes one line in $KEYEXPIRY_BENCH_STARTS (a file per listener): `method i due_ms
start_ms entry_ms exit_ms`: `i` its argument, `start_ms` the run's `started_at_ms` on the shared
clock (the one due times and claims are on: lateness), `entry_ms` and `exit_ms` the handler's own
entry and exit on this machine's clock, which every listener of the benchmark reads alike (the
starts in a second and the runs at once over both listeners). The 50 ms handlers
also count themselves in Redis (`KEYEXPIRY_REDIS_URL`, the listeners' own): how many run at once
over the fleet, and the most seen, as each starts.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TextIO

import redis

import keyexpiry
from keyexpiry import exposed, task

RATE = "2000/s"
QUICK_RATE = "1000/s"
CONCURRENCY = 4
HOLD_S = 0.05
"""How long each run of the concurrency variants lasts."""

_lock = threading.Lock()
_out: TextIO | None = None
_redis: redis.Redis | None = None

# INCR the running count, raise the max to it: one round trip, atomic.
_ENTER = """
local n = redis.call('INCR', KEYS[1])
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end
return n
"""


def now_key(method: str) -> str:
    """Runs of `method` going on now (in one hash slot with `max_key`)."""
    return f"{{keyexpiry-bench-flow}}:{method}:now"


def max_key(method: str) -> str:
    """The most runs of `method` seen at once."""
    return f"{{keyexpiry-bench-flow}}:{method}:max"


def _sampling_redis() -> redis.Redis:
    global _redis
    if _redis is None:
        with _lock:
            if _redis is None:
                _redis = redis.Redis.from_url(os.environ["KEYEXPIRY_REDIS_URL"])
    return _redis


def _note(method: str, i: int, entry_ms: float) -> None:
    """One line for this run (see the module's docstring); nothing without a starts file."""
    global _out
    exit_ms = time.time() * 1000
    path = os.environ.get("KEYEXPIRY_BENCH_STARTS")
    if not path:
        return
    ctx = keyexpiry.current()
    line = f"{method} {i} {ctx.due_at_ms} {ctx.started_at_ms} {entry_ms:.3f} {exit_ms:.3f}\n"
    with _lock:
        if _out is None:
            _out = open(path, "a", buffering=1)  # noqa: SIM115 - kept open for the process
        _out.write(line)


def _held(method: str, i: int) -> None:
    """Count this run in Redis, last `HOLD_S`, note it."""
    entry_ms = time.time() * 1000
    r = _sampling_redis()
    r.eval(_ENTER, 2, now_key(method), max_key(method))
    try:
        time.sleep(HOLD_S)
    finally:
        r.decr(now_key(method))
        _note(method, i, entry_ms)


@task
class BenchFlow:
    """(a) a rate, (b) a concurrency limit with 50 ms runs, (c) the same handlers unlimited."""

    @exposed(rate=RATE)
    def paced(self, i: int) -> None:
        """(a): starts only, spaced by the rate."""
        _note("paced", i, time.time() * 1000)

    @exposed(rate=QUICK_RATE)
    def paced_quick(self, i: int) -> None:
        """(a) in `--quick`: a shorter wave at a lower rate."""
        _note("paced_quick", i, time.time() * 1000)

    @exposed
    def free(self, i: int) -> None:
        """(c) for (a): the same handler, no rule."""
        _note("free", i, time.time() * 1000)

    @exposed(concurrency=CONCURRENCY)
    def limited(self, i: int) -> None:
        """(b): 50 ms each, at most `CONCURRENCY` at once over the fleet."""
        _held("limited", i)

    @exposed
    def unlimited(self, i: int) -> None:
        """(c) for (b): the same handler, no rule."""
        _held("unlimited", i)
