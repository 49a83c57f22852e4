"""The base of every ledger query: one transaction per call, driver errors turned into
StoreError (disconnected, lock timeout), the once-more retry that is safe for all of them, and
statements compiled once per store for the hot paths."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from pymysql.connections import Connection as PyMySQLConnection
from pymysql.constants import COMMAND
from sqlalchemy import ClauseElement, Connection, CursorResult, Dialect, Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError, StatementError
from sqlalchemy.sql.compiler import SQLCompiler

from keyexpiry.errors import StoreError
from keyexpiry.ledger.engine import autocommit_engine, error_code, not_serving
from keyexpiry.ledger.reconnects import Reconnects
from keyexpiry.ledger.upsert import LiteralUpsert, upsert_statement
from keyexpiry.masking import mask_url

R = TypeVar("R")


# Statements whose values are written into them: no `%` in them is a placeholder for PyMySQL.
_NO_PARAMETERS = {"no_parameters": True}
_HELD_CURSOR = "keyexpiry.held_cursor"
"""Where `_on_raw_autocommit` keeps a pooled connection's cursor (the pool's `info` of that
connection, cleared when the pool replaces it)."""
_MYSQL_LOCK_WAIT_TIMEOUT = 1205  # ER_LOCK_WAIT_TIMEOUT: only the statement was rolled back
_COLUMN_NAMES_KEPT = 64
"""Statement texts whose column names `_autocommitted_named_rows` keeps (a few are used)."""


# The server rolled the transaction back and expects the client to run it again: InnoDB's
# deadlock (a create rescheduling a key deadlocks with a claim of the same row), which is also
# how Galera reports a transaction that lost certification against another node's ("Deadlock:
# wsrep aborted transaction"); PostgreSQL's deadlock and serialization failure. A lock wait
# timeout is not retried here: the claimer splits its batch around the locked row instead.
_ROLLED_BACK_BY_SERVER: frozenset[int | str] = frozenset({1213, "40P01", "40001"})
_LOCK_WAIT_TIMEOUTS: frozenset[int | str] = frozenset({_MYSQL_LOCK_WAIT_TIMEOUT, "55P03"})


def _rolled_back_by_server(exc: StoreError) -> bool:
    return error_code(exc.__cause__) in _ROLLED_BACK_BY_SERVER


def worth_retrying(exc: StoreError) -> bool:
    """Whether what failed may simply run again: its connection was dead (or its server not
    serving), or the server chose it as a deadlock's victim or rolled it back for a conflict
    (either way nothing of it was committed, or it is idempotent)."""
    return exc.disconnected or _rolled_back_by_server(exc)


def retried_once(method: Callable[..., R]) -> Callable[..., R]:
    """Run a Store method once more when its connection turned out to be dead, or MariaDB chose
    it as a deadlock's victim.

    Safe because every method is idempotent or keyed by a claim token: a claim repeated after an
    ambiguous commit finds its rows by token, a repeated record or cancel changes nothing more.
    """

    @functools.wraps(method)
    def wrapper(self: Ledger, *args: Any, **kwargs: Any) -> R:
        try:
            return method(self, *args, **kwargs)
        except StoreError as exc:
            if not worth_retrying(exc):
                raise
            try:
                return method(self, *args, **kwargs)
            except StoreError as again:
                # The first attempt's answer was lost: what it did may stand, whatever the
                # second one met (the ledger still out of reach, most likely).
                again.maybe_applied = again.maybe_applied or exc.maybe_applied
                raise

    return wrapper


@dataclass(frozen=True, slots=True)
class Prepared:
    """A statement compiled once for a dialect and run as its SQL text.

    Executing a Core statement costs SQLAlchemy a cache key, a compiled-cache lookup, parameter
    construction (and an IN list's expansion) on every call: on the claimer and the recorder,
    which run transactions of a few rows many times a second, that fixed cost was most of their
    CPU. Here it is paid once; each call only orders its values and hands them to the driver
    through `exec_driver_sql`, which keeps SQLAlchemy's error wrapping and the invalidation of a
    dead connection (so `Ledger._tx` and `retried_once` see the same errors as before).
    """

    sql: str
    order: tuple[str, ...] | None
    """Parameter names in placeholder order for a positional driver (SQLite); None for a named
    one (PyMySQL)."""
    constants: Mapping[str, Any]
    """Values the statement bound itself (literals such as a status)."""

    @classmethod
    def compile(cls, statement: ClauseElement, dialect: Dialect) -> Prepared:
        """Compile `statement`: every value a call supplies is a `bindparam` without a value."""
        compiled = statement.compile(dialect=dialect)
        if not isinstance(compiled, SQLCompiler):
            raise TypeError(f"not a SQL statement: {statement!r}")
        supplied = {name for name, bind in compiled.binds.items() if bind.required}
        for name, bind in compiled.binds.items():
            # The driver gets each value as it is: a type that converts values on the way in
            # would be skipped here, so none may appear.
            if bind.type.dialect_impl(dialect).bind_processor(dialect) is not None:
                raise TypeError(f"parameter {name!r} needs conversion; not preparable")
        constants = {
            name: value
            for name, value in compiled.construct_params(dict.fromkeys(supplied)).items()
            if name not in supplied
        }
        order = None if compiled.positiontup is None else tuple(compiled.positiontup)
        return cls(compiled.string, order, constants)

    def run(self, conn: Connection, values: Mapping[str, Any]) -> CursorResult[Any]:
        """Execute with `values` for the statement's bind parameters."""
        params = {**self.constants, **values}
        if self.order is None:
            return conn.exec_driver_sql(self.sql, params)
        return conn.exec_driver_sql(self.sql, tuple([params[name] for name in self.order]))


def driver_error(conn: Connection, exc: Any, sql: str) -> StatementError:
    """`exc`, raised by the driver itself on `conn` (a statement sent past SQLAlchemy), wrapped
    as `exec_driver_sql` would: the connection is invalidated when the server is gone."""
    dialect = conn.dialect
    raw: Any = conn.connection.driver_connection
    gone = dialect.is_disconnect(exc, raw, None) or not_serving(exc)
    wrapped: StatementError = DBAPIError.instance(
        sql[:300], None, exc, dialect.loaded_dbapi.Error,
        connection_invalidated=gone, dialect=dialect,
    )  # fmt: skip
    if gone:
        conn.invalidate(wrapped)
    return wrapped


class Ledger:
    """An engine on `time_limit_task` and the transaction every query runs in."""

    def __init__(self, engine: Engine, *, key_prefix: str = "") -> None:
        self.engine = engine
        self.key_prefix = key_prefix
        """The task keys' prefix (`Settings.key_prefix`): a row's class is its key's after it."""
        self._upsert = upsert_statement(engine.dialect.name)
        # PyMySQL only: another driver keeps the bound upsert (and its own escaping).
        pymysql = engine.dialect.driver == "pymysql"
        self.postgres = engine.dialect.name == "postgresql"
        """Whether the ledger is on PostgreSQL (its claims and creates use RETURNING)."""
        self.embedded = engine.dialect.name == "sqlite"
        """Whether the ledger is a SQLite file: no server to lose or fail over, so a statement
        that fails met a busy file (another writer) or the disk, not an outage to wait out."""
        self._literal_upserts = pymysql
        # A statement sent and its reply read apart (`_pipelined`): PyMySQL's own two halves of
        # `Connection.query`, private names, so checked once here rather than trusted.
        self._pipelines = pymysql and all(
            hasattr(PyMySQLConnection, name) for name in ("_execute_command", "next_result")
        )
        self._literal_upsert: LiteralUpsert | None = None
        self._array_upsert: str | None = None
        self._scalar_upsert: str | None = None
        self._autocommit = autocommit_engine(engine) if pymysql or self.postgres else None
        self.reconnects = Reconnects()
        """New connections opened (both pools): what a thread backing off waits on."""
        for pool in (engine, self._autocommit):
            if pool is not None:
                self.reconnects.watch(pool)
        self._url = mask_url(engine.url.render_as_string(hide_password=True))
        self._schema_lock = threading.Lock()
        self._prepared: dict[Hashable, Prepared] = {}
        self._column_names: dict[str, tuple[str, ...]] = {}

    def _prepare(self, build: Callable[..., ClauseElement], *args: Hashable) -> Prepared:
        """`build(*args)` compiled for this engine, once: later calls find it by (build, args).
        Threads racing on a new one both compile it; either result is the same."""
        key = (build, args)
        prepared = self._prepared.get(key)
        if prepared is None:
            prepared = self._prepared[key] = Prepared.compile(build(*args), self.engine.dialect)
        return prepared

    def open_connections(self, count: int) -> None:
        """Have `count` connections open in the pool now (it keeps up to 10), so that no thread
        opens one while due work waits behind it: a new PyMySQL connection cost 30-90 ms of CPU
        here (a TLS context, the handshake, the session settings). StoreError when the database
        is out of reach. Nothing to do on SQLite."""
        if self.engine.dialect.name == "sqlite":
            return
        opened: list[Connection] = []
        try:
            for _ in range(count):
                opened.append(self.engine.connect())
            if self._autocommit is not None:
                opened.append(self._autocommit.connect())  # the claimer's
        except SQLAlchemyError as exc:
            raise self._store_error(exc) from exc
        finally:
            for conn in opened:
                conn.close()

    def _literal(self, dialect: Dialect) -> LiteralUpsert:
        # Built on first use, from a connected dialect: the upsert's form depends on the server.
        if self._literal_upsert is None:
            self._literal_upsert = LiteralUpsert(dialect)
        return self._literal_upsert

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        committing = False
        try:
            with self.engine.begin() as conn:
                yield conn
                committing = True
        except SQLAlchemyError as exc:
            # A connection lost at the COMMIT leaves the transaction's fate unknown; lost
            # earlier, the server rolled it back.
            raise self._store_error(exc, sent=committing) from exc

    @contextmanager
    def _statements(self) -> Iterator[Connection]:
        """A connection on which each statement commits as it runs, for work whose statements
        are each whole (a claim: its UPDATE takes rows atomically, its SELECT reads back those
        held under its token): one round trip less than `_tx`, which sends a COMMIT. `_tx`
        where there is no autocommit pool (SQLite: no round trips to save)."""
        if self._autocommit is None:
            with self._tx() as conn:
                yield conn
            return
        connected = False
        try:
            with self._autocommit.connect() as conn:
                connected = True
                yield conn
        except SQLAlchemyError as exc:
            raise self._store_error(exc, sent=connected) from exc

    def begin(self) -> Connection:
        """A connection of the pool with a transaction begun, for the caller to commit or roll
        back and close (a transactional handler's); StoreError when the ledger is out of reach."""
        try:
            conn = self.engine.connect()
        except SQLAlchemyError as exc:
            raise self._store_error(exc) from exc
        try:
            conn.begin()
        except SQLAlchemyError as exc:
            conn.close()
            raise self._store_error(exc) from exc
        return conn

    def commit(self, conn: Connection) -> None:
        """Commit what `begin` began; StoreError when that fails (or its answer is lost)."""
        try:
            conn.commit()
        except SQLAlchemyError as exc:
            raise self._store_error(exc) from exc

    def kill_session(self, session_id: int) -> None:
        """End a session of this ledger (`KILL CONNECTION` on MySQL/MariaDB, a backend's
        `pg_terminate_backend` on PostgreSQL): the server rolls its transaction back and
        releases its locks. One already gone is no error."""
        try:
            with self._tx() as conn:
                if self.postgres:
                    conn.exec_driver_sql(f"SELECT pg_terminate_backend({int(session_id)})")
                    return
                conn.exec_driver_sql(f"KILL CONNECTION {int(session_id)}")
        except StoreError as exc:
            if "Unknown thread id" not in str(exc):
                raise

    def _pipelined(self, conn: Connection, statements: Iterable[str]) -> int:
        """Run `statements` in `conn`'s transaction, each one sent before the next is built, so
        that the server runs one while Python builds the next (a bulk create's rows cost about
        as much to build as to insert). Returns their affected rows, summed.

        PyMySQL's `Connection.query` is its `_execute_command` (send) then `next_result` (read
        the reply); here the two are apart. Where a PyMySQL without them is installed
        (`_pipelines` false), each statement is sent and answered in turn. When building the
        next statement raises, the reply in flight is read before the exception goes on (or,
        for an interrupt, the connection is invalidated): the connection's next user must not
        read it as its own.
        Driver errors are wrapped as `exec_driver_sql` wraps them.
        """
        if not self._pipelines:
            run = conn.exec_driver_sql
            return sum(run(sql, execution_options=_NO_PARAMETERS).rowcount for sql in statements)
        dbapi: Any = conn.connection.driver_connection
        send = dbapi._execute_command
        dialect = conn.dialect
        affected = 0
        statements = iter(statements)
        sql = next(statements, None)
        while sql is not None:
            awaiting = False
            try:
                send(COMMAND.COM_QUERY, sql.encode(dbapi.encoding))
                awaiting = True
                following = next(statements, None)
                affected += int(dbapi.next_result())
                awaiting = False
            except dialect.loaded_dbapi.Error as exc:
                raise driver_error(conn, exc, sql) from exc
            except Exception:
                # Building the next statement failed (a request found wrong as it was read):
                # the transaction is rolled back, on a connection whose reply is read first.
                if awaiting:
                    try:
                        dbapi.next_result()
                    except dialect.loaded_dbapi.Error:
                        conn.invalidate()
                raise
            except BaseException:
                if awaiting:
                    conn.invalidate()  # not waiting for a reply when asked to stop
                raise
            sql = following
        return affected

    def _autocommitted(self, build: Callable[[Dialect, Any], str]) -> int:
        """Run the statement `build(dialect, driver_connection)` returns on its own, committed
        by the server as it runs: one round trip, nothing before or after it. Returns its
        affected rows (changed rows: this pool does not ask for found rows).

        Only for a statement that is a whole transaction by itself, and only where
        `self._autocommit` exists. The DBAPI cursor is used directly: a SQLAlchemy `Connection`
        around one statement costs about a fifth of a single create's CPU. Driver errors become
        StoreError as in `_tx`; a connection found dead is discarded from the pool.
        """

        def run(cursor: Any, dialect: Dialect, driver: Any) -> int:
            cursor.execute(build(dialect, driver))
            return int(cursor.rowcount)

        return self._on_raw_autocommit(run)

    def _autocommitted_rows(self, sql: str, params: Mapping[str, Any]) -> list[Any]:
        """`sql` with `params` run as `_autocommitted` runs a statement; returns its rows."""

        def run(cursor: Any, _dialect: Dialect, _driver: Any) -> list[Any]:
            cursor.execute(sql, params)
            return list(cursor.fetchall())

        return self._on_raw_autocommit(run)

    def _autocommitted_named_rows(
        self, sql: str, params: Mapping[str, Any]
    ) -> tuple[tuple[str, ...], list[Any]]:
        """`sql` with `params` run as `_autocommitted` runs a statement; returns its column
        names and its rows (the driver's tuples). The names are read once per statement text:
        psycopg's `cursor.description` builds a `Column` for every column at every call (3 % of
        a PostgreSQL claim's CPU), and a text names its columns (no `SELECT *` comes here)."""
        known = self._column_names

        def run(cursor: Any, _dialect: Dialect, _driver: Any) -> tuple[tuple[str, ...], list[Any]]:
            cursor.execute(sql, params)
            names = known.get(sql)
            if names is None:
                names = tuple(d[0] for d in cursor.description)
                if len(known) < _COLUMN_NAMES_KEPT:
                    known[sql] = names
            return names, list(cursor.fetchall())

        return self._on_raw_autocommit(run)

    def _autocommitted_each(self, sql: str, params_list: Sequence[Mapping[str, Any]]) -> int:
        """`sql` run once with each of `params_list`, as `_autocommitted` runs a statement, on
        one checkout; returns the rows they changed, summed."""

        def run(cursor: Any, _dialect: Dialect, _driver: Any) -> int:
            count = 0
            for params in params_list:
                cursor.execute(sql, params)
                count += int(cursor.rowcount)
            return count

        return self._on_raw_autocommit(run)

    def _on_raw_autocommit(self, run: Callable[[Any, Dialect, Any], R]) -> R:
        engine = self._autocommit
        assert engine is not None
        dialect = engine.dialect
        try:
            raw = engine.raw_connection()
        except SQLAlchemyError as exc:
            raise self._store_error(exc) from exc
        except dialect.loaded_dbapi.Error as exc:
            # A pool's connect raises the driver's own error, unwrapped (engine.connect wraps it).
            wrapped = DBAPIError.instance(
                None,
                None,
                exc,
                dialect.loaded_dbapi.Error,
                connection_invalidated=dialect.is_disconnect(exc, None, None) or not_serving(exc),
                dialect=dialect,
            )
            raise self._store_error(wrapped) from wrapped
        cursor = None
        finished = False
        try:
            cursor = _held_cursor(raw)
            result = run(cursor, dialect, raw.driver_connection)
            finished = True
            return result
        except dialect.loaded_dbapi.Error as exc:
            gone = dialect.is_disconnect(exc, raw.dbapi_connection, cursor) or not_serving(exc)
            if gone:
                _drop_held_cursor(raw, cursor)  # before the record goes back to the pool
                raw.invalidate(exc)
            # No statement text: the error's message (all StoreError shows) is the driver's.
            wrapped = DBAPIError.instance(
                None,
                None,
                exc,
                dialect.loaded_dbapi.Error,
                connection_invalidated=gone,
                dialect=dialect,
            )
            raise self._store_error(wrapped, sent=True) from wrapped
        except BaseException as exc:
            if not isinstance(exc, Exception):
                # Interrupted (a signal's exception, a greenlet killed): the statement may still
                # be running on the connection, which no one may be lent.
                _drop_held_cursor(raw, cursor)
                raw.invalidate()
            raise
        finally:
            if cursor is not None and not finished:
                # A statement that failed may leave the cursor mid-result.
                _drop_held_cursor(raw, cursor)
                cursor.close()
            raw.close()

    def _store_error(self, exc: SQLAlchemyError, *, sent: bool = False) -> StoreError:
        """StoreError for `exc`; `sent`: the statement (or COMMIT) may have reached the server,
        so a lost connection leaves it `maybe_applied`."""
        error = StoreError(f"database {self._url}: {_detail(exc)}")
        error.disconnected = bool(getattr(exc, "connection_invalidated", False))
        # A server that refused to serve (a standby, a Galera node not ready) ran nothing.
        error.maybe_applied = sent and error.disconnected and not not_serving(exc)
        error.lock_timeout = error_code(exc) in _LOCK_WAIT_TIMEOUTS
        return error


def _held_cursor(raw: Any) -> Any:
    """The cursor `raw` (a pooled DBAPI connection) keeps from one checkout to the next.

    A new psycopg cursor, and its close, cost a single create about 25 µs of CPU, a tenth of its
    client's share (its adapters' transformer is built per cursor); PyMySQL's cost less, but the
    same. Kept with the DBAPI connection it belongs to, so a connection the pool replaced (its
    `info` cleared) or swapped never lends another's. It keeps its last statement (and, on
    PyMySQL, that statement's text with a payload in it) until the connection's next use:
    at most a payload per pooled connection.
    """
    found = raw.info.get(_HELD_CURSOR)
    if found is not None and found[0] is raw.dbapi_connection:
        return found[1]
    cursor = raw.cursor()
    raw.info[_HELD_CURSOR] = (raw.dbapi_connection, cursor)
    return cursor


def _drop_held_cursor(raw: Any, cursor: Any) -> None:
    """Forget `raw`'s held cursor if it is `cursor` (not one another checkout has put since)."""
    found = raw.info.get(_HELD_CURSOR)
    if found is not None and found[1] is cursor:
        del raw.info[_HELD_CURSOR]


def _detail(exc: SQLAlchemyError) -> str:
    """The driver's message, its first line; with libpq's multi-host failures (a URL naming a
    primary and its standbys) what each host said."""
    lines = str(getattr(exc, "orig", None) or exc).splitlines() or [""]
    hosts = [line.strip()[2:] for line in lines if line.strip().startswith("- host:")]
    if hosts:
        return "; ".join(["no host took the connection", *hosts])[:800]
    return lines[0][:300]


def like_prefix(text: str) -> str:
    """A LIKE pattern (with `escape="\\"`) matching strings that start with `text`, its own
    `%` and `_` taken literally: a prefix range of an index, never a wildcard from a user."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
