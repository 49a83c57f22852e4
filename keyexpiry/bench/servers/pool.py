"""Fresh databases created ahead and dropped behind on a background thread (`DatabasePool`).

A test suite that gives every test a database of its own pays for CREATE DATABASE and DROP
DATABASE between every two tests (about 90 ms and 15 ms on PostgreSQL, 30 ms and 35-50 ms on
MariaDB, on an idle 2-core machine; several times that under load). The pool keeps ``ahead``
databases created in advance, never opened until one is taken, so each is as fresh and empty
as one created on the spot; a database given back has its sessions ended at once (nothing of a
test outlives it, as when it was dropped at once), and is dropped later on the pool's thread,
while the next test runs.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

# A failed create or drop (a test stopped or restarted the server) is tried again after this,
# doubled on each failure in a row up to the maximum: the server is usually back by then.
_RETRY_S = 0.2
_RETRY_MAX_S = 3.0

# How long `take` waits for a create already under way before making its own.
_TAKE_WAIT_S = 30.0


class Databases(Protocol):
    """What the pool needs of a server: `MariaDBServer` and `PostgresServer` have it."""

    def create_database(self, name: str) -> str: ...

    def drop_database(self, name: str) -> None: ...

    def end_sessions(self, name: str) -> None: ...


class DatabasePool:
    """Databases of one server named by ``new_name()``, ``ahead`` of them created in advance.

    ``take()`` returns a new database's name; ``give_back(name)`` ends its sessions and queues it
    to be dropped; ``close()`` stops the thread and drops what is left. Thread-safe.
    """

    def __init__(self, server: Databases, new_name: Callable[[], str], *, ahead: int = 1) -> None:
        self._server = server
        self._new_name = new_name
        self._ahead = ahead
        self._ready: deque[str] = deque()
        self._doomed: deque[str] = deque()
        self._creating = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="database-pool", daemon=True)
        self._thread.start()

    def take(self) -> str:
        """The name of a fresh, empty database: one made ahead, or (none ready) a new one."""
        with self._cond:
            self._cond.wait_for(lambda: self._ready or not self._creating, _TAKE_WAIT_S)
            name = self._ready.popleft() if self._ready else None
            self._cond.notify_all()
        if name is None:
            name = self._new_name()
            self._server.create_database(name)
        return name

    def give_back(self, name: str) -> None:
        """End the sessions of database ``name`` now and drop it on the pool's thread."""
        try:
            self._server.end_sessions(name)
        finally:
            with self._cond:
                self._doomed.append(name)
                self._cond.notify_all()

    def close(self) -> None:
        """Stop the thread, then drop every database the pool still holds."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        for name in [*self._ready, *self._doomed]:
            self._server.drop_database(name)
        self._ready.clear()
        self._doomed.clear()

    def _run(self) -> None:
        retry_s = _RETRY_S
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._closed or len(self._ready) < self._ahead or bool(self._doomed)
                )
                if self._closed:
                    return
                # The next test waits for a create, nobody for a drop: create first.
                create = len(self._ready) < self._ahead
                name = self._new_name() if create else self._doomed.popleft()
                self._creating = create
            try:
                if create:
                    self._server.create_database(name)
                else:
                    self._server.drop_database(name)
            except Exception:
                # The server may be down for a moment: whether the database exists is unknown,
                # so it is dropped later (IF EXISTS) and another is made.
                with self._cond:
                    self._creating = False
                    self._doomed.append(name)
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: self._closed, retry_s)
                retry_s = min(2 * retry_s, _RETRY_MAX_S)
                continue
            retry_s = _RETRY_S
            with self._cond:
                if create:
                    self._ready.append(name)
                    self._creating = False
                self._cond.notify_all()
