"""Django's own database connection as a SQLAlchemy Connection, so a row keyexpiry writes joins
the caller's `transaction.atomic()`: `create(..., tx=django.db.connection)` (or
`connections["alias"]`, or the alias itself) and the backend's `enqueue()`.

The bridge borrows the DB-API connection Django holds for the current thread: its pool never
opens or closes one, and its dialect never commits or rolls back (Django's transaction is
Django's: closing the bridge must not end it, as a plain SQLAlchemy engine on that connection
would, with a ROLLBACK on its return to the pool). Keys are armed by `transaction.on_commit`
after Django's commit, and never on a rollback. Outside an atomic block the write gets a
transaction of its own (`atomic(savepoint=False)`), whose commit arms the keys at once. The
dialect is initialised once per alias on a connection of its own, never on Django's (SQLAlchemy
ends the first connection's transaction when it initialises).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, create_engine
from sqlalchemy.engine import Dialect
from sqlalchemy.pool import NullPool, Pool
from sqlalchemy.pool.base import ConnectionPoolEntry, _ConnectionRecord

from keyexpiry.errors import ArgumentError, ConfigError
from keyexpiry.ledger.transactions import commit_owned_by, database_identity, remember_identity

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

_DRIVERS = {
    "sqlite3": "sqlite+pysqlite",
    "psycopg": "postgresql+psycopg",
    "psycopg2": "postgresql+psycopg2",
    "pymysql": "mysql+pymysql",
    "MySQLdb": "mysql+mysqldb",
}
"""The DB-API module Django's connection comes from → the SQLAlchemy dialect that speaks it."""

_engines: dict[tuple[str, str], Engine] = {}
_engines_lock = threading.Lock()


def wrapper_of(tx: object) -> BaseDatabaseWrapper | None:
    """The Django connection `tx` names (`django.db.connection`, `connections[alias]`, an
    alias), or None when `tx` is no Django connection."""
    from django.db import connections
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.utils.connection import ConnectionProxy

    if isinstance(tx, BaseDatabaseWrapper):
        if connections[tx.alias] is not tx:
            # Django's connections are per thread: this one's transaction is not ours to join
            # (an AsyncClient's worker thread, say), and Django forbids sharing it.
            raise ArgumentError(
                f"tx is Django's connection {tx.alias!r} of another thread: call from the "
                "thread of its transaction (in async code: sync_to_async, thread_sensitive)"
            )
        return tx
    if isinstance(tx, ConnectionProxy):
        alias = object.__getattribute__(tx, "_alias")
        return connections[alias]  # type: ignore[no-any-return]
    if isinstance(tx, str):
        if tx not in connections.settings:
            raise ArgumentError(f"tx={tx!r} is not a Django database alias")
        return connections[tx]  # type: ignore[no-any-return]
    return None


def django_tx(tx: object) -> AbstractContextManager[Connection] | None:
    """The `tx=` adapter (`ledger.transactions.add_tx_adapter`): a Connection in the
    caller's Django transaction for one call, or None when `tx` is not Django's."""
    wrapper = wrapper_of(tx)
    return None if wrapper is None else joined(wrapper)


@contextmanager
def joined(wrapper: BaseDatabaseWrapper) -> Iterator[Connection]:
    """A bridge Connection in `wrapper`'s transaction (one of its own outside `atomic()`);
    keys a write through it records are synced by `transaction.on_commit`."""
    from django.db import transaction

    alias = wrapper.alias

    def on_commit(fn: Any) -> None:
        transaction.on_commit(fn, using=alias)

    with transaction.atomic(using=alias, savepoint=False):
        wrapper.ensure_connection()
        conn = bridge_engine(wrapper).connect()
        commit_owned_by(conn, on_commit)
        try:
            yield conn
        finally:
            conn.close()  # the dialect's rollback is a no-op: Django's transaction goes on


def bridge_engine(wrapper: BaseDatabaseWrapper) -> Engine:
    """The engine whose connections are `wrapper`'s, in the thread that asks (one per alias)."""
    raw = wrapper.connection
    module = type(raw).__module__.split(".")[0]
    drivername = _DRIVERS.get(module)
    if drivername is None:
        raise ConfigError(
            f"Django database {wrapper.alias!r} connects with {module}: keyexpiry joins "
            "sqlite3, psycopg, psycopg2, PyMySQL and mysqlclient connections"
        )
    key = (wrapper.alias, drivername)
    with _engines_lock:
        engine = _engines.get(key)
        if engine is None:
            dialect, identity = _initialized_dialect(wrapper, drivername)
            engine = Engine(_Borrowed(wrapper.alias, dialect), dialect, dialect_url(drivername))
            # Asked on the initialising connection: never a query in the caller's transaction.
            remember_identity(engine, identity)
            _engines[key] = engine
    return engine


def forget_engines() -> None:
    """Drop the bridges (settings changed: a test's DATABASES)."""
    with _engines_lock:
        _engines.clear()


def dialect_url(drivername: str) -> Any:
    from sqlalchemy.engine import make_url

    return make_url(f"{drivername}://")


def _initialized_dialect(
    wrapper: BaseDatabaseWrapper, drivername: str
) -> tuple[Dialect, tuple[str, ...]]:
    # On a connection of its own: SQLAlchemy rolls back the connection it initialises on.
    params = wrapper.get_connection_params()
    init = create_engine(
        f"{drivername}://",
        creator=lambda: wrapper.get_new_connection(params),
        poolclass=NullPool,
    )
    try:
        with init.connect() as conn:
            identity = database_identity(conn)
    finally:
        init.dispose()
    dialect = init.dialect

    def no_op(_dbapi_conn: Any) -> None:
        return None

    # Django commits and rolls back its own transaction; SQLAlchemy's Connection would end it
    # when closed. Savepoints are SQL statements and stay as they are.
    dialect.do_commit = no_op  # type: ignore[method-assign,assignment]
    dialect.do_rollback = no_op  # type: ignore[method-assign,assignment]
    dialect.do_close = no_op  # type: ignore[method-assign,assignment]
    return dialect, identity


class _Borrowed(Pool):
    """A pool that lends Django's DB-API connection of the calling thread and never opens,
    resets or closes one."""

    def __init__(self, alias: str, dialect: Dialect) -> None:
        super().__init__(self._never, reset_on_return=None, dialect=dialect)
        self._alias = alias

    @staticmethod
    def _never() -> Any:
        raise ConfigError("keyexpiry's bridge opens no connection of its own")

    def _do_get(self) -> ConnectionPoolEntry:
        from django.db import connections

        record = _ConnectionRecord(self, connect=False)
        record.dbapi_connection = connections[self._alias].connection
        return record

    def _do_return_conn(self, record: ConnectionPoolEntry) -> None:
        # Django's connection: left open, in whatever transaction it is.
        record.dbapi_connection = None  # type: ignore[misc]

    def dispose(self) -> None:
        return None

    def recreate(self) -> Pool:
        return self

    def status(self) -> str:
        return f"borrowing Django's connection {self._alias!r}"
