"""New connections the ledger accepted and heartbeats it took, counted, so that a thread backing
off after an outage retries as soon as any thread of the process reaches the ledger again, not
when its backoff ends.

The claimer's and the recorder's waits double up to `reconnect_max_s` (30 s): through a 15 s
PostgreSQL failover under Patroni the soak saw a claim retried 16 s after the new primary took
writes, and every task it held that much later. The heartbeat and the periodic check try the
ledger every second, so their first new connection that succeeds now ends those waits. A new
connection alone is not enough: one opened before a claim's last failure (by the heartbeat,
say, just after a switchover) leaves that claim's wait to its full length, 8 s at the fifth
failure. (The Patroni hour on 7527071 had one task start 15.5 s late after a 5.4 s switchover,
0.5 + 1 + 2 + 4 + 8 s; its logs were not kept, so this path is likely, not shown.) So each
heartbeat written counts too: a wait ends at the first one after it began.
"""

from __future__ import annotations

import threading

from sqlalchemy import Engine, event

from keyexpiry.clock import monotonic_s


class Reconnects:
    """A count of the connections the watched engines' pools opened."""

    def __init__(self) -> None:
        self._count = 0
        self._changed = threading.Condition()

    def watch(self, engine: Engine) -> None:
        """Count every new DBAPI connection `engine`'s pool opens."""
        event.listen(engine, "connect", self._connected)

    def _connected(self, dbapi_connection: object, record: object) -> None:
        self.answered()

    def answered(self) -> None:
        """The ledger took a write (a heartbeat): it is reachable and a primary, so a thread
        waiting out a backoff after an outage-like failure may try again now."""
        with self._changed:
            self._count += 1
            self._changed.notify_all()

    @property
    def count(self) -> int:
        """Connections opened and heartbeats written so far."""
        return self._count

    def pause(self, stop: threading.Event, seen: int, wait_s: float, min_s: float) -> None:
        """Wait `wait_s`, or less: until `stop`, or until a connection or heartbeat newer than
        the `seen`-th, but never under `min_s` (a connection can open on a server that refuses
        the statement after it: a standby behind a proxy must not turn backoff into a spin)."""
        start_s = monotonic_s()
        deadline_s = start_s + wait_s
        while not stop.is_set():
            now_s = monotonic_s()
            if now_s >= deadline_s:
                return
            if self._count > seen and now_s - start_s >= min_s:
                return
            with self._changed:
                self._changed.wait(min(deadline_s - now_s, 0.2))
