"""Reconciliation's ledger queries: pending rows page by page, upcoming and overdue due times,
expired leases and their requeue."""

from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import Text, and_, func, literal, or_, select, update

from keyexpiry.ledger import Ledger, retried_once
from keyexpiry.rows import TaskRow, TaskStatus
from keyexpiry.rows import row_from_db as _row
from keyexpiry.table import T, with_earlier_errors


class PendingKey(NamedTuple):
    """What reconciliation needs of a pending row to check its key."""

    key: str
    due_at_ms: int
    attempts: int


KEYS_START = (-(2**62), "")
"""The position before every pending key in `pending_keys_page`'s order."""


class ScanQueries(Ledger):
    """Scans on the (status, due_at_ms, task_key, attempts) and (status, lease_until_ms) indexes."""

    @retried_once
    def pending_keys_page(
        self, *, after: tuple[int, str] = KEYS_START, upto_ms: int | None = None, limit: int
    ) -> list[PendingKey]:
        """Pending keys after `after` = (due_at_ms, task_key) in that order, up to due time
        `upto_ms` when given: a keyset walk read off the (status, due_at_ms, task_key, attempts)
        index alone. Reconciliation walks every pending row with it: no row lookups (which,
        in due order, land all over the table) and three small columns to decode."""
        due, key = after
        q = select(T.c.task_key, T.c.due_at_ms, T.c.attempts).where(
            T.c.status == TaskStatus.PENDING.value,
            or_(T.c.due_at_ms > due, and_(T.c.due_at_ms == due, T.c.task_key > key)),
        )
        if upto_ms is not None:
            q = q.where(T.c.due_at_ms <= upto_ms)
        with self._tx() as conn:
            rows = conn.execute(q.order_by(T.c.due_at_ms, T.c.task_key).limit(limit)).all()
        return [PendingKey(str(k), int(d), int(a)) for k, d, a in rows]

    @retried_once
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

    @retried_once
    def overdue(self, *, now_ms: int, limit: int) -> list[tuple[str, int]]:
        """(key, due) of pending rows due at or before `now_ms`, earliest first."""
        return self.upcoming(after_ms=-(2**62), upto_ms=now_ms, limit=limit)

    @retried_once
    def count_pending(self) -> int:
        """How many rows are pending."""
        with self._tx() as conn:
            n = conn.execute(
                select(func.count()).where(T.c.status == TaskStatus.PENDING.value)
            ).scalar_one()
        return int(n)

    @retried_once
    def active_counts(self) -> dict[str, int]:
        """Rows per status for pending, running and dead only: ranges of the status index, never
        the done and cancelled rows that make up most of a large ledger."""
        wanted = [TaskStatus.PENDING.value, TaskStatus.RUNNING.value, TaskStatus.DEAD.value]
        with self._tx() as conn:
            rows = conn.execute(
                select(T.c.status, func.count()).where(T.c.status.in_(wanted)).group_by(T.c.status)
            ).all()
        return {str(s): int(n) for s, n in rows}

    @retried_once
    def pending_due_before(self, edges_ms: list[int]) -> list[int]:
        """How many pending rows fall due before each of `edges_ms` (one index range each)."""
        with self._tx() as conn:
            return [
                int(
                    conn.execute(
                        select(func.count()).where(
                            T.c.status == TaskStatus.PENDING.value, T.c.due_at_ms < edge
                        )
                    ).scalar_one()
                )
                for edge in edges_ms
            ]

    @retried_once
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

    @retried_once
    def requeue_lost(
        self,
        row: TaskRow,
        *,
        status: TaskStatus,
        error: str,
        now_ms: int,
        lease_expired: bool = True,
    ) -> bool:
        """Move a lost run (its lease expired, or `lease_expired=False`: its listener stopped
        beating) to pending (due now) or dead; False if someone else did."""
        conditions = [
            T.c.id == row.id,
            T.c.status == TaskStatus.RUNNING.value,
            T.c.claimed_by == row.claimed_by,
        ]
        if lease_expired:
            conditions.append(T.c.lease_until_ms < now_ms)
        with self._tx() as conn:
            result = conn.execute(
                update(T)
                .where(*conditions)
                .values(
                    status=status.value,
                    due_at_ms=now_ms if status is TaskStatus.PENDING else row.due_at_ms,
                    finished_at_ms=now_ms if status is TaskStatus.DEAD else None,
                    lease_until_ms=None,
                    last_error=with_earlier_errors(literal(error, Text)),
                    updated_at_ms=now_ms,
                )
            )
        return bool(result.rowcount)
