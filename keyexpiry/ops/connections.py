"""What one client of an HTTP port may cost, and the bookkeeping that holds it to that: shared
by the listener's `--http` port (`ops.endpoints`, a thread per connection) and `keyexpiry web`
(`web.serve`, uvicorn's event loop). Both are reachable by whoever reaches the address, so
anyone may open connections and never finish them (slowloris)."""

from __future__ import annotations

import resource
import socket
import threading
from dataclasses import dataclass
from typing import Protocol

from keyexpiry.clock import monotonic_s


@dataclass(frozen=True)
class HttpLimits:
    """What one client of a port can cost, whoever it is (it may be unauthenticated)."""

    max_connections: int = 32
    """Connections served at once (a scraper and a few probes, or a few browser tabs, need a
    handful). Lowered to a sixteenth of RLIMIT_NOFILE when that is smaller: the process's own
    Redis and ledger connections must always find a descriptor."""
    kept_for_healthz: int = 2
    """Connections accepted beyond `max_connections`. At most `max_connections` are busy
    answering anything but `/healthz` (others get 503 at once); `/healthz` does no I/O and is
    always answered, so a liveness probe gets in while every other slot is busy."""
    ledger_wait_s: float = 1.0
    """How long a `/readyz` or `/metrics` waits for a ledger query under way (counted from when
    it started); past that it answers without it (not ready; the last counts)."""
    head_timeout_s: float = 5.0
    """The whole request head (request line and headers) must arrive within this; on a kept-alive
    connection, each request's head, counted from the end of the previous answer."""
    io_timeout_s: float = 5.0
    """Each read or write of a connection, once its head is in (the `--http` port's threads;
    on `keyexpiry web`'s event loop, a read or write waits costing no thread, and
    `connection_deadline_s` bounds it)."""
    connection_deadline_s: float = 30.0
    """No request lives longer, head and answer together (a client that reads its response a
    byte at a time)."""
    max_head_bytes: int = 8192
    """A longer request head is refused (http.client alone would take 6 MiB)."""

    def connection_cap(self) -> int:
        """`max_connections`, or fewer when the process may open few descriptors."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(2, min(self.max_connections, soft // 16))


ACCEPT_PAUSE_S = 0.5
"""After accept() fails for want of a descriptor: without a pause the listening socket stays
readable and the accept loop spins at 100 % CPU."""


class Closable(Protocol):
    """A connection `Slots` can cut: a socket, or anything that ends one on `shutdown`."""

    def shutdown(self, how: int, /) -> None: ...


class OncePer:
    """Whether a warning is due: at most one every `period_s`, so a failure that repeats for as
    long as an attack lasts is said once, not once per connection."""

    def __init__(self, period_s: float = 60.0) -> None:
        self.period_s = period_s
        self._said_s: float | None = None

    def due(self) -> bool:
        now = monotonic_s()
        if self._said_s is not None and now - self._said_s < self.period_s:
            return False
        self._said_s = now
        return True


@dataclass
class _Connection:
    sock: Closable
    opened_s: float
    """When the connection opened, or its previous answer ended (kept alive)."""
    reading_head: bool = True
    busy: bool = False  # answering something other than /healthz (which needs no I/O)
    evicted: bool = False


class Slots:
    """The connections being served: at most `cap` busy answering, and `kept` more accepted for
    `/healthz`; twice their sum counting the evicted, whose threads are ending. A bound on the
    port's descriptors and threads."""

    def __init__(self, limits: HttpLimits, *, evicted_close_at_once: bool = False) -> None:
        self.limits = limits
        self.cap = limits.connection_cap()
        self.kept = max(1, limits.kept_for_healthz)
        self.evicted_close_at_once = evicted_close_at_once
        """Whether an evicted connection's descriptor is freed at once (an event loop aborts
        it), so it stops counting then; else its thread frees it, and it counts until
        `release`."""
        self._lock = threading.Lock()
        self._open: dict[int, _Connection] = {}

    def admit(self, sock: Closable) -> bool:
        """Take a slot for a new connection. When all are taken, the oldest connection still
        sending its head is closed to make room (half-finished requests cannot starve a
        prompt one); when every slot is answering, the newcomer is refused. At most `cap` of
        them are busy (`head_read`), so this happens only while the kept ones answer at once."""
        now = monotonic_s()
        total = self.cap + self.kept
        with self._lock:
            self._reap_locked(now)
            live = [c for c in self._open.values() if not c.evicted]
            if len(live) >= total:
                idle = [c for c in live if c.reading_head]
                if not idle:
                    return False
                self._evict(min(idle, key=lambda c: c.opened_s))
                self._forget_evicted_locked()
            if len(self._open) >= 2 * total:
                return False
            self._open[id(sock)] = _Connection(sock, now)
            return True

    def head_read(self, sock: Closable, path: str | None) -> bool:
        """The connection's request head is in, asking for `path` (None: refused, answered at
        once): from now it is answered, not evicted. False when it asks for anything but
        `/healthz` while `cap` connections are busy already: it is to be refused at once."""
        with self._lock:
            conn = self._open.get(id(sock))
            if conn is None:
                return True
            conn.reading_head = False
            if path is None or path == "/healthz":
                return True
            if self._busy_locked() >= self.cap:
                return False
            conn.busy = True
            return True

    def answered(self, sock: Closable) -> None:
        """The connection's answer is sent and it is kept alive: it waits for its next request
        head, evictable and timed as a new connection's."""
        with self._lock:
            conn = self._open.get(id(sock))
            if conn is not None and not conn.evicted:
                conn.reading_head, conn.busy, conn.opened_s = True, False, monotonic_s()

    def busy(self) -> int:
        """Connections answering something other than `/healthz`."""
        with self._lock:
            return self._busy_locked()

    def _busy_locked(self) -> int:
        return sum(1 for c in self._open.values() if c.busy and not c.evicted)

    def release(self, sock: Closable) -> None:
        """The connection's thread is done with it."""
        with self._lock:
            self._open.pop(id(sock), None)

    def reap(self) -> None:
        """Close connections past their head timeout or their deadline."""
        with self._lock:
            self._reap_locked(monotonic_s())

    def close_all(self) -> None:
        with self._lock:
            for conn in self._open.values():
                self._evict(conn)
            self._forget_evicted_locked()

    def _reap_locked(self, now: float) -> None:
        for conn in self._open.values():
            age = now - conn.opened_s
            late_head = conn.reading_head and age > self.limits.head_timeout_s
            if not conn.evicted and (late_head or age > self.limits.connection_deadline_s):
                self._evict(conn)
        self._forget_evicted_locked()

    def _forget_evicted_locked(self) -> None:
        if self.evicted_close_at_once:
            for key in [k for k, c in self._open.items() if c.evicted]:
                del self._open[key]

    @staticmethod
    def _evict(conn: _Connection) -> None:
        # shutdown, never close: the blocked read in the connection's thread returns at once,
        # and the descriptor is closed by that thread, so it cannot be reused under it.
        conn.evicted = True
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed by its thread
