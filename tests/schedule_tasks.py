"""Task classes the schedule tests run; each run appends `key scheduled_for_ms started_ms` to a
Redis list (named by `SAMPLE_REDIS_ENV`, shared with tests.flow_tasks), so runs in any listener
process are counted together."""

from __future__ import annotations

import os
import time

from keyexpiry import current, exposed, task
from keyexpiry.registry import Registry
from tests.flow_tasks import SAMPLE_REDIS_ENV, sample_redis

HOLD_MS_ENV = "KEYEXPIRY_TEST_SCHEDULE_HOLD_MS"
"""How long each run of `Report.build` lasts (default 0)."""
FAIL_ENV = "KEYEXPIRY_TEST_SCHEDULE_FAIL"
"""While set, `Report.build` raises (to test dead occurrences)."""
RUNS = "{flowtest}:schedule-runs"

__all__ = ["SAMPLE_REDIS_ENV", "Report", "Tick", "runs"]


def _note() -> None:
    ctx = current()
    scheduled = ctx.scheduled_for_ms if ctx.scheduled_for_ms is not None else -1
    sample_redis().rpush(RUNS, f"{ctx.key} {scheduled} {ctx.started_at_ms}")


def runs() -> list[tuple[str, int, int]]:
    """(key, scheduled_for_ms, started_ms) of each run, in the order they started."""
    out = []
    for raw in sample_redis().lrange(RUNS, 0, -1):
        key, scheduled, started = raw.decode().split(" ")
        out.append((key, int(scheduled), int(started)))
    return out


@task
class Report:
    """Run per argument set by `Client.schedule`."""

    @exposed(retry_schedule_s=[])
    def build(self, region: str) -> None:
        _note()
        hold_ms = int(os.environ.get(HOLD_MS_ENV, "0"))
        if hold_ms:
            time.sleep(hold_ms / 1000)
        if os.environ.get(FAIL_ENV):
            raise RuntimeError("report failed")


TICKS = Registry()
"""Where `Tick` is registered: not the default registry, or every listener of the test run
would declare its schedule (a listener given this registry runs `Tick` and `Report`)."""


@TICKS.register
class Tick:
    """Declared in code: every listener that registers it declares the same schedule."""

    @exposed(every_s=1, catch_up="latest")
    def beat(self) -> None:
        _note()


TICKS.register(Report)
