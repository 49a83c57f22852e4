"""The schedule table's queries (`keyexpiry.schedules`): declare (create, change, keep), read,
pause, resume, remove, run now, and find schedules whose occurrence row went missing.

Each schedule has one row in time_limit_task at a time: its next occurrence, an ordinary task
(key `Class@method@args`) marked with the schedule's name. Its outcome moves the schedule on in
the same transaction (`ClaimQueries.record`), so no other process decides what comes next.

Long because a schedule row's declare, pause, resume, remove, run-now and malformed-row checks all
work under the same row lock rules; split, each would re-state them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, delete, insert, select, update

from keyexpiry import limits
from keyexpiry.errors import KeyExpiryError, StoreError
from keyexpiry.keys import shorten
from keyexpiry.ledger.base import Ledger, retried_once
from keyexpiry.ledger.rows import MalformedRows, TaskStatus, args_json, schedule_json
from keyexpiry.ledger.table import S, T
from keyexpiry.schedules.recurrence import MAX_TIME_MS, MIN_TIME_MS, Recurrence
from keyexpiry.schedules.rules import Cadence


@dataclass(frozen=True, slots=True)
class ScheduleRow:
    """A schedule as stored: its definition, its current occurrence, its last run."""

    name: str
    task_key: str
    class_name: str
    method: str
    args: tuple[str, ...]
    recurrence: Recurrence
    anchor_ms: int
    catch_up: str
    catch_up_max: int
    overlap: str
    retry_schedule_s: tuple[float, ...] | None
    source: str
    paused: bool = False
    occurrence_ms: int | None = None
    """The occurrence its task row stands for; None once the schedule has ended."""
    last_scheduled_for_ms: int | None = None
    last_status: str | None = None
    last_finished_ms: int | None = None
    last_success_ms: int | None = None
    last_error: str | None = None
    created_at_ms: int = 0
    updated_at_ms: int = 0

    def definition(self) -> tuple[object, ...]:
        """What a re-declaration compares: a change replaces the pending occurrence."""
        return (
            self.task_key, self.recurrence, self.catch_up, self.catch_up_max, self.overlap,
            self.retry_schedule_s,
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """For `keyexpiry schedules --json` and the dashboard: times as epoch seconds, as in
        `list --json`."""
        rec = self.recurrence

        def sec(ms: int | None) -> float | None:
            return None if ms is None else ms / 1000.0

        return {
            "name": self.name,
            "task": f"{self.class_name}.{self.method}",
            "args": list(self.args),
            "cron": rec.cron,
            "every_s": rec.every_s,
            "tz": rec.tz,
            "start_at": sec(rec.start_ms),
            "end_at": sec(rec.end_ms),
            "catch_up": self.catch_up,
            "overlap": self.overlap,
            "paused": self.paused,
            "next_at": sec(self.occurrence_ms),
            "last_scheduled_for": sec(self.last_scheduled_for_ms),
            "last_status": self.last_status,
            "last_finished_at": sec(self.last_finished_ms),
            "last_success_at": sec(self.last_success_ms),
            "last_error": self.last_error,
            "source": self.source,
        }


MALFORMED_SCHEDULES = MalformedRows()
"""Schedule rows keyexpiry would not have written, met by this process: each said once (the
listener's metrics count them with the task table's)."""


def readable_schedule(r: Any) -> ScheduleRow | None:
    """`schedule_row(r)`, or None for a row keyexpiry would never have written (edited by
    hand: a zone or expression it does not know, arguments that are no JSON list, a time out of
    range): said once per schedule and problem, counted, and treated as no schedule (its
    occurrence runs as a plain task)."""
    try:
        return _parsed(r)
    except (KeyExpiryError, ValueError, TypeError, OverflowError, OSError) as exc:
        _report_malformed(r, exc)
        return None


def _report_malformed(r: Any, exc: Exception) -> str:
    name = str(getattr(r, "name", "?"))
    problem = f"schedule {shorten(repr(name), 100)}: {shorten(str(exc), 300)}"
    MALFORMED_SCHEDULES.report(f"schedule:{name}", problem, "schedule ignored")
    return problem


def schedule_row(r: Any) -> ScheduleRow:
    """A ScheduleRow from a result row of `keyexpiry_schedule`; StoreError, in one line, for
    a row keyexpiry would never have written."""
    try:
        return _parsed(r)
    except (KeyExpiryError, ValueError, TypeError, OverflowError, OSError) as exc:
        raise StoreError(
            f"schedule {shorten(repr(str(r.name)), 100)}: malformed row ({shorten(str(exc), 300)})"
        ) from None


def _parsed(r: Any) -> ScheduleRow:
    every_ms = r.every_ms
    schedule = limits.json_loads(r.retry_schedule_s) if r.retry_schedule_s else None
    recurrence = Recurrence(
        cron=r.cron,
        every_s=None if every_ms is None else _whole(every_ms, "every_ms") / 1000,
        tz=r.tz,
        start_ms=_optional_ms(r.start_ms, "start_ms"),
        end_ms=_optional_ms(r.end_ms, "end_ms"),
    )
    # The policies as a declaration checks them: a hand-edited `catch_up_max` of 10**9 is
    # refused here, not walked.
    cad = Cadence(recurrence, r.catch_up, _whole(r.catch_up_max, "catch_up_max"), r.overlap)
    return ScheduleRow(
        name=str(r.name),
        task_key=str(r.task_key),
        class_name=str(r.class_name),
        method=str(r.method),
        args=_strings(limits.json_loads(r.args)),
        recurrence=recurrence,
        anchor_ms=_time_ms(r.anchor_ms, "anchor_ms"),
        catch_up=cad.catch_up,
        catch_up_max=cad.catch_up_max,
        overlap=cad.overlap,
        retry_schedule_s=limits.delays(schedule, "retry_schedule_s", StoreError),
        source=str(r.source),
        paused=bool(r.paused),
        occurrence_ms=_optional_ms(r.occurrence_ms, "occurrence_ms"),
        last_scheduled_for_ms=_optional_ms(r.last_scheduled_for_ms, "last_scheduled_for_ms"),
        last_status=None if r.last_status is None else str(r.last_status),
        last_finished_ms=_optional_ms(r.last_finished_ms, "last_finished_ms"),
        last_success_ms=_optional_ms(r.last_success_ms, "last_success_ms"),
        last_error=None if r.last_error is None else str(r.last_error),
        created_at_ms=_whole(r.created_at_ms, "created_at_ms"),
        updated_at_ms=_whole(r.updated_at_ms, "updated_at_ms"),
    )


def _whole(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field} {shorten(repr(value), 40)} is no whole number")
    return value


def _time_ms(value: object, field: str) -> int:
    ms = _whole(value, field)
    if not MIN_TIME_MS <= ms <= MAX_TIME_MS:
        raise ValueError(f"{field} {ms} is out of range (1970 to 9000)")
    return ms


def _optional_ms(value: object, field: str) -> int | None:
    return None if value is None else _time_ms(value, field)


def _strings(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"args {value!r} is no list of strings")
    return tuple(value)


def _definition_values(s: ScheduleRow) -> dict[str, Any]:
    rec = s.recurrence
    return {
        "task_key": s.task_key,
        "class_name": s.class_name,
        "method": s.method,
        "args": args_json(s.args),
        "cron": rec.cron,
        "every_ms": None if rec.every_s is None else round(rec.every_s * 1000),
        "tz": rec.tz,
        "start_ms": rec.start_ms,
        "end_ms": rec.end_ms,
        "catch_up": s.catch_up,
        "catch_up_max": s.catch_up_max,
        "overlap": s.overlap,
        "retry_schedule_s": schedule_json(s.retry_schedule_s),
        "source": s.source,
    }


@dataclass(frozen=True, slots=True)
class Declared:
    """What a declaration did: `created`, `replaced` (its definition changed: the pending
    occurrence moved) or `kept`; and the occurrence whose key to arm (None: nothing new)."""

    did: str
    arm: tuple[str, int] | None
    schedule: ScheduleRow


class RecurringQueries(Ledger):
    """Reads and writes of `keyexpiry_schedule` and of its occurrence rows."""

    @retried_once
    def declare_schedule(self, wanted: ScheduleRow, now_ms: int) -> Declared:
        """Create schedule `wanted` with its first occurrence (the first after `now_ms`), or
        bring an existing one of that name to `wanted`'s definition: unchanged, kept as it is
        (occurrence, last run, pause); changed, its pending occurrence replaced by the first
        after `now_ms` by the new one (an interval still counts from its first declaration).
        One transaction, the schedule's row locked: listeners declaring the same schedule at
        once all end with one schedule and one occurrence."""
        with self._tx() as conn:
            found = conn.execute(select(S).where(S.c.name == wanted.name).with_for_update()).first()
            if found is None:
                first_ms = wanted.recurrence.after(now_ms, wanted.anchor_ms)
                conn.execute(
                    insert(S).values(
                        name=wanted.name,
                        anchor_ms=wanted.anchor_ms,
                        paused=0,
                        occurrence_ms=first_ms,
                        created_at_ms=now_ms,
                        updated_at_ms=now_ms,
                        **_definition_values(wanted),
                    )
                )
                stored = self._get(conn, wanted.name)
                arm = None
                if first_ms is not None:
                    arm = self._put_occurrence(conn, stored, first_ms, now_ms)
                return Declared("created", arm, stored)
            current = readable_schedule(found)
            if current is None:
                # Malformed (edited by hand): declared anew over it.
                self._cancel_occurrence_of(conn, wanted.name, str(found.task_key), now_ms)
                first_ms = wanted.recurrence.after(now_ms, wanted.anchor_ms)
                conn.execute(
                    update(S)
                    .where(S.c.name == wanted.name)
                    .values(
                        anchor_ms=wanted.anchor_ms,
                        paused=0,
                        occurrence_ms=first_ms,
                        last_scheduled_for_ms=None,
                        last_status=None,
                        last_finished_ms=None,
                        last_success_ms=None,
                        last_error=None,
                        created_at_ms=now_ms,
                        updated_at_ms=now_ms,
                        **_definition_values(wanted),
                    )
                )
                stored = self._get(conn, wanted.name)
                arm = (
                    None
                    if first_ms is None
                    else self._put_occurrence(conn, stored, first_ms, now_ms)
                )
                return Declared("replaced", arm, stored)
            if current.definition() == wanted.definition():
                return Declared("kept", None, current)
            first_ms = wanted.recurrence.after(now_ms, current.anchor_ms)
            conn.execute(
                update(S)
                .where(S.c.name == wanted.name)
                .values(occurrence_ms=first_ms, updated_at_ms=now_ms, **_definition_values(wanted))
            )
            if current.task_key != wanted.task_key or first_ms is None:
                # Another task, or a definition already ended: the old occurrence goes.
                self._cancel_occurrence(conn, current, now_ms)
            stored = self._get(conn, wanted.name)
            arm = None
            if first_ms is not None and not stored.paused:
                arm = self._put_occurrence(conn, stored, first_ms, now_ms)
            return Declared("replaced", arm, stored)

    @retried_once
    def get_schedule(self, name: str) -> ScheduleRow | None:
        """The schedule named `name`, or None."""
        with self._tx() as conn:
            found = conn.execute(select(S).where(S.c.name == name)).first()
        return None if found is None else readable_schedule(found)

    def list_schedules(self) -> list[ScheduleRow]:
        """Every schedule, by name (malformed rows left out: `schedules_and_problems`)."""
        return self.schedules_and_problems()[0]

    @retried_once
    def schedules_and_problems(self) -> tuple[list[ScheduleRow], list[str]]:
        """Every sound schedule, by name, and what is wrong with each malformed row (one line
        each, for a listing to show): a bad row is no reason to show none."""
        with self._tx() as conn:
            rows = conn.execute(select(S).order_by(S.c.name)).all()
        sound: list[ScheduleRow] = []
        problems: list[str] = []
        for r in rows:
            try:
                sound.append(_parsed(r))
            except (KeyExpiryError, ValueError, TypeError, OverflowError, OSError) as exc:
                problems.append(_report_malformed(r, exc))
        return sound, problems

    @retried_once
    def remove_schedule(self, name: str, now_ms: int) -> str | None:
        """Delete schedule `name` and cancel its pending occurrence (a running one finishes as
        a plain task); returns the occurrence's key to delete from Redis, None when there was
        no such schedule."""
        with self._tx() as conn:
            found = conn.execute(select(S).where(S.c.name == name).with_for_update()).first()
            if found is None:
                return None
            # Read raw: a malformed row can still be removed.
            self._cancel_occurrence_of(conn, name, str(found.task_key), now_ms)
            conn.execute(delete(S).where(S.c.name == name))
            return str(found.task_key)

    @retried_once
    def pause_schedule(
        self, name: str, paused: bool, now_ms: int
    ) -> tuple[bool, tuple[str, int] | None]:
        """Pause (its pending occurrence cancelled; the occurrence it stood for kept, so a resume
        catches up by its policy) or resume (that occurrence created again) schedule `name`.
        Returns whether it exists, and on a resume the occurrence's key and due time to arm."""
        with self._tx() as conn:
            found = conn.execute(select(S).where(S.c.name == name).with_for_update()).first()
            if found is None:
                return False, None
            current = schedule_row(found)
            if current.paused == paused:
                return True, None
            conn.execute(
                update(S).where(S.c.name == name).values(paused=int(paused), updated_at_ms=now_ms)
            )
            if paused:
                self._cancel_occurrence(conn, current, now_ms)
                return True, None
            if current.occurrence_ms is None:
                return True, None
            return True, self._put_occurrence(conn, current, current.occurrence_ms, now_ms)

    @retried_once
    def run_schedule_now(self, name: str, now_ms: int) -> tuple[bool, str | None]:
        """Make schedule `name`'s pending occurrence due now (it runs as an extra occurrence;
        the regular one after it still comes). Returns whether the schedule exists, and the
        key to arm (None: its occurrence is running, or the schedule ended or is paused)."""
        with self._tx() as conn:
            found = conn.execute(select(S).where(S.c.name == name)).first()
            if found is None:
                return False, None
            current = schedule_row(found)
            if current.paused or current.occurrence_ms is None:
                return True, None
            moved = conn.execute(
                update(T)
                .where(
                    T.c.task_key == current.task_key,
                    T.c.schedule_name == name,
                    T.c.status == TaskStatus.PENDING.value,
                )
                .values(due_at_ms=now_ms, updated_at_ms=now_ms)
            ).rowcount
            return True, current.task_key if moved else None

    @retried_once
    def schedules_without_occurrence(self) -> list[ScheduleRow]:
        """Schedules that should have a pending or running occurrence row and have none (its
        row cancelled or deleted by hand, pruned, or a declaration cut short): the listener's
        check puts it back (`restore_occurrence`)."""
        with self._tx() as conn:
            rows = conn.execute(
                select(S)
                .outerjoin(T, T.c.task_key == S.c.task_key)
                .where(
                    S.c.paused == 0,
                    S.c.occurrence_ms.is_not(None),
                    (T.c.id.is_(None))
                    | (T.c.schedule_name.is_(None))
                    | (T.c.schedule_name != S.c.name)
                    | T.c.status.not_in([TaskStatus.PENDING.value, TaskStatus.RUNNING.value]),
                )
            ).all()
        return [s for s in map(readable_schedule, rows) if s is not None]

    @retried_once
    def restore_occurrence(self, name: str, now_ms: int) -> tuple[str, int] | None:
        """Put schedule `name`'s occurrence row back (see `schedules_without_occurrence`), under
        the schedule's lock: the key to arm, or None when nothing was missing after all."""
        with self._tx() as conn:
            found = conn.execute(select(S).where(S.c.name == name).with_for_update()).first()
            if found is None:
                return None
            current = schedule_row(found)
            if current.paused or current.occurrence_ms is None:
                return None
            return self._put_occurrence(conn, current, current.occurrence_ms, now_ms)

    # --- inside one transaction -------------------------------------------------------------
    def _get(self, conn: Connection, name: str) -> ScheduleRow:
        return schedule_row(conn.execute(select(S).where(S.c.name == name)).one())

    def _put_occurrence(
        self, conn: Connection, s: ScheduleRow, due_ms: int, now_ms: int
    ) -> tuple[str, int] | None:
        """Make the row of `s`'s task its occurrence due at `due_ms`; the key to arm, or None
        when the row is running (its end moves the schedule on) or already pending for it."""
        row = conn.execute(
            select(T.c.id, T.c.status, T.c.due_at_ms, T.c.schedule_name)
            .where(T.c.task_key == s.task_key)
            .with_for_update()
        ).first()
        if row is None:
            conn.execute(
                insert(T).values(
                    task_key=s.task_key,
                    class_name=s.class_name,
                    method=s.method,
                    args=args_json(s.args),
                    status=TaskStatus.PENDING.value,
                    attempts=0,
                    retry_schedule_s=schedule_json(s.retry_schedule_s),
                    due_at_ms=due_ms,
                    created_at_ms=now_ms,
                    updated_at_ms=now_ms,
                    schedule_name=s.name,
                )
            )
            return s.task_key, due_ms
        if row.status == TaskStatus.RUNNING.value:
            conn.execute(update(T).where(T.c.id == row.id).values(schedule_name=s.name))
            return None
        if (
            row.status == TaskStatus.PENDING.value
            and row.schedule_name == s.name
            and row.due_at_ms == due_ms
        ):
            return s.task_key, due_ms  # as it should be; its key armed again does no harm
        conn.execute(
            update(T)
            .where(T.c.id == row.id)
            .values(
                status=TaskStatus.PENDING.value,
                attempts=0,
                due_at_ms=due_ms,
                retry_schedule_s=schedule_json(s.retry_schedule_s),
                started_at_ms=None,
                finished_at_ms=None,
                claimed_by=None,
                lease_until_ms=None,
                last_error=None,
                result=None,
                updated_at_ms=now_ms,
                schedule_name=s.name,
            )
        )
        return s.task_key, due_ms

    def _cancel_occurrence(self, conn: Connection, s: ScheduleRow, now_ms: int) -> None:
        """Cancel `s`'s pending occurrence; a running one is left to finish as a plain task."""
        self._cancel_occurrence_of(conn, s.name, s.task_key, now_ms)

    def _cancel_occurrence_of(self, conn: Connection, name: str, key: str, now_ms: int) -> None:
        conn.execute(
            update(T)
            .where(
                T.c.task_key == key,
                T.c.schedule_name == name,
                T.c.status == TaskStatus.PENDING.value,
            )
            .values(
                status=TaskStatus.CANCELLED.value,
                finished_at_ms=now_ms,
                updated_at_ms=now_ms,
            )
        )
        # Unlinked, but a running one: its retry (or its end) must still see its schedule, so
        # that a pause moves the schedule on instead of running this occurrence again later.
        conn.execute(
            update(T)
            .where(
                T.c.task_key == key,
                T.c.schedule_name == name,
                T.c.status != TaskStatus.RUNNING.value,
            )
            .values(schedule_name=None)
        )
