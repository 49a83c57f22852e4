"""Joining the caller's transaction (`create(..., tx=conn)`): which connection, whether it is on the
ledger's database, and what runs once it commits.

The row is written on the caller's connection; its Redis key is set (or, for a cancel, deleted)
only after the caller's transaction commits, and nothing happens on a rollback. SQLAlchemy's Core
has no event after a commit (`ConnectionEvents.commit` fires before it, and its maintainers decline
to add one), so the `commit` listener added here commits the DBAPI connection itself, then syncs the
keys, then lets SQLAlchemy's own commit run, which finds nothing left to commit (other `commit`
listeners on that connection that run after it find the transaction committed already).

It is the connection's transaction that is followed, not a Session's: a Session joined to an
outer transaction "commits" without committing anything, and only the outer commit arms the keys.

After the commit the keys are synced with what the ledger then holds (a pending row is armed at
its due time, a row no longer pending has its key deleted after a cancel), not with what was
written: a SAVEPOINT rolled back in between undid some of it, and a listener may have claimed a
row already. If the process dies between the commit and the sync, the rows are pending without
keys: the listener's periodic check of overdue rows arms them (README, "Inside your transaction").

Another framework's transaction handle (Django's connection) is joined through an adapter it
registers (`add_tx_adapter`): the adapter yields a Connection on the framework's own DB-API
connection, and says who commits it (`commit_owned_by`), so the keys are synced by the
framework's after-commit hook rather than by the `commit` listener here.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

from loguru import logger
from sqlalchemy import Connection, Engine, event
from sqlalchemy.engine.base import TwoPhaseTransaction
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from keyexpiry.errors import ArgumentError, StoreError
from keyexpiry.keys import excerpt

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

# A string: the ORM costs a listener ~0.1 s to import, and only a caller passing a Session needs it.
Tx: TypeAlias = "Connection | Session"
"""The caller's transaction: a SQLAlchemy `Connection` or ORM `Session` on the ledger's database."""

Sync = Callable[[set[str], set[str]], None]
"""What runs after the commit: `sync(created_keys, cancelled_keys)`."""

TxAdapter = Callable[[object], "AbstractContextManager[Connection] | None"]
"""Turns a `tx=` value of another framework into a context yielding a Connection in its
transaction, or says None: not its kind."""

OnCommit = Callable[[Callable[[], None]], None]
"""A framework's "run this after the commit" (Django's `transaction.on_commit`)."""

_adapters: list[TxAdapter] = []
_owned: weakref.WeakKeyDictionary[Connection, OnCommit] = weakref.WeakKeyDictionary()


def add_tx_adapter(adapter: TxAdapter) -> None:
    """Let `tx=` accept what `adapter` recognises (once per adapter, however often called)."""
    if adapter not in _adapters:
        _adapters.append(adapter)


def commit_owned_by(conn: Connection, on_commit: OnCommit) -> None:
    """Say that `conn`'s transaction is committed by its framework: `after_commit` hands its
    sync to `on_commit` instead of listening for the commit itself."""
    _owned[conn] = on_commit


@contextmanager
def joined(tx: object) -> Iterator[Connection]:
    """The Connection of the caller's transaction `tx`, for the time of one call: through an
    adapter that recognises it, else `connection_of`."""
    for adapt in list(_adapters):
        held = adapt(tx)
        if held is not None:
            with held as conn:
                yield conn
            return
    yield connection_of(tx)


def connection_of(tx: object) -> Connection:
    """The Connection whose transaction `tx` names (a Session's for its default bind)."""
    from sqlalchemy.orm import Session

    if isinstance(tx, Session):
        try:
            conn = tx.connection()
        except SQLAlchemyError as exc:
            raise ArgumentError(
                f"tx: the Session has no connection for the ledger ({exc}); pass the "
                "Connection of its transaction on the ledger's database instead"
            ) from None
    elif isinstance(tx, Connection):
        conn = tx
    else:
        raise ArgumentError(
            f"tx must be a SQLAlchemy Connection or Session, got {type(tx).__name__}"
        )
    if conn.closed or conn.invalidated:
        raise ArgumentError("tx is a closed or invalidated connection")
    # Private, but the only way to know; without it an AUTOCOMMIT connection is not detected
    # and its keys are armed at its next commit() instead.
    is_autocommit = getattr(conn, "_is_autocommit_isolation", None)
    if callable(is_autocommit) and is_autocommit():
        raise ArgumentError(
            "tx is in AUTOCOMMIT mode: it has no transaction to join (call without tx=)"
        )
    if isinstance(conn.get_transaction(), TwoPhaseTransaction):
        raise ArgumentError("tx is a two-phase transaction: not supported")
    return conn


# --- the same database ------------------------------------------------------------------------

_identities: weakref.WeakKeyDictionary[Engine, tuple[str, ...]] = weakref.WeakKeyDictionary()
_identities_lock = threading.Lock()


def database_identity(conn: Connection) -> tuple[str, ...]:
    """What names the database `conn` is on, asked of the server once per engine: a URL can name
    one database in many ways (a host name or its address, a driver or another)."""
    engine = conn.engine
    with _identities_lock:
        known = _identities.get(engine)
    if known is not None:
        return known
    name = conn.dialect.name
    ident: tuple[str, ...]
    if name == "sqlite":
        rows = conn.exec_driver_sql("PRAGMA database_list").all()
        path = next((str(r[2]) for r in rows if r[1] == "main"), "")
        # An in-memory database is its engine's alone.
        ident = ("sqlite", os.path.realpath(path) if path else f"memory:{id(engine)}")
    elif name in ("mysql", "mariadb"):
        host, port, schema = conn.exec_driver_sql("SELECT @@hostname, @@port, DATABASE()").one()
        ident = ("mysql", str(host), str(port), str(schema))
    elif name == "postgresql":
        # The cluster's system identifier, which a streaming replica shares with its primary:
        # a multi-host URL names the same database before and after a failover.
        system, database = conn.exec_driver_sql(
            "SELECT (SELECT system_identifier FROM pg_control_system()), current_database()"
        ).one()
        ident = ("postgresql", str(system), str(database))
    else:
        url = engine.url
        ident = (name, str(url.host), str(url.port), str(url.database))
    with _identities_lock:
        _identities[engine] = ident
    return ident


def remember_identity(engine: Engine, identity: tuple[str, ...]) -> None:
    """Say which database `engine`'s connections are on, asked on a connection of its own (for
    an engine whose connections are a framework's, mid-transaction)."""
    with _identities_lock:
        _identities[engine] = identity


def check_same_database(conn: Connection, ledger: Engine, ledger_identity: tuple[str, ...]) -> None:
    """Raise ArgumentError unless `conn` is on the ledger's database."""
    if conn.engine is ledger:
        return
    try:
        theirs = database_identity(conn)
    except SQLAlchemyError as exc:
        raise StoreError(f"tx: cannot tell which database it is on: {exc}") from None
    if theirs != ledger_identity:
        raise ArgumentError(
            f"tx is a connection to another database ({', '.join(theirs)}) than the ledger "
            f"({', '.join(ledger_identity)}): its transaction cannot hold the task's row"
        )


# --- after the commit -----------------------------------------------------------------------


@dataclass
class _Joined:
    """What one connection's transaction holds for keyexpiry, by the client that wrote it."""

    created: dict[Sync, set[str]] = field(default_factory=dict)
    cancelled: dict[Sync, set[str]] = field(default_factory=dict)


_joined: weakref.WeakKeyDictionary[Connection, _Joined] = weakref.WeakKeyDictionary()
_hooked: weakref.WeakSet[Connection] = weakref.WeakSet()
_lock = threading.Lock()


def after_commit(
    conn: Connection, sync: Sync, *, created: Iterable[str] = (), cancelled: Iterable[str] = ()
) -> None:
    """Run `sync(created, cancelled)` once `conn`'s transaction commits; forget it on a rollback.

    Keys of one transaction are gathered: `sync` runs once per client and commit (per call
    when the transaction is a framework's, `commit_owned_by`).
    """
    on_commit = _owned.get(conn)
    if on_commit is not None:
        created_keys, cancelled_keys = set(created), set(cancelled)
        on_commit(lambda: _run_sync(sync, created_keys, cancelled_keys))
        return
    with _lock:
        joined = _joined.setdefault(conn, _Joined())
        joined.created.setdefault(sync, set()).update(created)
        joined.cancelled.setdefault(sync, set()).update(cancelled)
        if conn not in _hooked:
            _hooked.add(conn)
            event.listen(conn, "commit", _on_commit)
            event.listen(conn, "rollback", _on_rollback)


def pending_for(conn: Connection) -> bool:
    """Whether `conn`'s transaction holds keys to sync at its commit (for tests)."""
    with _lock:
        return conn in _joined


def _on_rollback(conn: Connection) -> None:
    with _lock:
        _joined.pop(conn, None)


def _on_commit(conn: Connection) -> None:
    with _lock:
        joined = _joined.pop(conn, None)
    if joined is None:
        return  # a later transaction of this connection without tasks: SQLAlchemy commits it
    dialect = conn.dialect
    try:
        dialect.do_commit(conn.connection)
    except dialect.loaded_dbapi.Error as exc:
        # What SQLAlchemy's own commit would have raised. Nothing is armed: if the commit did
        # happen after all (its reply was lost), reconciliation arms the rows.
        raise DBAPIError.instance(
            None,
            None,
            exc,
            dialect.loaded_dbapi.Error,
            connection_invalidated=dialect.is_disconnect(exc, conn.connection, None),
            dialect=dialect,
        ) from exc
    for sync, created in joined.created.items():
        cancelled = joined.cancelled.get(sync, set())
        _run_sync(sync, created, cancelled)
    for sync, cancelled in joined.cancelled.items():
        if sync not in joined.created:
            _run_sync(sync, set(), cancelled)


def _run_sync(sync: Sync, created: set[str], cancelled: set[str]) -> None:
    # The commit stands whatever happens here: raising would tell the caller it failed.
    try:
        sync(created, cancelled)
    except Exception as exc:
        keys = sorted(created | cancelled)
        more = f" and {len(keys) - 1} more" if len(keys) > 1 else ""
        logger.bind(key=keys[0] if keys else "", attempt=0).warning(
            "committed, but the Redis keys of {}{} were not synced ({}); reconciliation "
            "arms pending rows",
            excerpt(keys[0], 80) if keys else "",
            more,
            exc,
        )
