"""The trivial handler every benchmark scenario runs."""

from __future__ import annotations

import os
import threading
from typing import TextIO

import keyexpiry
from keyexpiry import exposed, task

_lock = threading.Lock()
_out: TextIO | None = None


def _note_start() -> None:
    """Append "lateness_ms" of this run (handler start minus due) to $KEYEXPIRY_BENCH_STARTS.

    The ledger's started_at_ms is the claim time; the benchmark wants the handler's own start.
    """
    global _out
    path = os.environ.get("KEYEXPIRY_BENCH_STARTS")
    if not path:
        return
    ctx = keyexpiry.current()
    with _lock:
        if _out is None:
            _out = open(path, "a", buffering=1)  # noqa: SIM115 - kept open for the process
        _out.write(f"{ctx.started_at_ms - ctx.due_at_ms}\n")


@task
class Bench:
    """Does nothing: the benchmark measures keyexpiry, not the handler."""

    @exposed
    def noop(self, i: int) -> None:
        """Note the start time, nothing else."""
        _note_start()

    @exposed
    def other(self, i: int) -> None:
        """Background tasks due far in the future (the 'N pending' of the sparse scenario)."""
