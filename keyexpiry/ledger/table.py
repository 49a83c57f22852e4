"""Table `time_limit_task`: its columns and indexes (sql/time_limit_task.sql says the same), the
engine tuned for it, and the create-or-reschedule upsert."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Engine,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    and_,
    case,
    create_engine,
    event,
    func,
    literal_column,
    null,
    text,
)
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import SQLAlchemyError

from keyexpiry.errors import StoreError
from keyexpiry.ledger.rows import BIGINT_MAX, NewTask, TaskStatus, args_json, schedule_json
from keyexpiry.masking import mask_url, redact
from keyexpiry.tags import TAG_MAX_CHARS

TABLE_NAME = "time_limit_task"
metadata = MetaData()

_ENGINE_INDEXES: dict[str, Callable[[str], bool]] = {
    "ix_time_limit_task_status_attempts": lambda engine: engine != "postgresql",
    "ix_time_limit_task_retrying": lambda engine: engine == "postgresql",
}
"""Indexes only some engines have, by name: which (by dialect name)."""


def index_on(name: str, dialect: Dialect | str) -> bool:
    """Whether the ledger has index `name` on `dialect`'s engine (most indexes: on every one)."""
    engine = dialect if isinstance(dialect, str) else dialect.name
    only_on = _ENGINE_INDEXES.get(name)
    return only_on is None or only_on(engine)


# Keys are escaped to printable ASCII; a binary ASCII collation keeps them case-sensitive and lets
# a 512-byte unique index fit InnoDB's limit. On PostgreSQL the "C" collation compares bytes, and
# lets a B-tree index serve a `LIKE 'prefix%'` (a class's keys) whatever the database's locale.
_KEY_TYPE = (
    String(512)
    .with_variant(mysql.VARCHAR(512, charset="ascii", collation="ascii_bin"), "mysql", "mariadb")
    .with_variant(postgresql.VARCHAR(512, collation="C"), "postgresql")
)
_ID_TYPE = BigInteger().with_variant(Integer(), "sqlite")
_TEXT_TYPE = Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")
# Tags compare byte for byte on every backend, as on SQLite: `Order:1` is not `order:1`.
_TAG_TYPE = (
    String(TAG_MAX_CHARS)
    .with_variant(
        mysql.VARCHAR(TAG_MAX_CHARS, charset="utf8mb4", collation="utf8mb4_bin"),
        "mysql",
        "mariadb",
    )
    .with_variant(postgresql.VARCHAR(TAG_MAX_CHARS, collation="C"), "postgresql")
)

SCHEDULE_NAME_MAX_CHARS = 200
# Schedule names compare byte for byte on every backend, like tags.
_SCHEDULE_NAME_TYPE = (
    String(SCHEDULE_NAME_MAX_CHARS)
    .with_variant(
        mysql.VARCHAR(SCHEDULE_NAME_MAX_CHARS, charset="utf8mb4", collation="utf8mb4_bin"),
        "mysql",
        "mariadb",
    )
    .with_variant(postgresql.VARCHAR(SCHEDULE_NAME_MAX_CHARS, collation="C"), "postgresql")
)

time_limit_task = Table(
    TABLE_NAME,
    metadata,
    Column("id", _ID_TYPE, primary_key=True, autoincrement=True),
    Column("task_key", _KEY_TYPE, nullable=False),
    Column("class_name", String(128), nullable=False),
    Column("method", String(128), nullable=False),
    Column("args", _TEXT_TYPE, nullable=False),
    Column("status", String(16), nullable=False),
    Column("attempts", Integer, nullable=False),
    Column("retry_schedule_s", Text, nullable=True),
    Column("due_at_ms", BigInteger, nullable=False),
    Column("created_at_ms", BigInteger, nullable=False),
    Column("updated_at_ms", BigInteger, nullable=False),
    Column("started_at_ms", BigInteger, nullable=True),
    Column("finished_at_ms", BigInteger, nullable=True),
    Column("claimed_by", String(96), nullable=True),
    Column("lease_until_ms", BigInteger, nullable=True),
    Column("last_error", _TEXT_TYPE, nullable=True),
    # Added after the table: keyexpiry.ledger.migrations adds them to an existing one.
    # The business key business code finds and cancels its tasks by (`create(..., tag=)`).
    Column("tag", _TAG_TYPE, nullable=True),
    # The handler's return value as JSON (NULL: it returned None, or has not succeeded).
    Column("result", _TEXT_TYPE, nullable=True),
    # What travels with the task, as JSON (`create(..., payload=)`; NULL: none): never in the key.
    Column("payload", _TEXT_TYPE, nullable=True),
    # The W3C traceparent of the span that created the task (`keyexpiry.tracing`; NULL: none).
    Column("traceparent", String(55), nullable=True),
    # The schedule whose occurrence this row is (`keyexpiry_schedule.name`; NULL: a plain task):
    # its outcome creates the next occurrence in the same transaction.
    Column("schedule_name", _SCHEDULE_NAME_TYPE, nullable=True),
    # Running rows by lease (expired leases); a dead listener's runs are a filter on this range,
    # which holds only the fleet's runs in flight.
    Index("ix_time_limit_task_status_lease", "status", "lease_until_ms"),
    # Added after the table: keyexpiry.ledger.migrations builds them in an existing one.
    # Every read of one status in due order (the listener's, reconciliation's, the lists'), and
    # reconciliation's walk over pending keys off this index alone (no row lookups).
    Index("ix_time_limit_task_status_due_key", "status", "due_at_ms", "task_key", "attempts"),
    # The dashboard's retrying list: pending rows that failed, without walking every pending row.
    Index("ix_time_limit_task_status_attempts", "status", "attempts", "due_at_ms").ddl_if(
        callable_=lambda *_, dialect, **__: index_on("ix_time_limit_task_status_attempts", dialect)
    ),
    # The same on PostgreSQL, a partial index of those rows alone: the planner took the one above
    # for pending counts by due time (walking every pending row, `attempts` between) and read the
    # retrying list in due order off the main index, skipping the rows that never failed.
    Index(
        "ix_time_limit_task_retrying",
        "due_at_ms",
        "task_key",
        postgresql_where=text(f"status = '{TaskStatus.PENDING.value}' AND attempts > 0"),
    ).ddl_if(callable_=lambda *_, dialect, **__: index_on("ix_time_limit_task_retrying", dialect)),
    # Retention and the dead-task counts: finished rows by finish time (and class), index-only
    # (on PostgreSQL with the id included: its secondary indexes do not hold the primary key).
    Index(
        "ix_time_limit_task_status_finished",
        "status",
        "finished_at_ms",
        "class_name",
        postgresql_include=["id"],
    ),
    # A tag's rows by due time: `list --tag` reads them in order, `cancel_tag` finds them.
    Index("ix_time_limit_task_tag", "tag", "due_at_ms"),
    UniqueConstraint("task_key", name="uq_time_limit_task_key"),
    mysql_engine="InnoDB",
    mysql_charset="utf8mb4",
    # sql/time_limit_task.sql must say the same; tests/test_ddl.py checks that it does.
)
T = time_limit_task

RETIRED_INDEXES: dict[str, str] = {
    # Its prefix: the covering index serves every query it did, ordered by key instead of id.
    "ix_time_limit_task_status_due": "ix_time_limit_task_status_due_key",
    # Only running rows are looked up by claim, and they are the lease index's range.
    "ix_time_limit_task_claimed_by": "ix_time_limit_task_status_lease",
}
"""Indexes of older keyexpiry versions that no query needs any more, each with the index that
replaced it: `keyexpiry init-db` drops one once its replacement exists (each costs every write)."""

LISTENER_TABLE = "keyexpiry_listener"
keyexpiry_listener = Table(
    LISTENER_TABLE,
    metadata,
    # The listener's identity, as in `claimed_by` (host:pid:random; claims add ":N").
    Column("id", String(96), primary_key=True),
    Column("host", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("started_at_ms", BigInteger, nullable=False),
    Column("heartbeat_at_ms", BigInteger, nullable=False),
    Column("running", Integer, nullable=False),
    # Added after the table: keyexpiry.ledger.migrations adds them to an existing one.
    # When it began a graceful stop: peers take its share of the keys, not its runs.
    Column("stopping_at_ms", BigInteger, nullable=True),
    # Its registered task classes, comma-separated: who may be given a class's keys.
    Column("classes", Text, nullable=True),
    Index("ix_keyexpiry_listener_heartbeat", "heartbeat_at_ms"),
    mysql_engine="InnoDB",
    mysql_charset="utf8mb4",
    # sql/keyexpiry_listener.sql must say the same; tests/test_ddl.py checks that it does.
)
"""Live listeners and their last heartbeat: a silent one's runs are taken over."""
L = keyexpiry_listener

PAUSE_TABLE = "keyexpiry_pause"
# Class and method names are ASCII identifiers (`keys.check_name`) and case-sensitive, as in
# Python: compared byte for byte, so pausing `orders` never replaces the pause of `Orders`.
_TARGET_TYPE = (
    String(257)
    .with_variant(mysql.VARCHAR(257, charset="ascii", collation="ascii_bin"), "mysql", "mariadb")
    .with_variant(postgresql.VARCHAR(257, collation="C"), "postgresql")
)
keyexpiry_pause = Table(
    PAUSE_TABLE,
    metadata,
    # "Class" (every method of it) or "Class.method": 128 + 1 + 128 characters at most.
    Column("target", _TARGET_TYPE, primary_key=True),
    # When the pause ends by itself (epoch ms, Redis's clock); NULL: until resumed.
    Column("until_ms", BigInteger, nullable=True),
    Column("paused_at_ms", BigInteger, nullable=False),
    Column("reason", String(255), nullable=True),
    mysql_engine="InnoDB",
    mysql_charset="utf8mb4",
    # sql/keyexpiry_pause.sql must say the same; tests/test_ddl.py checks that it does.
)
"""Task classes and methods paused fleet-wide (`keyexpiry.flow.pauses`): in the ledger, so a pause
outlives every listener's restart."""
P = keyexpiry_pause


_LOCK_WAIT_MAX_S = 5


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


ERROR_HISTORY_MAX_CHARS = 32_000
EARLIER_ERRORS = "\n--- earlier attempts ---\n"
"""Between a failed run's error and the errors of the attempts before it (newest first)."""


def storable_text(text: str | None) -> str | None:
    """`text` (an error message: from a handler's exception, anything) as every ledger can hold
    it: a NUL character, which PostgreSQL's text refuses (the whole record would fail), written
    as the two characters backslash and 0. The same on every engine: an error reads the same
    anywhere."""
    return text.replace("\x00", "\\0") if text is not None and "\x00" in text else text


def with_earlier_errors(new: Any) -> Any:
    """`new` error text followed by the row's earlier ones, capped: a task that keeps failing
    (and one an operator retries) shows every error of its current streak, newest first."""
    return case(
        (T.c.last_error.is_(None), new),
        else_=func.substr(new + EARLIER_ERRORS + T.c.last_error, 1, ERROR_HISTORY_MAX_CHARS),
    )


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
        engine = create_engine(
            url,
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
        return engine
    except ImportError as exc:
        extra = " (pip install 'keyexpiry[postgres]')" if "psycopg" in str(exc) else ""
        raise StoreError(
            f"cannot use database {mask_url(url)}: {redact(str(exc), url)}{extra}"
        ) from None
    except (SQLAlchemyError, ValueError) as exc:
        raise StoreError(f"cannot use database {mask_url(url)}: {redact(str(exc), url)}") from None


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
    try:
        auto = create_engine(
            engine.url,
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
    else:
        event.listen(auto, "do_connect", _changed_rows_only)
        event.listen(auto, "connect", _short_lock_waits)
        event.listen(auto, "connect", _read_committed)
    event.listen(auto, "handle_error", _not_serving_is_a_disconnect)
    # Whoever closes the ledger disposes of its engine; this pool goes with it.
    event.listen(engine, "engine_disposed", lambda _engine: auto.dispose())
    return auto


_RUN_COLUMNS = (
    "started_at_ms", "finished_at_ms", "claimed_by", "lease_until_ms", "last_error", "result",
)  # fmt: skip
"""What a run writes and a create clears (NULL)."""
_RESET_ON_CREATE = (
    "args", "status", "attempts", "retry_schedule_s", "due_at_ms", "created_at_ms",
    "updated_at_ms", *_RUN_COLUMNS, "traceparent",
)  # fmt: skip
"""What creating an existing key resets: it becomes a fresh pending task with a new due time.
Its tag is kept unless the create gives one (`_kept_tag`); `updated_at_ms` always moves on
(`_moved_on`)."""


def _kept_tag(new: Any) -> Any:
    # Tags survive a reschedule: code that moves a task's due time (a debounce) need not know
    # the tag another part of the application gave it, and must not lose it.
    return func.coalesce(new, T.c.tag)


def _kept_payload(new: Any) -> Any:
    # As a tag: a reschedule that gives no payload keeps the one the task has; one that gives a
    # payload replaces it.
    return func.coalesce(new, T.c.payload)


def _moved_on(new: Any) -> Any:
    """`updated_at_ms` of a row a create resets: the create's time, or a millisecond past the
    row's own when that is not earlier.

    So a reset always changes the row. Two creates of a key in one millisecond would otherwise
    write the very values the row holds, and MySQL/MariaDB count such a row 1 in affected rows
    with found rows, as they count an inserted row (0 without): a create on the main pool
    (every bulk create) took the reset for an insert. Changed, it counts 2 either way.

    A CASE, not `greatest(new, updated_at_ms + 1)`: a row written outside keyexpiry may hold
    BIGINT's largest value there, and adding to it fails the create on MySQL/MariaDB ("BIGINT
    out of range") and turns the value REAL on SQLite. Such a row (and one whose time is no
    number at all: SQLite compares text above every number) takes the create's time.
    """
    moved = T.c.updated_at_ms + literal_column("1")
    past_ours = and_(T.c.updated_at_ms >= new, T.c.updated_at_ms < literal_column(str(BIGINT_MAX)))
    return case((past_ours, moved), else_=new)


_FRESH = {
    "status": literal_column(f"'{TaskStatus.PENDING.value}'"),
    "attempts": literal_column("0"),
    **{c: null() for c in _RUN_COLUMNS},
}
"""What a create writes into every row it resets, the same for every task: on MySQL/MariaDB the
update clause sets these as constants, which the server parses and resolves for less than a
`VALUES(col)` each (single creates 1.06x in-process, 1.01-1.03x in `bench --scenario create`),
and an inserted row takes the NULLs as its columns' default."""


def upsert_statement(dialect: str) -> Any:
    """INSERT … ON CONFLICT/DUPLICATE KEY UPDATE for `dialect`, built once per store."""
    if dialect in ("sqlite", "postgresql"):
        ins: Any = sqlite.insert(T) if dialect == "sqlite" else postgresql.insert(T)
        return ins.on_conflict_do_update(
            index_elements=[T.c.task_key],
            set_={
                **{c: ins.excluded[c] for c in _RESET_ON_CREATE},
                # The same rows on every ledger (SQLite tells inserts apart by id, PostgreSQL by
                # the row version `xmax`).
                "updated_at_ms": _moved_on(ins.excluded.updated_at_ms),
                "tag": _kept_tag(ins.excluded.tag),
                "payload": _kept_payload(ins.excluded.payload),
            },
        )
    # Every inserted column a bound value: PyMySQL folds an executemany into multi-row INSERTs
    # only when the VALUES clause holds nothing but placeholders (a literal there means a round
    # trip a row). The update clause is not part of that fold: its constants cost nothing there.
    mins = mysql.insert(T)
    return mins.on_duplicate_key_update(
        {
            **{c: _FRESH.get(c, mins.inserted[c]) for c in _RESET_ON_CREATE},
            "updated_at_ms": _moved_on(mins.inserted.updated_at_ms),
            "tag": _kept_tag(mins.inserted.tag),
            "payload": _kept_payload(mins.inserted.payload),
        }
    )


_LITERAL_COLUMNS = (
    "task_key", "class_name", "method", "args", "status", "attempts", "retry_schedule_s",
    "due_at_ms", "created_at_ms", "updated_at_ms", "tag", "payload", "traceparent",
)  # fmt: skip
"""The columns `LiteralUpsert.statements` writes, in the order of its row literal (the run
columns are left to their default, NULL: a shorter row for the server to parse)."""
_ONE_ROW = re.compile(r"(INSERT INTO .*? VALUES )\(((?:%\(\w+\)s, )*%\(\w+\)s)\)(.*)", re.DOTALL)

LITERAL_STATEMENT_MAX_BYTES = 1_000_000
"""A bulk upsert is cut into statements of at most this size, as PyMySQL cuts its own multi-row
INSERTs: below the smallest `max_allowed_packet` a server is likely to have (1 MiB)."""
PIPELINED_STATEMENT_BYTES = 128_000
"""The statement size of a bulk create's upsert (about 1,000 rows): small enough that building
the next statement overlaps most of the server's work on this one (`Ledger._pipelined`), large
enough that a round trip per statement costs nothing measurable."""


class LiteralUpsert:
    """The MySQL/MariaDB upsert that `upsert_statement` renders, with its rows written into
    VALUES here instead of bound by the driver (PyMySQL).

    PyMySQL escapes each of the 17 bound values of a row in Python, through a type dispatch: most
    of a bulk create's time. Here a row is one f-string: the caller's strings (key, names,
    arguments, schedule) escaped by the connection itself (which follows the server's
    NO_BACKSLASH_ESCAPES), numbers formatted as integers, and the constants of a fresh pending row
    written as literals. The statement is SQLAlchemy's, so the ON DUPLICATE KEY UPDATE clause
    (`VALUES(col)`, or the `AS new` alias on MySQL 8) is exactly what the bound upsert sends.
    """

    def __init__(self, dialect: Dialect) -> None:
        # Rendered by the dialect of a connected engine: the upsert's form depends on the server.
        sql = str(
            upsert_statement(dialect.name).compile(
                dialect=dialect, column_keys=list(_LITERAL_COLUMNS)
            )
        )
        match = _ONE_ROW.fullmatch(sql)
        names = re.findall(r"%\((\w+)\)s", match.group(2)) if match else []
        if (
            match is None
            or tuple(names) != _LITERAL_COLUMNS
            or "%" in match.group(1) + match.group(3)
        ):
            raise StoreError(f"unexpected form of the upsert statement: {sql[:300]}")
        self._head, self._tail = match.group(1), match.group(3)
        self._pending = "'" + TaskStatus.PENDING.value + "'"

    def one(self, escape: Callable[[str], str], task: NewTask, now_ms: int) -> str:
        """The statement that inserts or resets `task` alone."""
        return self._head + self._row(escape, task, int(now_ms), {}) + self._tail

    def _row(
        self, escape: Callable[[str], str], t: NewTask, now: int, names: dict[tuple[str, str], str]
    ) -> str:
        # A bulk create is mostly of one or a few task methods: their names are quoted once.
        quoted = names.get((t.class_name, t.method))
        if quoted is None:
            quoted = names[t.class_name, t.method] = f"{escape(t.class_name)},{escape(t.method)}"
        schedule = schedule_json(t.retry_schedule_s)
        return (
            f"({escape(t.key)},{quoted},{escape(args_json(t.args))},{self._pending},0,"
            f"{'NULL' if schedule is None else escape(schedule)},{int(t.due_at_ms)},"
            f"{now},{now},{'NULL' if t.tag is None else escape(t.tag)},"
            f"{'NULL' if t.payload is None else escape(t.payload)},"
            f"{'NULL' if t.traceparent is None else escape(t.traceparent)})"
        )

    def statements(
        self,
        escape: Callable[[str], str],
        tasks: Iterable[NewTask],
        now_ms: int,
        max_bytes: int = LITERAL_STATEMENT_MAX_BYTES,
    ) -> Iterator[str]:
        """The statements that insert or reset `tasks` as pending: as few as fit `max_bytes`.

        `escape` turns a string into a quoted SQL literal: the driver connection's `escape`.
        """
        now = int(now_ms)
        names: dict[tuple[str, str], str] = {}
        rows: list[str] = []
        size = len(self._head) + len(self._tail)
        row_of = self._row
        for t in tasks:
            row = row_of(escape, t, now, names)
            n = (len(row) if row.isascii() else len(row.encode())) + 1
            if rows and size + n > max_bytes:
                yield self._head + ",".join(rows) + self._tail
                rows, size = [], len(self._head) + len(self._tail)
            rows.append(row)
            size += n
        if rows:
            yield self._head + ",".join(rows) + self._tail


_ARRAY_COLUMNS = (
    ("task_key", "k", "varchar"),
    ("class_name", "c", "varchar"),
    ("method", "m", "varchar"),
    ("args", "a", "text"),
    ("retry_schedule_s", "r", "text"),
    ("due_at_ms", "d", "bigint"),
    ("tag", "t", "varchar"),
    ("payload", "p", "text"),
    ("traceparent", "tp", "varchar"),
)
"""The columns a PostgreSQL bulk upsert takes per task, each as an array parameter: (column,
parameter, element type)."""


def array_upsert_sql() -> str:
    """PostgreSQL's create-or-reset of many tasks in one statement: one array per column
    (`_ARRAY_COLUMNS`, plus `now`), unnested into rows, the same ON CONFLICT rule as
    `upsert_statement`, and each row's key and whether it was inserted (`xmax` is 0 only in a
    row version nobody has replaced or locked, as in one just inserted).

    Ten parameters whatever the number of tasks: psycopg adapts a list as one array (in C),
    where a multi-row VALUES binds and casts 17 values a row; the same text for one task or
    thousands, so psycopg prepares it on the server once it has run a few times.
    """
    compiled = str(upsert_statement("postgresql").compile(dialect=postgresql.dialect()))  # type: ignore[no-untyped-call]
    conflict = compiled[compiled.index(" ON CONFLICT ") :]
    if "%(" in conflict:
        raise StoreError(f"unexpected parameter in the upsert's update: {conflict[:300]}")
    columns = ", ".join(c for c, _, _ in _ARRAY_COLUMNS)
    values = ", ".join(f"u.{p}" for _, p, _ in _ARRAY_COLUMNS)
    # Binary parameters (`%b`): a text-format array quotes and escapes every element in Python
    # (a 1 KB JSON payload cost 120 us a row that way, 2.5 us in binary).
    arrays = ", ".join(f"%({p})b::{t}[]" for _, p, t in _ARRAY_COLUMNS)
    names = ", ".join(p for _, p, _ in _ARRAY_COLUMNS)
    return (
        f"INSERT INTO {TABLE_NAME} ({columns}, status, attempts, created_at_ms, updated_at_ms) "
        f"SELECT {values}, '{TaskStatus.PENDING.value}', 0, %(now)s::bigint, %(now)s::bigint "
        f"FROM unnest({arrays}) AS u({names})"
        f"{conflict} RETURNING {TABLE_NAME}.task_key, ({TABLE_NAME}.xmax = 0) AS inserted"
    )


def array_upsert_params(tasks: Iterable[NewTask], now_ms: int) -> dict[str, Any]:
    """`array_upsert_sql`'s parameters for `tasks` (no key twice: one statement may not touch a
    row twice)."""
    k: list[str] = []
    c: list[str] = []
    m: list[str] = []
    a: list[str] = []
    r: list[str | None] = []
    d: list[int] = []
    t: list[str | None] = []
    p: list[str | None] = []
    tp: list[str | None] = []
    for task in tasks:
        k.append(task.key)
        c.append(task.class_name)
        m.append(task.method)
        a.append(args_json(task.args))
        r.append(schedule_json(task.retry_schedule_s))
        d.append(int(task.due_at_ms))
        t.append(task.tag)
        p.append(task.payload)
        tp.append(task.traceparent)
    return {
        "k": k, "c": c, "m": m, "a": a, "r": r, "d": d, "t": t, "p": p, "tp": tp,
        "now": int(now_ms),
    }  # fmt: skip


SCHEDULE_TABLE = "keyexpiry_schedule"
keyexpiry_schedule = Table(
    SCHEDULE_TABLE,
    metadata,
    Column("name", _SCHEDULE_NAME_TYPE, primary_key=True),
    # The task each occurrence runs: its row in time_limit_task has this key (one per schedule).
    Column("task_key", _KEY_TYPE, nullable=False),
    Column("class_name", String(128), nullable=False),
    Column("method", String(128), nullable=False),
    Column("args", _TEXT_TYPE, nullable=False),
    # When: a cron expression in `tz`, or every `every_ms` from `start_ms` (else `anchor_ms`).
    Column("cron", String(200), nullable=True),
    Column("every_ms", BigInteger, nullable=True),
    Column("tz", String(64), nullable=False),
    Column("start_ms", BigInteger, nullable=True),
    Column("end_ms", BigInteger, nullable=True),
    Column("anchor_ms", BigInteger, nullable=False),
    Column("catch_up", String(8), nullable=False),
    Column("catch_up_max", Integer, nullable=False),
    Column("overlap", String(8), nullable=False),
    Column("retry_schedule_s", Text, nullable=True),
    Column("paused", Integer, nullable=False),
    # The occurrence the task row stands for (NULL: the schedule has ended).
    Column("occurrence_ms", BigInteger, nullable=True),
    Column("last_scheduled_for_ms", BigInteger, nullable=True),
    Column("last_status", String(16), nullable=True),
    Column("last_finished_ms", BigInteger, nullable=True),
    Column("last_success_ms", BigInteger, nullable=True),
    Column("last_error", _TEXT_TYPE, nullable=True),
    # "code" (an @exposed(cron=…) method) or "api" (`Client.schedule`).
    Column("source", String(8), nullable=False),
    Column("created_at_ms", BigInteger, nullable=False),
    Column("updated_at_ms", BigInteger, nullable=False),
    UniqueConstraint("task_key", name="uq_keyexpiry_schedule_task_key"),
    mysql_engine="InnoDB",
    mysql_charset="utf8mb4",
    # sql/keyexpiry_schedule.sql must say the same; tests/test_ddl.py checks that it does.
)
"""Recurring schedules (`keyexpiry.schedules`): what runs when, and how the last run went. Each
has one row in time_limit_task at a time, its next occurrence."""
S = keyexpiry_schedule
