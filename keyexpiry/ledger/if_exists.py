"""Create-or-reschedule under a rule (`create(..., if_exists=...)`): the rules, what a create did
(`Scheduled`), and the ledger side that decides it atomically against a concurrent claim.

| rule | no row | pending row | running / done / dead / cancelled row |
|---|---|---|---|
| `replace` (default: debounce) | created | replaced | replaced |
| `keep` (throttle) | created | kept | replaced |
| `earlier` | created | moved if the new time is earlier, else kept | replaced |
| `later` | created | moved if the new time is later, else kept | replaced |

"replaced" and "moved" both make the row a fresh pending task at the new due time (as a create
always did); "kept" leaves it untouched and sets no key. A row that is not pending has no pending
run to keep: every rule schedules a new one (a running run still ends, unrecorded).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from enum import StrEnum
from typing import Any, Literal, cast

from sqlalchemy import Connection, Select, bindparam, insert, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from keyexpiry.errors import ArgumentError, StoreError
from keyexpiry.ledger.base import Ledger, retried_once

# The claim's list helpers: IN lists of a few fixed sizes, each compiled once.
from keyexpiry.ledger.batches import KEY_PARAMS, padded_lists
from keyexpiry.ledger.rows import NewTask, TaskStatus, args_json, schedule_json
from keyexpiry.ledger.table import T


class IfExists(StrEnum):
    """What `create` does when the task's key already has a row."""

    REPLACE = "replace"
    KEEP = "keep"
    EARLIER = "earlier"
    LATER = "later"

    @classmethod
    def of(cls, value: object) -> IfExists:
        """The rule `value` names; ArgumentError for anything else."""
        try:
            # A dict, not `cls(value)`: an Enum call costs a bulk create a microsecond a task.
            return _RULES[value]
        except (KeyError, TypeError):
            allowed = ", ".join(repr(r.value) for r in cls)
            raise ArgumentError(f"if_exists must be one of {allowed}, got {value!r}") from None


_RULES: dict[object, IfExists] = {rule.value: rule for rule in IfExists}


Rule = IfExists | Literal["replace", "keep", "earlier", "later"]
"""`if_exists` as callers write it."""


class Did(StrEnum):
    """What one create did to its task."""

    CREATED = "created"
    """No row existed: a new pending task."""
    REPLACED = "replaced"
    """A row existed and is now a fresh pending task at the new due time."""
    MOVED = "moved"
    """A pending task's due time moved (earlier or later, as the rule allowed)."""
    KEPT = "kept"
    """A pending task kept its due time; nothing was written, no key was set."""


class Scheduled(str):
    """A task key (a `str`, so callers that use the key keep working) that also says what the
    create did: `outcome` and the task's `due_at_ms` afterwards (the kept one, when kept).

    A `str` subclass rather than a new return type: `create` returned the key, and code compares
    it, stores it and passes it back to `cancel_keys` or `get`.
    """

    outcome: Did
    due_at_ms: int

    def __new__(cls, key: str, outcome: Did, due_at_ms: int) -> Scheduled:
        self = str.__new__(cls, key)
        self.outcome = outcome
        self.due_at_ms = due_at_ms
        return self

    def __reduce__(self) -> tuple[type[Scheduled], tuple[str, Did, int]]:
        return (Scheduled, (str(self), self.outcome, self.due_at_ms))

    @property
    def changed(self) -> bool:
        """Whether the task now runs at the due time asked for (created, replaced or moved)."""
        return self.outcome is not Did.KEPT


Prior = tuple[str, int]
"""An existing row as a rule sees it: (status, due_at_ms)."""


def decide(rule: IfExists, prior: Prior | None, due_at_ms: int) -> Did:
    """What `rule` does to a row in state `prior` (None: no row) for a create due `due_at_ms`."""
    if prior is None:
        return Did.CREATED
    status, old_due = prior
    if status != TaskStatus.PENDING.value or rule is IfExists.REPLACE:
        return Did.REPLACED
    if rule is IfExists.EARLIER and due_at_ms < old_due:
        return Did.MOVED
    if rule is IfExists.LATER and due_at_ms > old_due:
        return Did.MOVED
    return Did.KEPT


class ScheduleQueries(Ledger):
    """Creates decided against the row's state read under its lock (`decide`)."""

    @retried_once
    def schedule(
        self, tasks: Sequence[NewTask], rules: Sequence[IfExists], now_ms: int
    ) -> list[tuple[Did, int]]:
        """Create `tasks` under `rules` (one each) in one transaction: the rows that exist are
        read with their write lock held (SELECT … FOR UPDATE; on SQLite the database's write lock
        from the start), so no claim or other create changes them between the decision and the
        write. Returns (what was done, due time afterwards) for each task, in order."""
        for _ in range(3):
            try:
                with self._tx() as conn:
                    if conn.dialect.name == "sqlite":
                        # pysqlite begins lazily, at the first write: take the write lock first.
                        conn.exec_driver_sql("BEGIN IMMEDIATE")
                    return self._schedule_on(conn, tasks, rules, now_ms)
            except _Raced:
                continue  # rolled back; the row is there now, and the next read locks it
        raise StoreError("a task's key kept being created concurrently")

    def schedule_in(
        self, conn: Connection, tasks: Sequence[NewTask], rules: Sequence[IfExists], now_ms: int
    ) -> list[tuple[Did, int]]:
        """`schedule` on the caller's connection, in its transaction."""
        for _ in range(3):
            try:
                with self._wrapped():
                    return self._schedule_on(conn, tasks, rules, now_ms, nested=self.postgres)
            except _Raced:
                # MySQL and SQLite undo only the failed INSERT (on PostgreSQL, whose failed
                # statement aborts the whole transaction, its savepoint is rolled back): read
                # again, the row is there now.
                continue
        raise StoreError("a task's key kept being created concurrently")

    @contextmanager
    def _wrapped(self) -> Iterator[None]:
        try:
            yield
        except SQLAlchemyError as exc:
            raise self._store_error(exc) from exc

    def _schedule_on(
        self,
        conn: Connection,
        tasks: Sequence[NewTask],
        rules: Sequence[IfExists],
        now_ms: int,
        *,
        nested: bool = False,
    ) -> list[tuple[Did, int]]:
        prior = self._locked_rows(conn, [t.key for t in tasks])
        result: list[tuple[Did, int]] = []
        fresh: list[NewTask] = []
        reset: list[NewTask] = []
        for task, rule in zip(tasks, rules, strict=True):
            did = decide(rule, prior.get(task.key), task.due_at_ms)
            if did is Did.KEPT:
                result.append((did, prior[task.key][1]))
                continue
            result.append((did, task.due_at_ms))
            # Replace writes whatever is there by then: the upsert, one statement for all.
            (fresh if did is Did.CREATED and rule is not IfExists.REPLACE else reset).append(task)
        if fresh:
            # A plain INSERT: a row created since the read fails it (and the read is redone),
            # where an upsert would overwrite a task the rule may have had to keep.
            rows = [self._bound_row(t, now_ms) for t in fresh]
            try:
                if nested:
                    with conn.begin_nested():
                        conn.execute(insert(T), rows)
                else:
                    conn.execute(insert(T), rows)
            except IntegrityError:
                raise _Raced() from None
        if reset:
            # Rows locked above: the plain upsert resets them, as a create always did.
            conn.execute(self._upsert, [self._bound_row(t, now_ms) for t in reset])
        return result

    def _locked_rows(self, conn: Connection, keys: Sequence[str]) -> dict[str, Prior]:
        """(status, due) of the rows of `keys` that exist, locked until the transaction ends."""
        lock = conn.dialect.name != "sqlite"
        own = conn.engine is self.engine
        found: dict[str, Prior] = {}
        for part in padded_lists(keys):
            values = dict(zip(KEY_PARAMS, part, strict=False))
            if own:
                # Compiled once per list size: a single create pays no statement building.
                result = self._prepare(_prior_rows, len(part), lock).run(conn, values)
            else:
                result = conn.execute(_prior_rows(len(part), lock), values)
            for key, status, due in cast(Iterable[tuple[Any, Any, Any]], result):
                found[str(key)] = (str(status), int(due))
        return found

    @staticmethod
    def _bound_row(t: NewTask, now_ms: int) -> dict[str, object]:
        return {
            "task_key": t.key,
            "class_name": t.class_name,
            "method": t.method,
            "args": args_json(t.args),
            "status": TaskStatus.PENDING.value,
            "attempts": 0,
            "retry_schedule_s": schedule_json(t.retry_schedule_s),
            "due_at_ms": t.due_at_ms,
            "created_at_ms": now_ms,
            "updated_at_ms": now_ms,
            "started_at_ms": None,
            "finished_at_ms": None,
            "claimed_by": None,
            "lease_until_ms": None,
            "last_error": None,
            "tag": t.tag,
            "result": None,
            "payload": t.payload,
            "traceparent": t.traceparent,
        }


def _prior_rows(size: int, lock: bool) -> Select[str, str, int]:
    q = select(T.c.task_key, T.c.status, T.c.due_at_ms).where(
        T.c.task_key.in_([bindparam(name) for name in KEY_PARAMS[:size]])
    )
    return q.with_for_update() if lock else q


class _Raced(Exception):
    """A key absent at the read was inserted by someone else before this create's INSERT."""
