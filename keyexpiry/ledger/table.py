"""The ledger's tables: `time_limit_task` (its columns and indexes; sql/time_limit_task.sql says
the same), `keyexpiry_listener`, `keyexpiry_pause` and `keyexpiry_schedule`, and how an error is
stored in a row. The engine is `ledger/engine.py`; the create-or-reschedule upsert,
`ledger/upsert.py`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    case,
    func,
    text,
)
from sqlalchemy.dialects import mysql, postgresql
from sqlalchemy.engine import Dialect

from keyexpiry.ledger.rows import TaskStatus
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
