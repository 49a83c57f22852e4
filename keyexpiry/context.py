"""What a running handler can learn about its own run (`keyexpiry.current()`)."""

from __future__ import annotations

import datetime as dt
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine


@dataclass(frozen=True, slots=True)
class TaskContext:
    """The run in progress: its key, attempt number (1-based), due and start times (epoch ms on
    the shared clock) and the ledger engine.

    `engine` is the ledger's engine; handlers whose business tables live in the same database may
    use it (as the examples in `tasks/` do).
    """

    key: str
    attempt: int
    due_at_ms: int
    """When the task was due; never before 1970 (`limits.MIN_DUE_MS`): a row written outside
    keyexpiry with an earlier due time runs as due now and gives that."""
    engine: Engine
    started_at_ms: int = 0
    transaction: Connection | None = None
    """The run's connection in its transaction, for `@exposed(transactional=True)`; else None."""
    payload: Any = None
    """What travels with the task (`create(..., payload=)`), decoded from JSON: the same on
    every attempt; None when it has none."""
    scheduled_for_ms: int | None = None
    """For an occurrence of a recurring schedule: the occurrence it stands for (epoch ms)."""

    @property
    def scheduled_for(self) -> dt.datetime | None:
        """Which occurrence of its schedule this run is (UTC), after any catch-up: the latest
        missed one under `catch_up="latest"`; None for a task that is no occurrence."""
        if self.scheduled_for_ms is None:
            return None
        return dt.datetime.fromtimestamp(self.scheduled_for_ms / 1000, dt.UTC)

    @property
    def tx(self) -> Connection:
        """The connection, in the transaction that will record this run as done, of a handler
        marked `@exposed(transactional=True)`: write business tables (in the ledger's database)
        through it and they commit together with the task's `done`, or not at all. Do not
        commit or roll back yourself. RuntimeError for a handler not marked transactional."""
        if self.transaction is None:
            raise RuntimeError(
                "current().tx is only set for handlers marked @exposed(transactional=True)"
            )
        return self.transaction


_current: ContextVar[TaskContext | None] = ContextVar("keyexpiry_task", default=None)


def current() -> TaskContext:
    """The context of the handler run on this thread; RuntimeError outside a handler."""
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError("keyexpiry.current() called outside a task handler")
    return ctx


def set_current(ctx: TaskContext | None) -> None:
    """Set by the dispatcher around each handler call."""
    _current.set(ctx)
