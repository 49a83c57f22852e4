"""Tasks of tests/faults/test_schedule_faults.py. Each run appends
`key scheduled_for_ms started_ms pid` to a Redis list of the test's sampling Redis (named by
`SAMPLE_REDIS_ENV`, as tests.flow_tasks), so runs in any listener process, killed or not, are
counted together: a run is sampled as it starts, before anything can cut it short.

`Pulse`, the schedule declared in code, is in tests.schedule_fault_pulse: a module given only to
listener subprocesses (`--tasks`), so no in-process listener of the test run declares it."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from keyexpiry import current, exposed, task
from tests.flow_tasks import SAMPLE_REDIS_ENV, sample_redis

RUNS = "{flowtest}:schedule-fault-runs"
"""The sampled runs (tests.flow_tasks.reset() forgets them with the other samples)."""
HOLD = "{flowtest}:schedule-fault-hold"
"""While this key exists in the sampling Redis, a process with `HOLD_ENV` set holds each run."""
HOLD_ENV = "KEYEXPIRY_TEST_SCHEDULE_FAULT_HOLD"
"""Set in the environment of the listener to kill: its runs hang (once `HOLD` is set)."""
HOLD_S = 60.0

__all__ = ["HOLD", "HOLD_ENV", "RUNS", "SAMPLE_REDIS_ENV", "Chore", "Run", "note", "runs"]


@dataclass(frozen=True, slots=True)
class Run:
    """One sampled run: which task, the occurrence it stood for, when it started, where."""

    key: str
    scheduled_for_ms: int
    started_ms: int
    pid: int


def note() -> None:
    """Sample the current run (its occurrence from `current().scheduled_for_ms`)."""
    ctx = current()
    scheduled = ctx.scheduled_for_ms if ctx.scheduled_for_ms is not None else -1
    sample_redis().rpush(RUNS, f"{ctx.key} {scheduled} {ctx.started_at_ms} {os.getpid()}")


def runs(key: str | None = None) -> list[Run]:
    """The sampled runs (of `key` only, when given), in the order they started."""
    out = []
    for raw in sample_redis().lrange(RUNS, 0, -1):
        k, scheduled, started, pid = raw.decode().split(" ")
        if key is None or k == key:
            out.append(Run(k, int(scheduled), int(started), int(pid)))
    return out


@task
class Chore:
    """Scheduled by `Client.schedule` with one argument per schedule; default retries (a run
    lost with its listener is requeued, not dead)."""

    @exposed
    def run(self, name: str) -> None:
        note()
        if os.environ.get(HOLD_ENV) and sample_redis().exists(HOLD):
            time.sleep(HOLD_S)  # until the test kills this listener
