"""The ledger's engine: how each database is connected and tuned (SQLite in WAL mode, MySQL/
MariaDB and PostgreSQL in READ COMMITTED with short lock waits), and what a driver's error code
says (`error_code`, `not_serving`)."""

from __future__ import annotations

import os
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import (
    Engine,
    create_engine,
    event,
    make_url,
)
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError

from keyexpiry.errors import StoreError
from keyexpiry.masking import mask_url, redact

_LOCK_WAIT_MAX_S = 5
UNACKED_S = 5
"""How long a statement's bytes may go unacknowledged by the server's machine before the
connection is given up (TCP_USER_TIMEOUT). Only a path that drops packets gets there: a server
that is merely slow or paused still has its kernel acknowledge them. Without it a connection
caught by a network partition waits out TCP's retransmission backoff after the network heals
(up to two minutes between tries): after a 27 s partition from the ledger a listener ran
tasks again 28 s after the heal (`tests/faults/test_network_faults.py`), now within 1.5 s."""
CONNECT_TIMEOUT_S = 5
"""A connection attempt's limit, when the URL sets none (libpq waits for ever, PyMySQL 10 s):
attempts made during a partition end, and the next one after the heal gets through at once."""
KEEPALIVE_S = 5
"""Idle seconds before a ledger connection is probed: a statement whose question the server's
machine acknowledged but whose answer the network lost is given up after this plus
`UNACKED_S`, not after the system's two hours. Probes are answered by the server's kernel, so a
long statement is never mistaken for a dead link."""


def error_code(exc: BaseException | None) -> int | str | None:
    """The error behind `exc` (a SQLAlchemy error or the driver's own): MySQL/MariaDB's number
    (PyMySQL puts it first in `args`) or PostgreSQL's SQLSTATE (psycopg's `sqlstate`). The
    number first: PyMySQL 1.2 sets a `sqlstate` too, as vague as `HY000` for a lock wait
    timeout."""
    orig = getattr(exc, "orig", None) or exc
    args = getattr(orig, "args", ())
    if args and isinstance(args[0], int):
        return args[0]
    sqlstate = getattr(orig, "sqlstate", None)
    return sqlstate if isinstance(sqlstate, str) else None


# A server that cannot take statements on this connection, whatever the statement: a Galera node
# cut off from its cluster's primary component ("WSREP has not yet prepared node for application
# use", 1047), a PostgreSQL standby (25006: read-only transaction, e.g. a failover's old primary
# come back as one) or a server shutting down (57P01-57P03). The connection is no use: it counts
# as disconnected, so the pool drops it and a new one goes where the proxy or the multi-host URL
# points now, and the statement is retried once like any other on a dead connection.
_SERVER_NOT_SERVING: frozenset[int | str] = frozenset({1047, "25006", "57P01", "57P02", "57P03"})


def not_serving(exc: BaseException | None) -> bool:
    """Whether `exc` says its connection's server takes no statements (`_SERVER_NOT_SERVING`)."""
    return error_code(exc) in _SERVER_NOT_SERVING


def _not_serving_is_a_disconnect(context: Any) -> None:
    # SQLAlchemy's own hook: a disconnect invalidates the connection (and the pool's older ones).
    if not_serving(context.original_exception):
        context.is_disconnect = True


def make_engine(url: str) -> Engine:
    """An engine tuned for the ledger: SQLite in WAL mode with a busy timeout; MySQL/MariaDB and
    PostgreSQL in READ COMMITTED with short lock waits.

    A PostgreSQL URL without a driver (`postgresql://`, or Heroku's `postgres://`) means psycopg
    3, the driver keyexpiry is tested with (SQLAlchemy's own default would be psycopg2)."""
    url = postgres_driver(url)
    try:
        if url.startswith("sqlite"):
            engine = create_engine(
                url, connect_args={"timeout": 30, "check_same_thread": False}, pool_size=10
            )

            @event.listens_for(engine, "connect")
            def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
                cur = dbapi_conn.cursor()
                # WAL lets the CLI read while the listener writes; NORMAL sync is safe in WAL.
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=NORMAL")
                cur.close()

            return engine
        connect_args = _network_timeouts(url)
        engine = create_engine(
            url,
            connect_args=connect_args,
            # No pre-ping (a round trip per checkout, on every create and claim): a statement
            # that finds its connection dead is retried once on a fresh one instead (see
            # `_retried`); every statement here is safe to repeat.
            pool_pre_ping=False,
            pool_reset_on_return=None,  # engine.begin() always ends the transaction itself
            pool_recycle=1800,
            pool_size=10,
            # Claims touch only the rows they name; READ COMMITTED avoids gap locks between
            # listeners claiming neighbouring keys.
            isolation_level="READ COMMITTED",
        )

        event.listen(engine, "connect", _session_setup(engine.dialect.name))
        event.listen(engine, "handle_error", _not_serving_is_a_disconnect)
        if _shares_tls(engine):
            event.listen(engine, "do_connect", _share_tls_context)
        _bounded_handshake(engine, connect_args)
        return engine
    except ImportError as exc:
        extra = " (pip install 'keyexpiry[postgres]')" if "psycopg" in str(exc) else ""
        raise StoreError(
            f"cannot use database {mask_url(url)}: {redact(str(exc), url)}{extra}"
        ) from None
    except (SQLAlchemyError, ValueError) as exc:
        raise StoreError(f"cannot use database {mask_url(url)}: {redact(str(exc), url)}") from None


def _network_timeouts(url: str | URL) -> dict[str, Any]:
    """The driver's connect arguments for `UNACKED_S`, `CONNECT_TIMEOUT_S` and `KEEPALIVE_S`,
    each only where neither the URL nor libpq's environment sets its own: psycopg's (libpq's
    keywords; `tcp_user_timeout` from libpq 12) and PyMySQL's `connect_timeout`, with its
    `read_timeout` and `write_timeout` for the handshake only (`_bounded_handshake`). PyMySQL has
    no keyword for the others: its socket gets them at connect (`_unacked_limit`). Another
    driver gets nothing (it may not know the keywords)."""
    parsed = make_url(url)
    driver = parsed.get_driver_name()
    wanted: dict[str, Any] = {}
    if driver == "pymysql":
        wanted["connect_timeout"] = CONNECT_TIMEOUT_S
        # PyMySQL's connect_timeout ends at the TCP connect: a server (or a network) that goes
        # quiet after it, in the handshake (TLS's included: PyMySQL waits on it with the write
        # timeout) or the session's setup, would hold the connect for ever. Reads and writes
        # time out until the connection is set up; `_bounded_handshake` then lifts it.
        wanted["read_timeout"] = CONNECT_TIMEOUT_S
        wanted["write_timeout"] = CONNECT_TIMEOUT_S
    elif driver == "psycopg" and "service" not in parsed.query:
        from psycopg import pq

        if "PGCONNECT_TIMEOUT" not in os.environ:
            wanted["connect_timeout"] = CONNECT_TIMEOUT_S
        if pq.version() >= 120000:
            wanted["tcp_user_timeout"] = UNACKED_S * 1000  # ms
        # An answer lost after its question was acknowledged is found by keepalive probes,
        # which are unacknowledged bytes too: gone after KEEPALIVE_S + UNACKED_S.
        wanted.update(keepalives=1, keepalives_idle=KEEPALIVE_S, keepalives_interval=1)
    return {k: v for k, v in wanted.items() if k not in parsed.query}


def _bounded_handshake(engine: Engine, connect_args: dict[str, Any]) -> None:
    """Lift the read and write timeouts `_network_timeouts` set for the handshake (a URL's own
    stay) once a connection is set up. Registered after every other `connect` listener, so
    the session's setup statements are bounded too."""
    lifted = [name for name in ("read_timeout", "write_timeout") if name in connect_args]
    if not lifted:
        return

    def set_up(dbapi_conn: Any, _record: Any) -> None:
        # PyMySQL sets its socket's timeout from these before each read and write.
        for name in lifted:
            setattr(dbapi_conn, f"_{name}", None)

    event.listen(engine, "connect", set_up)


def _unacked_limit(dbapi_conn: Any) -> None:
    """PyMySQL's socket: `UNACKED_S` and keepalive probes after `KEEPALIVE_S` idle (Linux)."""
    sock = getattr(dbapi_conn, "_sock", None)
    if sock is None or sock.family == socket.AF_UNIX or not hasattr(socket, "TCP_USER_TIMEOUT"):
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, UNACKED_S * 1000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)


def postgres_driver(url: str) -> str:
    """`url` with psycopg 3 named as its driver when it names PostgreSQL without one."""
    for bare in ("postgresql://", "postgres://"):
        if url.startswith(bare):
            return "postgresql+psycopg://" + url[len(bare) :]
    return url


def _short_lock_waits(dbapi_conn: Any, _record: Any) -> None:
    # keyexpiry's own transactions hold row locks for milliseconds: waiting the server's default
    # 50 s on a row someone else locked would stall the claimer for that long (and again when it
    # claims around the lock). A lower server setting is kept.
    _unacked_limit(dbapi_conn)
    cur = dbapi_conn.cursor()
    cur.execute(
        "SET SESSION innodb_lock_wait_timeout = "
        f"LEAST(@@GLOBAL.innodb_lock_wait_timeout, {_LOCK_WAIT_MAX_S})"
    )
    cur.close()


def _short_lock_waits_pg(dbapi_conn: Any, _record: Any) -> None:
    # As `_short_lock_waits`, with PostgreSQL's `lock_timeout` (0: wait for ever). Committed:
    # psycopg runs it in a transaction, whose rollback on return to the pool would undo it.
    cur = dbapi_conn.cursor()
    cur.execute(
        "SELECT set_config('lock_timeout', CASE WHEN current_setting('lock_timeout')::interval"
        f" BETWEEN interval '1 ms' AND interval '{_LOCK_WAIT_MAX_S} s'"
        f" THEN current_setting('lock_timeout') ELSE '{_LOCK_WAIT_MAX_S}s' END, false)"
    )
    cur.close()
    if not dbapi_conn.autocommit:
        dbapi_conn.commit()


def _rows_by_index_pg(dbapi_conn: Any, _record: Any) -> None:
    # The statements of this pool (a create, a claim, its outcomes) find their rows by key or
    # id, and psycopg prepares each after five runs; PostgreSQL then keeps a generic plan for
    # the connection's life, re-planned only when the table's statistics change. Planned on a
    # new ledger, never analyzed and so taken for 10 pages, that plan was a Seq Scan, and it
    # stayed one, a little slower with every row added, until the first autoanalyze a minute
    # later (the Patroni soak's first minute: claims and outcomes 16-54 ms, start p99 12 -> 43
    # ms). With sequential scans priced out here the plan is an index lookup at any size.
    # And that generic plan is the one used from the first prepared run on: left to choose,
    # PostgreSQL judged the claim's generic plan dearer than its custom ones and planned every
    # claim again, most of a claim's server time (a claim of two keys: 140 -> 65 µs of server
    # CPU a task, an outcome's 80 -> 58, with the plan forced). Every statement of this pool
    # finds its rows by key or id, so no value of a parameter calls for another plan.
    cur = dbapi_conn.cursor()
    cur.execute(
        "SELECT set_config('enable_seqscan', 'off', false),"
        " set_config('plan_cache_mode', 'force_generic_plan', false)"
    )
    cur.close()
    if not dbapi_conn.autocommit:
        dbapi_conn.commit()


def _session_setup(dialect: str) -> Callable[[Any, Any], None]:
    """The settings a new connection of `dialect`'s server gets (`_short_lock_waits`)."""
    return _short_lock_waits_pg if dialect == "postgresql" else _short_lock_waits


def _read_committed(dbapi_conn: Any, _record: Any) -> None:
    # As on the main pool (whose isolation_level says so): an upsert takes no gap locks.
    cur = dbapi_conn.cursor()
    cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
    cur.close()


_CLIENT_FOUND_ROWS = 2
"""The MySQL protocol's capability flag that makes affected rows count matched rows."""


def _changed_rows_only(_dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
    # SQLAlchemy asks every MySQL connection for found rows. Without it, a statement's affected
    # rows are the rows it changed. (The upsert counts 1 inserted, 2 updated either way: its
    # update always changes the row, `_moved_on`; that is how a single create knows whether
    # its key was new, in its one round trip.)
    cparams["client_flag"] = int(cparams.get("client_flag", 0)) & ~_CLIENT_FOUND_ROWS


_shared_tls: ssl.SSLContext | None = None
_shared_tls_lock = threading.Lock()
_pymysql_class: Any = None


def _pymysql_connection_class() -> Any:
    """PyMySQL's Connection with one TLS context for every connection made without TLS options.

    Given no TLS options, PyMySQL (2.x) tries TLS if the server offers it ("preferred") and
    builds a context for that on every connection, loading the system's CA bundle each time:
    20-260 ms of CPU per connection measured here, paid by every connection a pool opens and by
    all of them at once after a database restart, and a step in the listener's RSS each time
    (the soak's, issue 42). That context verifies nothing (no CA given, no hostname check) and
    is never changed after it is built, so one serves them all. A connection given TLS options
    builds its own, as PyMySQL does.
    """
    global _pymysql_class
    if _pymysql_class is None:
        from pymysql.connections import Connection

        class SharedTlsContextConnection(Connection):  # type: ignore[misc]
            def _create_ssl_ctx(self, sslp: Any) -> Any:
                global _shared_tls
                if sslp:
                    return super()._create_ssl_ctx(sslp)
                with _shared_tls_lock:
                    if _shared_tls is None:
                        _shared_tls = super()._create_ssl_ctx({})
                    return _shared_tls

        _pymysql_class = SharedTlsContextConnection
    return _pymysql_class


def _share_tls_context(_dialect: Any, _record: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
    # Registered last among `do_connect` listeners: the connection made here is the one used.
    return _pymysql_connection_class()(*cargs, **cparams)


def _shares_tls(engine: Engine) -> bool:
    """Whether connections of `engine` can share one TLS context (PyMySQL with the method it
    overrides: a private one, so checked rather than trusted)."""
    if engine.dialect.driver != "pymysql":
        return False
    from pymysql.connections import Connection

    return callable(getattr(Connection, "_create_ssl_ctx", None))


def autocommit_engine(engine: Engine) -> Engine | None:
    """A second pool on `engine`'s MySQL/MariaDB or PostgreSQL database whose connections stay in
    autocommit, for statements that are a whole transaction by themselves (creating one task).

    On the main pool such a statement costs two round trips (it, then COMMIT); here it costs
    one, and returning the connection sends nothing (no ROLLBACK). Switching a pooled connection
    to autocommit and back would cost more round trips than it saves (psycopg sends a BEGIN of its
    own before a transaction's first statement: three round trips saved to one). None on SQLite
    (no round trips to save) and on SQLAlchemy before 2.0.43 (no `skip_autocommit_rollback`:
    closing the connection would send a ROLLBACK, as costly as the COMMIT saved).
    """
    if engine.dialect.name == "sqlite":
        return None
    connect_args = _network_timeouts(engine.url)
    try:
        auto = create_engine(
            engine.url,
            connect_args=connect_args,
            pool_pre_ping=False,  # as on the main pool: a dead connection is retried instead
            pool_reset_on_return=None,
            pool_recycle=1800,
            pool_size=10,
            isolation_level="AUTOCOMMIT",
            skip_autocommit_rollback=True,
        )
    except TypeError:
        return None
    if engine.dialect.name == "postgresql":
        # READ COMMITTED is PostgreSQL's default, and each statement here is a transaction.
        event.listen(auto, "connect", _short_lock_waits_pg)
        event.listen(auto, "connect", _rows_by_index_pg)
    else:
        event.listen(auto, "do_connect", _changed_rows_only)
        if _shares_tls(auto):
            event.listen(auto, "do_connect", _share_tls_context)
        event.listen(auto, "connect", _short_lock_waits)
        event.listen(auto, "connect", _read_committed)
    _bounded_handshake(auto, connect_args)
    event.listen(auto, "handle_error", _not_serving_is_a_disconnect)
    # Whoever closes the ledger disposes of its engine; this pool goes with it.
    event.listen(engine, "engine_disposed", lambda _engine: auto.dispose())
    return auto
