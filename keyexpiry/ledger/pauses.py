"""The pause table's queries: pause (or pause again), resume, and the pauses in force."""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, or_, select
from sqlalchemy.dialects import mysql, postgresql, sqlite

from keyexpiry.ledger.base import Ledger, retried_once
from keyexpiry.ledger.table import P
from keyexpiry.pausing import Pause


class PauseQueries(Ledger):
    """Reads and writes of `keyexpiry_pause` (`keyexpiry.pausing`): one row per paused target.

    Targets are taken as given: `keyexpiry.pausing.parse_target` checks them where they enter.
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

    @retried_once
    def pauses(self, now_ms: int) -> list[Pause]:
        """The pauses in force at `now_ms` (until NULL or later), sorted by target.

        Listeners call this every second: it reads the whole table (a few rows: one per paused
        target, no index needed) and writes only when it finds a pause that has ended, which
        it deletes then, once."""
        with self._tx() as conn:
            rows = conn.execute(select(P).order_by(P.c.target)).all()
            found = [
                Pause(
                    str(r.target),
                    None if r.until_ms is None else int(r.until_ms),
                    int(r.paused_at_ms),
                    None if r.reason is None else str(r.reason),
                )
                for r in rows
            ]
            ended = [p.target for p in found if not p.active(now_ms)]
            if ended:
                # Guarded by its until: a target paused again meanwhile keeps its new row.
                conn.execute(
                    delete(P).where(
                        P.c.target.in_(ended), P.c.until_ms.is_not(None), P.c.until_ms <= now_ms
                    )
                )
        return [p for p in found if p.active(now_ms)]
