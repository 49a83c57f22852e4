"""Retention: finished rows are deleted once older than their status's retention (done and
cancelled after `retain_done_s`, dead after `retain_dead_s`), in small batches by id so no
statement holds many locks or runs long. The listener prunes a few batches a minute; `keyexpiry
prune` does a backlog at once."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from sqlalchemy import ColumnElement, delete, func, select

from keyexpiry.ledger.base import Ledger, retried_once
from keyexpiry.ledger.rows import TaskStatus
from keyexpiry.ledger.table import T

BATCH_ROWS = 1000
FINISHED = (TaskStatus.DONE, TaskStatus.CANCELLED, TaskStatus.DEAD)


class RetentionQueries(Ledger):
    """Finished rows older than a cut-off: found on the (status, finished_at_ms) index alone
    (no row lookups), oldest first, deleted by primary key."""

    @staticmethod
    def _older(status: TaskStatus, before_ms: int) -> list[ColumnElement[bool]]:
        return [T.c.status == status.value, T.c.finished_at_ms < before_ms]

    @retried_once
    def count_finished_before(self, status: TaskStatus, before_ms: int) -> int:
        """How many `status` rows finished before `before_ms`."""
        with self._tx() as conn:
            q = select(func.count()).where(*self._older(status, before_ms))
            return int(conn.execute(q).scalar_one())

    @retried_once
    def delete_finished_before(self, status: TaskStatus, before_ms: int, limit: int) -> int:
        """Delete up to `limit` `status` rows finished before `before_ms`; how many went."""
        with self._tx() as conn:
            ids = [
                r[0]
                for r in conn.execute(
                    select(T.c.id)
                    .where(*self._older(status, before_ms))
                    .order_by(T.c.finished_at_ms)
                    .limit(limit)
                )
            ]
            if not ids:
                return 0
            # The status again: a row re-created meanwhile (same key, pending) is not ours.
            result = conn.execute(delete(T).where(T.c.id.in_(ids), T.c.status == status.value))
            return int(result.rowcount)


@dataclass
class PruneReport:
    """Rows deleted (or, in a dry run, that would be) per status."""

    deleted: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.deleted.values())

    def __str__(self) -> str:
        parts = [f"{n} {status}" for status, n in self.deleted.items() if n]
        return ", ".join(parts) or "nothing"


def cutoffs(now_ms: int, retain_s: Mapping[TaskStatus, float]) -> dict[TaskStatus, int]:
    """Per status, the finish time before which rows go (a retention of 0 keeps them)."""
    return {s: now_ms - int(r * 1000) for s, r in retain_s.items() if r > 0}


def prune(
    store: RetentionQueries,
    before_ms: Mapping[TaskStatus, int],
    *,
    max_batches: int | None = None,
    dry_run: bool = False,
    progress: Callable[[int], None] | None = None,
) -> PruneReport:
    """Delete finished rows older than their cut-off, `BATCH_ROWS` per transaction (at most
    `max_batches` batches in all); `progress(deleted)` after each batch."""
    report = PruneReport()
    batches = 0
    for status, cutoff in before_ms.items():
        if dry_run:
            report.deleted[status.value] = store.count_finished_before(status, cutoff)
            continue
        gone = 0
        while max_batches is None or batches < max_batches:
            n = store.delete_finished_before(status, cutoff, BATCH_ROWS)
            batches += 1
            gone += n
            if progress is not None and n:
                progress(n)
            if n < BATCH_ROWS:
                break
        report.deleted[status.value] = gone
    return report
