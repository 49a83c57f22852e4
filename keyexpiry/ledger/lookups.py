"""The dashboard's ledger queries: rows an operator looks for (overdue, running, retrying, dead,
by key or class), each on an index range that never walks done or cancelled rows."""

from __future__ import annotations

from sqlalchemy import literal_column, select, update

from keyexpiry.ledger.base import Ledger, like_prefix, retried_once
from keyexpiry.ledger.reading import row_from_db as _row
from keyexpiry.ledger.rows import TaskRow, TaskStatus
from keyexpiry.ledger.table import T


class LookupQueries(Ledger):
    """Lists for the dashboard and `Client.run_now`."""

    @retried_once
    def rows_with_status(
        self, status: TaskStatus, *, limit: int, newest_first: bool = False
    ) -> list[TaskRow]:
        """Rows of one status by due time (ties by key: the order of the (status, due_at_ms,
        task_key) index), or newest first."""
        order = (
            (T.c.due_at_ms.desc(), T.c.task_key.desc())
            if newest_first
            else (T.c.due_at_ms, T.c.task_key)
        )
        with self._tx() as conn:
            rows = conn.execute(
                select(T).where(T.c.status == status.value).order_by(*order).limit(limit)
            ).all()
        return [_row(r, self.key_prefix) for r in rows]

    @retried_once
    def overdue_rows(self, *, now_ms: int, limit: int) -> list[TaskRow]:
        """Pending rows due at or before `now_ms`, most overdue first."""
        with self._tx() as conn:
            rows = conn.execute(
                select(T)
                .where(T.c.status == TaskStatus.PENDING.value, T.c.due_at_ms <= now_ms)
                .order_by(T.c.due_at_ms, T.c.task_key)
                .limit(limit)
            ).all()
        return [_row(r, self.key_prefix) for r in rows]

    @retried_once
    def retrying(self, *, limit: int) -> list[TaskRow]:
        """Pending rows that failed at least once, next attempt first."""
        with self._tx() as conn:
            rows = conn.execute(
                select(T)
                # Literals: PostgreSQL reads this off a partial index whose predicate says the
                # same, which a plan for bound values (psycopg prepares a statement it runs
                # often) could not prove it may use.
                .where(
                    T.c.status == literal_column(f"'{TaskStatus.PENDING.value}'"),
                    T.c.attempts > literal_column("0"),
                )
                .order_by(T.c.due_at_ms, T.c.task_key)
                .limit(limit)
            ).all()
        return [_row(r, self.key_prefix) for r in rows]

    @retried_once
    def search(
        self, key_prefix: str, *, status: TaskStatus | None = None, limit: int = 100
    ) -> list[TaskRow]:
        """Rows whose key starts with `key_prefix` (a range of the unique key index: a class is
        `Class@`, a method `Class@method@`), by key."""
        q = select(T).where(T.c.task_key.like(like_prefix(key_prefix), escape="\\"))
        if status is not None:
            q = q.where(T.c.status == status.value)
        with self._tx() as conn:
            rows = conn.execute(q.order_by(T.c.task_key).limit(limit)).all()
        return [_row(r, self.key_prefix) for r in rows]

    @retried_once
    def due_now(self, keys: list[str], *, now_ms: int) -> list[str]:
        """Move those of `keys` that are pending to due now; return them."""
        if not keys:
            return []
        with self._tx() as conn:
            conn.execute(
                update(T)
                .where(T.c.task_key.in_(keys), T.c.status == TaskStatus.PENDING.value)
                .values(due_at_ms=now_ms, updated_at_ms=now_ms)
            )
            got = conn.execute(
                select(T.c.task_key).where(
                    T.c.task_key.in_(keys),
                    T.c.status == TaskStatus.PENDING.value,
                    T.c.due_at_ms == now_ms,
                )
            )
            return [r[0] for r in got]
