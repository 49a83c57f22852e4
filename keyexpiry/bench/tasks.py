"""The trivial handler every benchmark scenario runs."""

from __future__ import annotations

import json
import os
import threading
import time
import tracemalloc
from typing import TextIO

import keyexpiry
from keyexpiry import exposed, task

_lock = threading.Lock()
_out: TextIO | None = None

MEMORY_AT_ENV = "KEYEXPIRY_BENCH_MEMORY_AT"
"""Comma-separated run counts at which the memory scenario's listener notes its Python-level
allocations (tracemalloc, started when this module loads) to `MEMORY_OUT_ENV`."""
MEMORY_OUT_ENV = "KEYEXPIRY_BENCH_MEMORY_OUT"

_runs = 0
_memory_at: list[int] = sorted(int(n) for n in os.environ.get(MEMORY_AT_ENV, "").split(",") if n)
if _memory_at:
    tracemalloc.start(1)


def _note_start() -> None:
    """Append "lateness_ms" of this run (handler start minus due) to $KEYEXPIRY_BENCH_STARTS.

    The ledger's started_at_ms is the claim time; the benchmark wants the handler's own start.
    """
    global _out, _runs
    path = os.environ.get("KEYEXPIRY_BENCH_STARTS")
    if not path:
        return
    ctx = keyexpiry.current()
    with _lock:
        if _out is None:
            _out = open(path, "a", buffering=1)  # noqa: SIM115 - kept open for the process
        _out.write(f"{ctx.started_at_ms - ctx.due_at_ms}\n")
        _runs += 1
        if _memory_at and _runs == _memory_at[0]:
            _memory_at.pop(0)
            _note_memory(_runs)


def _note_sent(i: int, sent_ms: float, start_s: float) -> None:
    """Append `i sent_ms start_ms end_ms pid` to $KEYEXPIRY_BENCH_STARTS (the run-now scenario's
    line, as its peers' handlers write it: `keyexpiry.bench.peer_runnow`)."""
    global _out
    path = os.environ.get("KEYEXPIRY_BENCH_STARTS")
    if not path:
        return
    with _lock:
        if _out is None:
            _out = open(path, "a", buffering=1)  # noqa: SIM115 - kept open for the process
        end_ms = time.time() * 1000
        _out.write(f"{i} {sent_ms:.3f} {start_s * 1000:.3f} {end_ms:.3f} {os.getpid()}\n")


def _note_memory(runs: int) -> None:
    """One JSON line: the bytes tracemalloc sees allocated after `runs` runs and, from the second
    checkpoint on, the source lines whose allocations grew most since the first.

    The first checkpoint's snapshot waits in a file, not in memory: kept, it would be a step in
    the RSS the scenario measures.
    """
    path = os.environ[MEMORY_OUT_ENV]
    note: dict[str, object] = {"runs": runs, "traced_bytes": tracemalloc.get_traced_memory()[0]}
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)]
    )
    first = path + ".first-snapshot"
    if not os.path.exists(first):
        snapshot.dump(first)
    else:
        note["grew"] = [
            {"where": str(s.traceback), "size_diff": s.size_diff, "count_diff": s.count_diff}
            for s in snapshot.compare_to(tracemalloc.Snapshot.load(first), "lineno")[:10]
        ]
        os.unlink(first)
    del snapshot
    with open(path, "a") as out:
        out.write(json.dumps(note) + "\n")


@task
class Bench:
    """Does nothing: the benchmark measures keyexpiry, not the handler."""

    @exposed
    def noop(self, i: int) -> None:
        """Note the start time, nothing else."""
        _note_start()

    @exposed
    def run_now(self, i: int, sent_ms: float) -> None:
        """A run-now task (`ttl_ms=0`): note its start, host time, beside `sent_ms`, the host
        time its creator took just before `create`."""
        _note_sent(i, sent_ms, time.time())

    @exposed
    def other(self, i: int) -> None:
        """Background tasks due far in the future (the 'N pending' of the sparse scenario)."""
