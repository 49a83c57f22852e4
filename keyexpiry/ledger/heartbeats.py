"""The listener table's queries: heartbeats, who is silent, and the runs a silent one left."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import delete, func, insert, select, update

from keyexpiry.ledger.base import Ledger, like_prefix, retried_once
from keyexpiry.ledger.reading import row_from_db as _row
from keyexpiry.ledger.rows import TaskRow, TaskStatus
from keyexpiry.ledger.table import L, T


@dataclass(frozen=True, slots=True)
class ListenerRow:
    """One listener as its last heartbeat described it (times in epoch ms, Redis's clock)."""

    id: str
    host: str
    pid: int
    started_at_ms: int
    heartbeat_at_ms: int
    running: int
    classes: frozenset[str] | None = None
    """The task classes it registers (None: a listener of a keyexpiry without partitioning; empty:
    it hears nothing from Redis now, and its peers share its keys)."""
    stopping_at_ms: int | None = None
    """When it began a graceful stop (its peers then take its share of the keys)."""


def _classes_column(classes: frozenset[str] | None) -> str | None:
    return None if classes is None else ",".join(sorted(classes))


def _classes_of(value: object) -> frozenset[str] | None:
    return None if value is None else frozenset(c for c in str(value).split(",") if c)


class HeartbeatQueries(Ledger):
    """Reads and writes of `keyexpiry_listener`, and the runs of a listener by its id."""

    @retried_once
    def beat(self, row: ListenerRow) -> None:
        """Write this listener's heartbeat (its row is recreated if a peer took it over)."""
        values = {
            "heartbeat_at_ms": row.heartbeat_at_ms,
            "running": row.running,
            "host": row.host,
            "pid": row.pid,
            "started_at_ms": row.started_at_ms,
            "classes": _classes_column(row.classes),
        }
        with self._tx() as conn:
            updated = conn.execute(update(L).where(L.c.id == row.id).values(**values)).rowcount
            if not updated:
                conn.execute(insert(L).values(id=row.id, **values))

    @retried_once
    def listeners(self) -> list[ListenerRow]:
        """Every listener row, most recent heartbeat first."""
        with self._tx() as conn:
            rows = conn.execute(select(L).order_by(L.c.heartbeat_at_ms.desc(), L.c.id)).all()
        return [
            ListenerRow(
                str(r.id),
                str(r.host),
                int(r.pid),
                int(r.started_at_ms),
                int(r.heartbeat_at_ms),
                int(r.running),
                _classes_of(r.classes),
                None if r.stopping_at_ms is None else int(r.stopping_at_ms),
            )
            for r in rows
        ]

    @retried_once
    def live_members(self, since_ms: int) -> dict[str, frozenset[str] | None]:
        """Listeners that beat at or after `since_ms` and are not stopping, with their classes
        (who shares the keys: `keyexpiry.listener.partition`)."""
        with self._tx() as conn:
            rows = conn.execute(
                select(L.c.id, L.c.classes).where(
                    L.c.heartbeat_at_ms >= since_ms, L.c.stopping_at_ms.is_(None)
                )
            ).all()
        return {str(r.id): _classes_of(r.classes) for r in rows}

    @retried_once
    def pending_by_class(self, classes: frozenset[str], limit: int = 20) -> dict[str, int]:
        """Pending tasks of classes not in `classes` (none of the live listeners registers
        them: they wait), counted by class, the `limit` largest classes."""
        with self._tx() as conn:
            query = select(T.c.class_name, func.count()).where(
                T.c.status == TaskStatus.PENDING.value
            )
            if classes:
                query = query.where(T.c.class_name.not_in(sorted(classes)))
            rows = conn.execute(
                query.group_by(T.c.class_name).order_by(func.count().desc()).limit(limit)
            ).all()
        return {str(name): int(n) for name, n in rows}

    @retried_once
    def mark_stopping(self, listener_id: str, at_ms: int) -> None:
        """Record that a listener began a graceful stop: peers take its keys at their next beat
        (it keeps beating, so its running tasks stay its own)."""
        with self._tx() as conn:
            conn.execute(update(L).where(L.c.id == listener_id).values(stopping_at_ms=at_ms))

    @retried_once
    def count_live(self, since_ms: int) -> int:
        """Listeners whose last heartbeat is at or after `since_ms`."""
        with self._tx() as conn:
            q = select(func.count()).where(L.c.heartbeat_at_ms >= since_ms)
            return int(conn.execute(q).scalar_one())

    @retried_once
    def silent(self, before_ms: int) -> list[str]:
        """Ids of listeners whose last heartbeat is older than `before_ms`."""
        with self._tx() as conn:
            rows = conn.execute(select(L.c.id).where(L.c.heartbeat_at_ms < before_ms)).all()
        return [str(r[0]) for r in rows]

    @retried_once
    def forget(self, listener_id: str, *, silent_before_ms: int | None = None) -> bool:
        """Delete a listener's row (only if still silent, when `silent_before_ms` is given)."""
        q = delete(L).where(L.c.id == listener_id)
        if silent_before_ms is not None:
            q = q.where(L.c.heartbeat_at_ms < silent_before_ms)
        with self._tx() as conn:
            return bool(conn.execute(q).rowcount)

    @retried_once
    def runs_of(self, listener_id: str, limit: int = 1000) -> list[TaskRow]:
        """Running rows claimed by `listener_id`: a filter on the running rows' range of the
        (status, lease_until_ms) index, which holds only the fleet's runs in flight."""
        with self._tx() as conn:
            rows = conn.execute(
                select(T)
                .where(
                    T.c.claimed_by.like(like_prefix(f"{listener_id}:"), escape="\\"),
                    T.c.status == TaskStatus.RUNNING.value,
                )
                .limit(limit)
            ).all()
        return [_row(r, self.key_prefix) for r in rows]
