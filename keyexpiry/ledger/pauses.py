"""The pause table's queries: pause (or pause again), resume, and the pauses in force; and the
one function that reads a pause row, whatever was written into it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, or_, select
from sqlalchemy.dialects import mysql, postgresql, sqlite

from keyexpiry.errors import ArgumentError
from keyexpiry.flow.pauses import Pause, parse_target
from keyexpiry.keys import clip
from keyexpiry.ledger.base import Ledger, retried_once
from keyexpiry.ledger.reading import _as_text, _shown, stored_ms
from keyexpiry.ledger.table import P


@dataclass(frozen=True, slots=True)
class MalformedPause:
    """A `keyexpiry_pause` row keyexpiry would never have written (a hand edit, another
    program): it pauses nothing, and whoever reads it reports it."""

    target: str
    """Its target column as text (escape it before printing: it may hold anything)."""
    problem: str
    """What in it keyexpiry would not have written, in one line."""


@dataclass(frozen=True, slots=True)
class PausesRead:
    """The pause table as read at one time: the pauses in force, and the rows skipped."""

    pauses: list[Pause]
    """In force, sorted by target."""
    malformed: list[MalformedPause]
    """Rows that are no pause (`pause_from_db`), in target order."""


def pause_from_db(r: Any) -> Pause | MalformedPause:
    """A `Pause` from a row of `keyexpiry_pause`, or a `MalformedPause` saying what keyexpiry
    would never have written in it: a target that is no `Class` or `Class.method`, a time
    that is no whole number in BIGINT's range (SQLite keeps text, blobs and infinite reals),
    NULL where the table says NOT NULL (a table made by hand), a reason that is no text."""
    target, until, paused_at, reason = r.target, r.until_ms, r.paused_at_ms, r.reason
    problems: list[str] = []
    if type(target) is not str:
        problems.append(f"its target column holds {_shown(target)}, not text")
    elif not _is_target(target):
        problems.append(f"its target {clip(target, 60)} is no 'Class' or 'Class.method'")
    until_ms = None if until is None else stored_ms(until)
    if until is not None and until_ms is None:
        problems.append(f"its until_ms column holds {_shown(until)}, not a number")
    paused_at_ms = stored_ms(paused_at)
    if paused_at_ms is None:
        problems.append(f"its paused_at_ms column holds {_shown(paused_at)}, not a number")
    if reason is not None and type(reason) is not str:
        problems.append(f"its reason column holds {_shown(reason)}, not text")
    if problems or paused_at_ms is None:
        return MalformedPause(_as_text(target), "; ".join(problems))
    return Pause(target, until_ms, paused_at_ms, reason)


def _is_target(text: str) -> bool:
    try:
        return parse_target(text) == text  # surrounding blanks too: they would match nothing
    except ArgumentError:
        return False


class PauseQueries(Ledger):
    """Reads and writes of `keyexpiry_pause` (`keyexpiry.flow.pauses`): one row per paused target.

    Targets are taken as given: `keyexpiry.flow.pauses.parse_target` checks them where they enter.
    """

    @retried_once
    def pause(
        self, target: str, *, until_ms: int | None, now_ms: int, reason: str | None = None
    ) -> None:
        """Pause `target` ("Class" or "Class.method") until `until_ms` (None: until resumed),
        as of `now_ms`; pausing it again replaces its until, reason and time. One statement,
        an upsert: two operators pausing the same target at once both succeed, the later wins."""
        values = {"target": target, "until_ms": until_ms, "paused_at_ms": now_ms, "reason": reason}
        changed = {k: v for k, v in values.items() if k != "target"}
        dialect = self.engine.dialect.name
        statement: Any
        if dialect in ("sqlite", "postgresql"):
            ins: Any = sqlite.insert(P) if dialect == "sqlite" else postgresql.insert(P)
            statement = ins.values(**values).on_conflict_do_update(
                index_elements=[P.c.target], set_=changed
            )
        else:
            statement = mysql.insert(P).values(**values).on_duplicate_key_update(**changed)
        with self._tx() as conn:
            conn.execute(statement)

    @retried_once
    def resume(self, target: str, *, now_ms: int | None = None) -> bool:
        """End the pause of `target` (its row deleted); True when there was one. With `now_ms`,
        a pause whose until had passed counts as none (its row is deleted all the same).

        Resuming "Class" leaves the pauses of its methods ("Class.method") as they are."""
        with self._tx() as conn:
            if now_ms is None:
                return bool(conn.execute(delete(P).where(P.c.target == target)).rowcount)
            active = or_(P.c.until_ms.is_(None), P.c.until_ms > now_ms)
            held = conn.execute(delete(P).where(P.c.target == target, active)).rowcount
            conn.execute(delete(P).where(P.c.target == target))
            return bool(held)

    def pauses(self, now_ms: int) -> list[Pause]:
        """The pauses in force at `now_ms` (until NULL or later), sorted by target; malformed
        rows left out (`read_pauses` says which)."""
        return self.read_pauses(now_ms).pauses

    @retried_once
    def read_pauses(self, now_ms: int) -> PausesRead:
        """The pauses in force at `now_ms` (until NULL or later), sorted by target, and the
        malformed rows skipped (`pause_from_db`): one bad row never hides the others.

        Listeners call this every second: it reads the whole table (a few rows: one per paused
        target, no index needed) and writes only when it finds a pause that has ended, which
        it deletes then, once. A malformed row is left as it is (for whoever reads it to see)."""
        with self._tx() as conn:
            rows = conn.execute(select(P).order_by(P.c.target)).all()
            read = [pause_from_db(r) for r in rows]
            found = [p for p in read if isinstance(p, Pause)]
            malformed = [p for p in read if isinstance(p, MalformedPause)]
            ended = [p.target for p in found if not p.active(now_ms)]
            if ended:
                # Guarded by its until: a target paused again meanwhile keeps its new row.
                conn.execute(
                    delete(P).where(
                        P.c.target.in_(ended), P.c.until_ms.is_not(None), P.c.until_ms <= now_ms
                    )
                )
        return PausesRead([p for p in found if p.active(now_ms)], malformed)
