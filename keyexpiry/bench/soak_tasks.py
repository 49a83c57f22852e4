"""The soak's handler: what each run did, appended to a history file, and the designed failures.

A task's behaviour follows from its id alone (`kind`), so the verdict knows what to expect of
every task without asking the listener: 1 % fail once then succeed, 0.5 % fail for good (dead),
0.5 % sleep past their timeout once. Each start and end is one `os.write` of one line to a file
opened with O_APPEND: a line is in the file whole or not at all, even when the listener is
killed -9 mid-run, which is exactly the history the verdict needs.
"""

from __future__ import annotations

import json
import os
import time
from typing import Literal

import keyexpiry
from keyexpiry import exposed, task

Kind = Literal["normal", "fail_once", "dead", "slow_once"]

HISTORY_DIR_ENV = "KEYEXPIRY_SOAK_DIR"
"""Where each listener process appends its `runs-<pid>.jsonl`."""
TIMEOUT_S = 1.0
"""The handler's timeout: a slow-once run sleeps `SLOW_S`, past it."""
SLOW_S = 1.5


def kind(i: int) -> Kind:
    """The designed behaviour of task `i`: 2 in 200 fail once, 1 dies, 1 is slow once."""
    r = i % 200
    if r in (7, 107):
        return "fail_once"
    if r == 53:
        return "dead"
    if r == 151:
        return "slow_once"
    return "normal"


class DesignedFailure(Exception):
    """Raised when a soak task fails as its kind says it must."""


_fd: int | None = None


def _note(line: dict[str, object]) -> None:
    global _fd
    if _fd is None:
        directory = os.environ.get(HISTORY_DIR_ENV)
        if not directory:
            return
        path = os.path.join(directory, f"runs-{os.getpid()}.jsonl")
        _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(_fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())


@task
class Soak:
    """The soak's one task method."""

    @exposed(timeout_s=TIMEOUT_S)
    def run(self, i: int) -> None:
        """Note the start; fail, sleep or succeed as `kind(i)` says; note the end."""
        ctx = keyexpiry.current()
        pid = os.getpid()
        _note(
            {
                "ev": "start",
                "i": i,
                "attempt": ctx.attempt,
                "pid": pid,
                # When the listener began the run (before this line: a SIGSTOP in between must
                # not move the start past the fault), on the shared clock, whose readings are
                # now retaken when slow (a stalled one put starts 7 ms after their end);
                # `host_ms`, this line's own time on this host, for diagnosis.
                "t_ms": ctx.started_at_ms,
                "host_ms": int(time.time() * 1000),
                "due_ms": ctx.due_at_ms,
            }
        )
        k = kind(i)
        result = "ok"
        try:
            if k == "dead" or (k == "fail_once" and ctx.attempt == 1):
                result = "fail"
                raise DesignedFailure(f"soak task {i} fails by design ({k})")
            if k == "slow_once" and ctx.attempt == 1:
                result = "slow"
                time.sleep(SLOW_S)
        finally:
            _note(
                {
                    "ev": "end",
                    "i": i,
                    "attempt": ctx.attempt,
                    "pid": pid,
                    "t_ms": int(time.time() * 1000),
                    "result": result,
                }
            )
