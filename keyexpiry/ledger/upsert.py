"""Creating or rescheduling tasks in table `time_limit_task`: the upsert statement of each
engine (`upsert_statement`), the multi-row literal statements of a MySQL/MariaDB bulk create
(`LiteralUpsert`) and PostgreSQL's array upsert (and its one-task form)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from sqlalchemy import (
    and_,
    case,
    func,
    literal_column,
    null,
)
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Dialect

from keyexpiry.errors import StoreError
from keyexpiry.ledger.rows import BIGINT_MAX, NewTask, TaskStatus, args_json, schedule_json
from keyexpiry.ledger.table import TABLE_NAME, T

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


def _upsert_conflict_clause() -> str:
    compiled = str(upsert_statement("postgresql").compile(dialect=postgresql.dialect()))  # type: ignore[no-untyped-call]
    conflict = compiled[compiled.index(" ON CONFLICT ") :]
    if "%(" in conflict:
        raise StoreError(f"unexpected parameter in the upsert's update: {conflict[:300]}")
    return f"{conflict} RETURNING {TABLE_NAME}.task_key, ({TABLE_NAME}.xmax = 0) AS inserted"


def scalar_upsert_sql() -> str:
    """`array_upsert_sql` for one task: a value per column, no arrays.

    What a single create runs on PostgreSQL: psycopg builds each array parameter in Python
    (about 170 µs for the ten of one task, half a single create's client CPU), a plain value
    costs it next to nothing.
    """
    columns = ", ".join(c for c, _, _ in _ARRAY_COLUMNS)
    values = ", ".join(f"%({p})s::{t}" for _, p, t in _ARRAY_COLUMNS)
    return (
        f"INSERT INTO {TABLE_NAME} ({columns}, status, attempts, created_at_ms, updated_at_ms) "
        f"VALUES ({values}, '{TaskStatus.PENDING.value}', 0, %(now)s::bigint, %(now)s::bigint)"
        f"{_upsert_conflict_clause()}"
    )


def scalar_upsert_params(task: NewTask, now_ms: int) -> dict[str, Any]:
    """`scalar_upsert_sql`'s parameters for `task`."""
    return {
        "k": task.key, "c": task.class_name, "m": task.method, "a": args_json(task.args),
        "r": schedule_json(task.retry_schedule_s), "d": int(task.due_at_ms), "t": task.tag,
        "p": task.payload, "tp": task.traceparent, "now": int(now_ms),
    }  # fmt: skip


def array_upsert_sql() -> str:
    """PostgreSQL's create-or-reset of many tasks in one statement: one array per column
    (`_ARRAY_COLUMNS`, plus `now`), unnested into rows, the same ON CONFLICT rule as
    `upsert_statement`, and each row's key and whether it was inserted (`xmax` is 0 only in a
    row version nobody has replaced or locked, as in one just inserted).

    Ten parameters whatever the number of tasks: psycopg adapts a list as one array (in C),
    where a multi-row VALUES binds and casts 17 values a row; the same text for one task or
    thousands, so psycopg prepares it on the server once it has run a few times.
    """
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
        f"{_upsert_conflict_clause()}"
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
