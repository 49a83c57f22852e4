"""Every query keyexpiry runs against the ledger (`time_limit_task`), each raising StoreError,
never a driver exception.

SQLAlchemy Core, no ORM: the hot paths are a handful of set-based statements (claim a batch of keys,
record a batch of outcomes), and Core keeps them explicit and cheap.
"""

from __future__ import annotations

import functools
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, bindparam, func, inspect, select, update
from sqlalchemy.exc import SQLAlchemyError

from keyexpiry.errors import StoreError
from keyexpiry.rows import NewTask, Outcome, TaskRow, TaskStatus
from keyexpiry.rows import row_from_db as _row
from keyexpiry.settings import mask_url
from keyexpiry.table import TABLE_NAME, T, make_engine, metadata, time_limit_task, upsert_statement

__all__ = [
    "TABLE_NAME",
    "NewTask",
    "Outcome",
    "Store",
    "T",
    "TaskRow",
    "TaskStatus",
    "make_engine",
    "metadata",
    "time_limit_task",
]

R = TypeVar("R")


_MYSQL_LOCK_WAIT_TIMEOUT = 1205  # ER_LOCK_WAIT_TIMEOUT: only the statement was rolled back


def _error_code(exc: SQLAlchemyError) -> int | None:
    """The MySQL/MariaDB error number behind `exc` (PyMySQL puts it first in `args`)."""
    args = getattr(getattr(exc, "orig", None), "args", ())
    return args[0] if args and isinstance(args[0], int) else None


# InnoDB deadlock: the server rolled the transaction back and expects the client to run it again
# (a create rescheduling a key deadlocks with a claim of the same row). A lock wait timeout is
# not retried here: the claimer splits its batch around the locked row instead.
_ROLLED_BACK_BY_SERVER = {1213}


def _rolled_back_by_server(exc: StoreError) -> bool:
    args: tuple[object, ...] = getattr(getattr(exc.__cause__, "orig", None), "args", ())
    return bool(args) and args[0] in _ROLLED_BACK_BY_SERVER


def _retried(method: Callable[..., R]) -> Callable[..., R]:
    """Run a Store method once more when its connection turned out to be dead, or MariaDB chose
    it as a deadlock's victim.

    Safe because every method is idempotent or keyed by a claim token: a claim repeated after an
    ambiguous commit finds its rows by token, a repeated record or cancel changes nothing more.
    """

    @functools.wraps(method)
    def wrapper(self: Store, *args: Any, **kwargs: Any) -> R:
        try:
            return method(self, *args, **kwargs)
        except StoreError as exc:
            if not (exc.disconnected or _rolled_back_by_server(exc)):
                raise
            return method(self, *args, **kwargs)

    return wrapper


class Store:
    """Queries on `time_limit_task`; every method raises StoreError, never a driver exception."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._upsert = upsert_statement(engine.dialect.name)
        self._url = mask_url(engine.url.render_as_string(hide_password=True))
        self._schema_lock = threading.Lock()

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        try:
            with self.engine.begin() as conn:
                yield conn
        except SQLAlchemyError as exc:
            detail = str(getattr(exc, "orig", None) or exc).splitlines()[0][:300]
            error = StoreError(f"database {self._url}: {detail}")
            error.disconnected = bool(getattr(exc, "connection_invalidated", False))
            error.lock_timeout = _error_code(exc) == _MYSQL_LOCK_WAIT_TIMEOUT
            raise error from exc

    # --- schema -------------------------------------------------------------------------------
    @_retried
    def create_schema(self) -> None:
        """Create the table and indexes if they do not exist."""
        for attempt in range(5):
            try:
                with self._schema_lock, self._tx() as conn:
                    metadata.create_all(conn, checkfirst=True)
                return
            except StoreError as exc:
                # Two processes starting on a new SQLite file race to create it (or to switch
                # it to WAL): whoever lost finds the table there, or tries again.
                racing = "already exists" in str(exc) or "database is locked" in str(exc)
                if not racing or attempt == 4:
                    raise
                if "already exists" in str(exc) and self.table_exists():
                    return
                time.sleep(0.05 * (attempt + 1))

    @_retried
    def table_exists(self) -> bool:
        """Whether `time_limit_task` exists."""
        with self._tx() as conn:
            return bool(inspect(conn).has_table(TABLE_NAME))

    # --- create / cancel / read -----------------------------------------------------------------
    @_retried
    def upsert_pending(self, tasks: Sequence[NewTask], now_ms: int) -> None:
        """Insert each task as pending, or reset an existing key to pending at its new due time."""
        if not tasks:
            return
        rows = [
            {
                "task_key": t.key,
                "class_name": t.class_name,
                "method": t.method,
                "args": json.dumps(list(t.args), ensure_ascii=False),
                "status": TaskStatus.PENDING.value,
                "attempts": 0,
                "retry_schedule_s": json.dumps(list(t.retry_schedule_s))
                if t.retry_schedule_s is not None
                else None,
                "due_at_ms": t.due_at_ms,
                "created_at_ms": now_ms,
                "updated_at_ms": now_ms,
                "started_at_ms": None,
                "finished_at_ms": None,
                "claimed_by": None,
                "lease_until_ms": None,
                "last_error": None,
            }
            for t in tasks
        ]
        with self._tx() as conn:
            # One statement run as executemany: PyMySQL folds it into multi-row INSERTs and
            # sqlite3 loops in C, so a bulk create costs a few round trips, not one per task.
            for start in range(0, len(rows), 5000):
                conn.execute(self._upsert, rows[start : start + 5000])

    def cancel(self, keys: Sequence[str], now_ms: int) -> list[str]:
        """Cancel those of `keys` that are pending; return the keys actually cancelled."""
        if not keys:
            return []
        # The token is fixed before any retry, so a retry after an ambiguous commit still
        # reports the rows the first attempt cancelled: the answer stays truthful.
        return self._cancel(keys, now_ms, f"cancel:{uuid.uuid4().hex}")

    @_retried
    def _cancel(self, keys: Sequence[str], now_ms: int, token: str) -> list[str]:
        with self._tx() as conn:
            conn.execute(
                update(T)
                .where(T.c.task_key.in_(list(keys)), T.c.status == TaskStatus.PENDING.value)
                .values(
                    status=TaskStatus.CANCELLED.value,
                    updated_at_ms=now_ms,
                    finished_at_ms=now_ms,
                    claimed_by=token,
                )
            )
            got = conn.execute(
                select(T.c.task_key).where(T.c.claimed_by == token, T.c.task_key.in_(list(keys)))
            )
            return [r[0] for r in got]

    @_retried
    def get(self, key: str) -> TaskRow | None:
        """The row for `key`, or None."""
        with self._tx() as conn:
            r = conn.execute(select(T).where(T.c.task_key == key)).first()
        return _row(r) if r is not None else None

    @_retried
    def get_many(self, keys: Sequence[str]) -> dict[str, TaskRow]:
        """Rows for `keys`, by key (missing keys are absent)."""
        if not keys:
            return {}
        with self._tx() as conn:
            rows = conn.execute(select(T).where(T.c.task_key.in_(list(keys)))).all()
        return {r.task_key: _row(r) for r in rows}

    @_retried
    def list_tasks(self, status: TaskStatus | None = None, limit: int = 50) -> list[TaskRow]:
        """Rows ordered by due time, optionally of one status."""
        q = select(T).order_by(T.c.due_at_ms, T.c.id).limit(limit)
        if status is not None:
            q = q.where(T.c.status == status.value)
        with self._tx() as conn:
            return [_row(r) for r in conn.execute(q)]

    @_retried
    def counts(self) -> dict[str, int]:
        """Number of rows per status."""
        with self._tx() as conn:
            rows = conn.execute(select(T.c.status, func.count()).group_by(T.c.status)).all()
        return {str(s): int(n) for s, n in rows}

    # --- dispatch -------------------------------------------------------------------------------
    @_retried
    def claim(
        self, keys: Sequence[str], *, now_ms: int, lease_until_ms: int, token: str
    ) -> list[TaskRow]:
        """Atomically move due pending rows among `keys` to running under `token`; return them.

        Only rows that are pending and due are taken, so a stale event for a task rescheduled to
        later does nothing, and of several listeners racing for a row exactly one gets it.
        """
        if not keys:
            return []
        with self._tx() as conn:
            conn.execute(
                update(T)
                .where(
                    T.c.task_key.in_(list(keys)),
                    T.c.status == TaskStatus.PENDING.value,
                    T.c.due_at_ms <= now_ms,
                )
                .values(
                    status=TaskStatus.RUNNING.value,
                    claimed_by=token,
                    lease_until_ms=lease_until_ms,
                    attempts=T.c.attempts + 1,
                    started_at_ms=now_ms,
                    finished_at_ms=None,
                    updated_at_ms=now_ms,
                )
            )
            rows = conn.execute(
                select(T).where(T.c.claimed_by == token, T.c.status == TaskStatus.RUNNING.value)
            ).all()
        return [_row(r) for r in rows]

    @_retried
    def record(self, outcomes: Sequence[Outcome], now_ms: int) -> int:
        """Record finished runs in one transaction; a run whose claim was lost is skipped.

        Returns how many rows were updated.
        """
        if not outcomes:
            return 0
        done: dict[str, list[int]] = {}
        others: list[Outcome] = []
        for o in outcomes:
            if o.status is TaskStatus.DONE and o.last_error is None:
                done.setdefault(o.token, []).append(o.task_id)
            else:
                others.append(o)
        count = 0
        with self._tx() as conn:
            # Successes, the bulk of any batch: one statement per claim batch, not one per row.
            for token, ids in done.items():
                count += conn.execute(
                    update(T)
                    .where(
                        T.c.id.in_(ids),
                        T.c.claimed_by == token,
                        T.c.status == TaskStatus.RUNNING.value,
                    )
                    .values(
                        status=TaskStatus.DONE.value,
                        finished_at_ms=now_ms,
                        last_error=None,
                        lease_until_ms=None,
                        updated_at_ms=now_ms,
                    )
                ).rowcount
            if others:
                count += conn.execute(
                    self._record_one, self._record_params(others, now_ms)
                ).rowcount
        return count

    @staticmethod
    def _record_params(outcomes: Sequence[Outcome], now_ms: int) -> list[dict[str, Any]]:
        return [
            {
                "b_id": o.task_id,
                "b_token": o.token,
                "b_status": o.status.value,
                "b_finished": o.finished_at_ms,
                "b_due": o.due_at_ms,
                "b_error": o.last_error,
                "b_now": now_ms,
            }
            for o in outcomes
        ]

    _record_one = (
        update(T)
        .where(
            T.c.id == bindparam("b_id"),
            T.c.claimed_by == bindparam("b_token"),
            T.c.status == TaskStatus.RUNNING.value,
        )
        .values(
            status=bindparam("b_status"),
            finished_at_ms=bindparam("b_finished"),
            due_at_ms=bindparam("b_due"),
            last_error=bindparam("b_error"),
            lease_until_ms=None,
            updated_at_ms=bindparam("b_now"),
        )
    )

    @_retried
    def release(self, task_ids: Sequence[int], token: str, now_ms: int) -> int:
        """Give claimed-but-not-started runs back: pending again, the attempt not counted."""
        if not task_ids:
            return 0
        with self._tx() as conn:
            result = conn.execute(
                update(T)
                .where(
                    T.c.id.in_(list(task_ids)),
                    T.c.claimed_by == token,
                    T.c.status == TaskStatus.RUNNING.value,
                )
                .values(
                    status=TaskStatus.PENDING.value,
                    attempts=T.c.attempts - 1,
                    claimed_by=None,
                    lease_until_ms=None,
                    started_at_ms=None,
                    updated_at_ms=now_ms,
                )
            )
        return int(result.rowcount)

    @_retried
    def extend_lease(self, task_id: int, token: str, lease_until_ms: int, now_ms: int) -> bool:
        """Push out the lease of a claimed run that starts late; False if the claim was lost."""
        with self._tx() as conn:
            result = conn.execute(
                update(T)
                .where(
                    T.c.id == task_id,
                    T.c.claimed_by == token,
                    T.c.status == TaskStatus.RUNNING.value,
                )
                .values(lease_until_ms=lease_until_ms, updated_at_ms=now_ms)
            )
        return bool(result.rowcount)

    # --- reconciliation -------------------------------------------------------------------------
    @_retried
    def pending_page(self, *, after_id: int, limit: int) -> list[TaskRow]:
        """Pending rows with id > `after_id`, by id (keyset pagination, no OFFSET scans)."""
        with self._tx() as conn:
            rows = conn.execute(
                select(T)
                .where(T.c.status == TaskStatus.PENDING.value, T.c.id > after_id)
                .order_by(T.c.id)
                .limit(limit)
            ).all()
        return [_row(r) for r in rows]

    @_retried
    def upcoming(self, *, after_ms: int, upto_ms: int, limit: int) -> list[tuple[str, int]]:
        """(key, due) of pending rows due in (after_ms, upto_ms], earliest first."""
        with self._tx() as conn:
            rows = conn.execute(
                select(T.c.task_key, T.c.due_at_ms)
                .where(
                    T.c.status == TaskStatus.PENDING.value,
                    T.c.due_at_ms > after_ms,
                    T.c.due_at_ms <= upto_ms,
                )
                .order_by(T.c.due_at_ms)
                .limit(limit)
            ).all()
        return [(str(k), int(d)) for k, d in rows]

    @_retried
    def overdue(self, *, now_ms: int, limit: int) -> list[tuple[str, int]]:
        """(key, due) of pending rows due at or before `now_ms`, earliest first."""
        return self.upcoming(after_ms=-(2**62), upto_ms=now_ms, limit=limit)

    @_retried
    def count_pending(self) -> int:
        """How many rows are pending."""
        with self._tx() as conn:
            n = conn.execute(
                select(func.count()).where(T.c.status == TaskStatus.PENDING.value)
            ).scalar_one()
        return int(n)

    @_retried
    def expired_leases(self, now_ms: int, limit: int = 1000) -> list[TaskRow]:
        """Running rows whose lease has run out: the listener running them is gone."""
        with self._tx() as conn:
            rows = conn.execute(
                select(T)
                .where(T.c.status == TaskStatus.RUNNING.value, T.c.lease_until_ms < now_ms)
                .order_by(T.c.lease_until_ms)
                .limit(limit)
            ).all()
        return [_row(r) for r in rows]

    @_retried
    def requeue_lost(self, row: TaskRow, *, status: TaskStatus, error: str, now_ms: int) -> bool:
        """Move a lease-expired run to pending (due now) or dead; False if someone else did."""
        with self._tx() as conn:
            result = conn.execute(
                update(T)
                .where(
                    T.c.id == row.id,
                    T.c.status == TaskStatus.RUNNING.value,
                    T.c.claimed_by == row.claimed_by,
                    T.c.lease_until_ms < now_ms,
                )
                .values(
                    status=status.value,
                    due_at_ms=now_ms if status is TaskStatus.PENDING else row.due_at_ms,
                    finished_at_ms=now_ms if status is TaskStatus.DEAD else None,
                    lease_until_ms=None,
                    last_error=error,
                    updated_at_ms=now_ms,
                )
            )
        return bool(result.rowcount)
