"""Reconciliation's ledger queries: pending rows page by page, upcoming and overdue due times,
expired leases and their requeue."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import ColumnElement, Connection, Text, and_, func, literal, or_, select, update

from keyexpiry.ledger.base import Ledger, retried_once
from keyexpiry.ledger.reading import row_from_db as _row
from keyexpiry.ledger.reading import stored_ms
from keyexpiry.ledger.recurring import ScheduleRow, readable_schedule
from keyexpiry.ledger.rows import BIGINT_MAX, UNREADABLE_MS, TaskRow, TaskStatus
from keyexpiry.ledger.table import S, T, with_earlier_errors
from keyexpiry.schedules.rules import next_after_run


class PendingKey(NamedTuple):
    """What reconciliation needs of a pending row to check its key."""

    key: str
    due_at_ms: int
    attempts: int
    problem: str | None = None
    """Why this row cannot be reconciled (its due time is not a number): skip and report it."""
    stored_due: Any = None
    """The due time as stored, when it is not `due_at_ms` itself (see `position`)."""

    @property
    def position(self) -> tuple[Any, str]:
        """This row's place in the walk's order, as the database compares it: a page after a
        row whose due time is text (SQLite sorts it after every number) starts after that
        text, not after a stand-in, or the walk would read that row again for ever."""
        return (self.due_at_ms if self.stored_due is None else self.stored_due, self.key)


KEYS_START: tuple[Any, str] = (None, "")
"""The position before every pending key in `pending_keys_page`'s order, whatever is stored
(a due time of -9e18, below any bound that could be written here, is walked too)."""


def _no_number(column: ColumnElement[Any]) -> ColumnElement[bool]:
    """True where a BIGINT column holds no number in range: only SQLite keeps such values
    (text and blobs sort after every number there); on MySQL/MariaDB it matches nothing. A
    range of the column's index, unlike a type test."""
    return column > BIGINT_MAX


def _pending_key(k: Any, d: Any, a: Any) -> PendingKey:
    if type(d) is int and type(a) is int and type(k) is str:  # every sound row, at once
        return PendingKey(k, d, a)
    due, attempts = stored_ms(d), stored_ms(a)
    problem = None
    if due is None:
        problem = f"its due_at_ms column holds {type(d).__name__} {str(d)[:60]!r}, not a time"
    elif attempts is None:
        problem = f"its attempts column holds {type(a).__name__} {str(a)[:60]!r}, not a number"
    return PendingKey(
        str(k),
        UNREADABLE_MS if due is None else due,
        attempts or 0,
        problem,
        None if type(d) is int else d,
    )


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
        q = select(T.c.task_key, T.c.due_at_ms, T.c.attempts).where(
            T.c.status == TaskStatus.PENDING.value
        )
        if after != KEYS_START:
            due, key = after
            # The range first (`>=`), then the tie-break: every engine starts the index range at
            # the page (an OR alone left PostgreSQL reading every earlier pending row, a page).
            q = q.where(T.c.due_at_ms >= due, or_(T.c.due_at_ms > due, T.c.task_key > key))
        if upto_ms is not None:
            q = q.where(T.c.due_at_ms <= upto_ms)
        with self._tx() as conn:
            rows = conn.execute(q.order_by(T.c.due_at_ms, T.c.task_key).limit(limit)).all()
        return [_pending_key(k, d, a) for k, d, a in rows]

    @retried_once
    def pending_again(self, keys: Sequence[str]) -> dict[str, PendingKey]:
        """The rows of `keys` that are pending now, as `pending_keys_page` reads them: by key
        through the unique index, three small columns (reconciliation reads a page's rows again
        before re-arming their keys)."""
        if not keys:
            return {}
        q = select(T.c.task_key, T.c.due_at_ms, T.c.attempts).where(
            T.c.task_key.in_(list(keys)), T.c.status == TaskStatus.PENDING.value
        )
        with self._tx() as conn:
            rows = conn.execute(q).all()
        return {p.key: p for p in (_pending_key(k, d, a) for k, d, a in rows)}

    @retried_once
    def upcoming(self, *, after_ms: int, upto_ms: int, limit: int) -> list[tuple[str, int]]:
        """(key, due) of pending rows due in (after_ms, upto_ms], earliest first."""
        return self._due(after_ms, upto_ms, limit)

    @retried_once
    def overdue(self, *, now_ms: int, limit: int) -> list[tuple[str, int]]:
        """(key, due) of pending rows due at or before `now_ms`, earliest first: however early
        (a row due at -9e18 is overdue, not out of sight)."""
        return self._due(None, now_ms, limit)

    def _due(self, after_ms: int | None, upto_ms: int, limit: int) -> list[tuple[str, int]]:
        """(key, due) of pending rows due after `after_ms` (None: however early) and at or
        before `upto_ms`, earliest first."""
        q = select(T.c.task_key, T.c.due_at_ms).where(
            T.c.status == TaskStatus.PENDING.value, T.c.due_at_ms <= upto_ms
        )
        if after_ms is not None:
            q = q.where(T.c.due_at_ms > after_ms)
        with self._tx() as conn:
            rows = conn.execute(q.order_by(T.c.due_at_ms).limit(limit)).all()
        return _due_keys(rows)

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
        """Running rows whose lease has run out: the listener running them is gone. A running
        row with no lease (NULL, or text: written outside keyexpiry, which always sets one)
        is one whose lease ran out: nothing else would ever end it."""
        running = T.c.status == TaskStatus.RUNNING.value
        with self._tx() as conn:
            rows = list(
                conn.execute(
                    select(T)
                    .where(running, T.c.lease_until_ms < now_ms)
                    .order_by(T.c.lease_until_ms)
                    .limit(limit)
                )
            )
            # Apart: each is a range of the (status, lease_until_ms) index, which one OR of
            # the two would not be on every database.
            for lost in (T.c.lease_until_ms.is_(None), _no_number(T.c.lease_until_ms)):
                if len(rows) < limit:
                    rows.extend(
                        conn.execute(select(T).where(running, lost).limit(limit - len(rows)))
                    )
        return [_row(r, self.key_prefix) for r in rows]

    @retried_once
    def unknown_status_rows(self, limit: int = 100) -> list[TaskRow]:
        """Rows whose status is none of `TaskStatus` (written outside keyexpiry): no other
        query ever reads them. Ranges of the status index between the known statuses, which
        hold nothing in a sound ledger."""
        with self._tx() as conn:
            rows = conn.execute(
                select(T).where(unknown_status()).order_by(T.c.id).limit(limit)
            ).all()
        return [_row(r, self.key_prefix) for r in rows]

    @retried_once
    def requeue_lost(
        self,
        row: TaskRow,
        *,
        status: TaskStatus,
        error: str,
        now_ms: int,
        lease_expired: bool = True,
        rearm: list[tuple[str, int]] | None = None,
    ) -> bool:
        """Move a lost run (its lease expired, or `lease_expired=False`: its listener stopped
        beating) to pending (due now) or dead; False if someone else did. A dead occurrence of
        a schedule moves the schedule on in the same transaction, as a dead outcome does: its
        row becomes the next occurrence, whose (key, due) is added to `rearm`."""
        conditions = [
            T.c.id == row.id,
            T.c.status == TaskStatus.RUNNING.value,
            T.c.claimed_by == row.claimed_by,
        ]
        if lease_expired:
            conditions.append(
                or_(
                    T.c.lease_until_ms < now_ms,
                    T.c.lease_until_ms.is_(None),
                    _no_number(T.c.lease_until_ms),
                )
            )
        advancing = status is TaskStatus.DEAD and row.schedule_name is not None
        with self._tx() as conn:
            sched = None
            if advancing:
                # The schedule's row first, as the recorder locks them: no deadlock between us.
                found = conn.execute(
                    select(S).where(S.c.name == row.schedule_name).with_for_update()
                ).first()
                sched = None if found is None else readable_schedule(found)
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
            moved = bool(result.rowcount)
            if moved and sched is not None and sched.task_key == row.key:
                nxt = self._advance_dead(conn, row, sched, error, now_ms)
                if nxt is not None and rearm is not None:
                    rearm.append((row.key, nxt))
        return moved

    def _advance_dead(
        self, conn: Connection, row: TaskRow, sched: ScheduleRow, error: str, now_ms: int
    ) -> int | None:
        """The schedule of `row`, an occurrence just marked dead, moves on: the next
        occurrence (None: ended or paused, the row stays dead)."""
        occurrence = sched.occurrence_ms
        if occurrence is None:
            return None
        nxt = next_after_run(
            sched.recurrence, occurrence, now_ms, sched.anchor_ms, sched.overlap,
            row.started_at_ms,
        )  # fmt: skip
        if nxt is not None and not sched.paused:  # paused: a resume creates it
            conn.execute(
                update(T)
                .where(T.c.id == row.id, T.c.status == TaskStatus.DEAD.value)
                .values(
                    status=TaskStatus.PENDING.value,
                    due_at_ms=nxt,
                    attempts=0,
                    claimed_by=None,
                    last_error=None,
                    updated_at_ms=now_ms,
                )
            )
        conn.execute(
            update(S)
            .where(S.c.name == sched.name)
            .values(
                occurrence_ms=nxt,
                last_scheduled_for_ms=occurrence,
                last_status=TaskStatus.DEAD.value,
                last_finished_ms=now_ms,
                last_error=error,
                updated_at_ms=now_ms,
            )
        )
        return None if sched.paused else nxt


def unknown_status() -> ColumnElement[bool]:
    """A status outside `TaskStatus`, as ranges between the known ones (`NOT IN` would walk
    the whole table on SQLite): on the status index, and empty in a sound ledger."""
    known = sorted(s.value for s in TaskStatus)
    gaps: list[ColumnElement[bool]] = [T.c.status < known[0], T.c.status > known[-1]]
    gaps += [and_(T.c.status > a, T.c.status < b) for a, b in itertools.pairwise(known)]
    return or_(*gaps)


def _due_keys(rows: Any) -> list[tuple[str, int]]:
    """(key, due) of rows whose due time is a number; a row whose due time is text is left to
    reconciliation's walk, which reports it."""
    found: list[tuple[str, int]] = []
    for k, d in rows:
        due = d if type(d) is int else stored_ms(d)
        if due is not None:
            found.append((str(k), due))
    return found
