"""The listener's ledger queries: claim a batch, record outcomes, release, extend a lease."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Text, bindparam, select, update

from keyexpiry.ledger import Ledger, retried_once
from keyexpiry.rows import Outcome, TaskRow, TaskStatus
from keyexpiry.rows import row_from_db as _row
from keyexpiry.table import T, with_earlier_errors


class ClaimQueries(Ledger):
    """Claims and outcomes: the hot path, one set-based statement per batch."""

    @retried_once
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

    @retried_once
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
            last_error=with_earlier_errors(bindparam("b_error", type_=Text)),
            lease_until_ms=None,
            updated_at_ms=bindparam("b_now"),
        )
    )

    @retried_once
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

    @retried_once
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
