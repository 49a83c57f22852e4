"""Every query keyexpiry runs against the ledger (`time_limit_task`), each raising StoreError,
never a driver exception.

SQLAlchemy Core, no ORM: the hot paths are a handful of set-based statements (claim a batch of keys,
record a batch of outcomes), and Core keeps them explicit and cheap.

Long because `Store` is the single facade over every query family (it mixes them in); its own
queries are business code's reads and the schema.
"""

from __future__ import annotations

import heapq
import itertools
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence

from loguru import logger
from sqlalchemy import (
    ColumnElement,
    Connection,
    and_,
    func,
    inspect,
    or_,
    select,
    update,
)
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from keyexpiry.errors import StoreError
from keyexpiry.ledger.base import retried_once, worth_retrying
from keyexpiry.ledger.claims import ClaimQueries
from keyexpiry.ledger.engine import make_engine
from keyexpiry.ledger.heartbeats import HeartbeatQueries
from keyexpiry.ledger.if_exists import Did, IfExists, ScheduleQueries
from keyexpiry.ledger.lookups import LookupQueries
from keyexpiry.ledger.migrations import (
    BUILD_ON_START_MAX_ROWS,
    add_missing_columns,
    add_missing_indexes,
    drop_invalid_indexes,
    drop_retired_indexes,
    missing_indexes,
)
from keyexpiry.ledger.outcomes import OutcomeQueries
from keyexpiry.ledger.pauses import PauseQueries
from keyexpiry.ledger.reading import row_from_db as _row
from keyexpiry.ledger.recurring import RecurringQueries
from keyexpiry.ledger.retention import RetentionQueries
from keyexpiry.ledger.rows import NewTask, Outcome, TaskRow, TaskStatus
from keyexpiry.ledger.scans import ScanQueries, unknown_status
from keyexpiry.ledger.table import TABLE_NAME, T, metadata, time_limit_task
from keyexpiry.ledger.transactions import database_identity
from keyexpiry.ledger.upsert import (
    PIPELINED_STATEMENT_BYTES,
    array_upsert_params,
    array_upsert_sql,
    scalar_upsert_params,
    scalar_upsert_sql,
)

__all__ = [
    "TABLE_NAME",
    "NewTask",
    "Outcome",
    "Store",
    "T",
    "TaskRow",
    "TaskStatus",
    "make_engine",
    "metadata",
    "time_limit_task",
]


def _distinct_keys(tasks: Sequence[NewTask]) -> Iterator[list[NewTask]]:
    """`tasks` in groups where no key appears twice, in order (all of them, usually, at once)."""
    rest = list(tasks)
    while rest:
        seen: set[str] = set()
        group: list[NewTask] = []
        later: list[NewTask] = []
        for t in rest:
            (later if t.key in seen else group).append(t)
            seen.add(t.key)
        yield group
        rest = later


class _Mixed(Exception):
    """A bulk create found some keys new and some existing: which, its affected rows cannot say."""


class Store(
    ScheduleQueries,
    ClaimQueries,
    OutcomeQueries,
    ScanQueries,
    LookupQueries,
    HeartbeatQueries,
    PauseQueries,
    RecurringQueries,
    RetentionQueries,
):
    """Queries on `time_limit_task`; every method raises StoreError, never a driver exception.

    Business code's queries (create, cancel, read) and the schema are here; the listener's are in
    `ClaimQueries` and `OutcomeQueries`, reconciliation's in `ScanQueries`, the pauses' in
    `PauseQueries`.
    """

    # --- schema -------------------------------------------------------------------------------
    @retried_once
    def create_schema(self, *, all_indexes: bool = False) -> list[str]:
        """Create the tables and indexes if they do not exist; add columns and indexes a table
        from an older keyexpiry lacks (`keyexpiry.ledger.migrations`). Idempotent; rows are never
        rewritten.

        A missing index of a big table is built only with `all_indexes` (`keyexpiry init-db`):
        a client or listener start logs it and goes on. Returns the indexes so left unbuilt.
        `all_indexes` also drops the indexes a later version retired (`RETIRED_INDEXES`).
        """
        for attempt in range(5):
            try:
                with self._schema_lock, self._tx() as conn:
                    metadata.create_all(conn, checkfirst=True)
                with self._schema_lock, self._tx() as conn:
                    for name in add_missing_columns(conn):
                        logger.info("ledger upgraded: added column {}", name)
                max_rows = None if all_indexes else BUILD_ON_START_MAX_ROWS
                if self.postgres:
                    with self._schema_lock, self._tx() as conn:
                        lacking = any(missing_indexes(conn, t) for t in metadata.sorted_tables)
                    built: list[str] = []
                    deferred: list[str] = []
                    if lacking or all_indexes:
                        # Concurrently, outside a transaction: a plain build blocks every write.
                        # (Only then on the autocommit pool: a start that builds nothing
                        # leaves no connection there, to go stale before its first use.)
                        with self._schema_lock, self._statements() as conn:
                            if all_indexes:
                                drop_invalid_indexes(conn)
                            built, deferred = add_missing_indexes(
                                conn, max_rows=max_rows, concurrently=True
                            )
                else:
                    with self._schema_lock, self._tx() as conn:
                        built, deferred = add_missing_indexes(conn, max_rows=max_rows)
                for name in built:
                    logger.info("ledger upgraded: built index {}", name)
                if all_indexes:
                    with self._schema_lock, self._tx() as conn:
                        for name in drop_retired_indexes(conn):
                            logger.info("ledger upgraded: dropped index {}, no longer used", name)
                if deferred:
                    logger.warning(
                        "ledger lacks index(es) {} on a big table; queries that need them are "
                        "slow until `keyexpiry init-db` builds them (online on MySQL/MariaDB)",
                        ", ".join(deferred),
                    )
                return deferred
            except StoreError as exc:
                # Two processes starting on a new SQLite file race to create it (or to switch
                # it to WAL): whoever lost finds the table there, or tries again.
                # Or both add the same new column: the loser's next attempt finds it there.
                # Or both build the same index ("Duplicate key name" on MySQL/MariaDB).
                racing = any(
                    sign in str(exc).lower()
                    for sign in (
                        "already exists",
                        "database is locked",
                        "duplicate column",
                        "duplicate key name",
                    )
                )
                if not racing or attempt == 4:
                    raise
                time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable: the last attempt returns or raises")

    @retried_once
    def ping(self) -> None:
        """One trivial query: raises StoreError when the ledger cannot answer."""
        with self._tx() as conn:
            conn.execute(select(1)).scalar_one()

    @retried_once
    def table_exists(self) -> bool:
        """Whether `time_limit_task` exists."""
        with self._tx() as conn:
            return bool(inspect(conn).has_table(TABLE_NAME))

    # --- create / cancel / read -----------------------------------------------------------------
    @retried_once
    def upsert_pending(self, tasks: Sequence[NewTask], now_ms: int) -> list[tuple[Did, int]]:
        """Insert each task as pending, or reset an existing key to pending at its new due time
        (`IfExists.REPLACE`); returns (created or replaced, due time) for each task, in order.

        One transaction; on MySQL/MariaDB a single task is one autocommitted statement (one round
        trip: creating one task at a time is bound by round trips), whose affected rows say
        whether the key was new.
        """
        if not tasks:
            return []
        if self.engine.dialect.name == "sqlite":
            return self._upsert_sqlite(tasks, now_ms)
        if self.postgres:
            return self._upsert_returning(tasks, now_ms)
        if not self._literal_upserts:
            # MySQL drivers other than PyMySQL: what existed is read first, in the transaction.
            return self.schedule(tasks, [IfExists.REPLACE] * len(tasks), now_ms)
        if len(tasks) == 1 and self._autocommit is not None:
            (task,) = tasks
            changed = self._autocommitted(
                lambda dialect, dbapi_conn: self._literal(dialect).one(
                    dbapi_conn.escape, task, now_ms
                )
            )
            # 1: inserted; 2: an existing row reset (which always changes it: `_moved_on`).
            return [(Did.CREATED if changed == 1 else Did.REPLACED, task.due_at_ms)]
        return self._upsert_literal(tasks, tasks, now_ms)

    def upsert_streamed(
        self, tasks: Iterable[NewTask], now_ms: int
    ) -> tuple[list[NewTask], list[tuple[Did, int]]]:
        """`upsert_pending` for tasks made as they are read: on MySQL/MariaDB (PyMySQL) the
        rows read so far are sent while the rest are made, in one transaction. An exception
        from `tasks` rolls back everything. Returns the tasks read and what was done to each.

        For a bulk create, whose requests cost about as much to check as their rows cost the
        server to insert: this way the two overlap.
        """
        if self.engine.dialect.name == "sqlite" or not self._literal_upserts:
            listed = list(tasks)
            return listed, self.upsert_pending(listed, now_ms)
        taken: list[NewTask] = []

        def taking() -> Iterator[NewTask]:
            for task in tasks:
                taken.append(task)
                yield task

        try:
            return taken, self._upsert_literal(taking(), taken, now_ms)
        except StoreError as exc:
            if not worth_retrying(exc):
                raise
            # Rolled back: once more, with the tasks read so far and then the rest.
            listed = [*taken, *tasks]
            return listed, self.upsert_pending(listed, now_ms)

    def _upsert_literal(
        self, tasks: Iterable[NewTask], taken: Sequence[NewTask], now_ms: int
    ) -> list[tuple[Did, int]]:
        """Upsert `tasks` in `LiteralUpsert` statements, pipelined (`Ledger._pipelined`);
        `taken` holds them all once `tasks` is read (it is `tasks` when that is a sequence)."""
        try:
            with self._tx() as conn:
                escape = conn.connection.driver_connection.escape  # type: ignore[union-attr]
                statements = self._literal(conn.dialect).statements(
                    escape, tasks, now_ms, max_bytes=PIPELINED_STATEMENT_BYTES
                )
                affected = self._pipelined(conn, statements)
                # 1 a row inserted, 2 a row reset: a reset always changes the row (`_moved_on`
                # in keyexpiry.ledger.table), so none counts 1 as an unchanged row does with the
                # found rows this pool asks for. All new or all existing says it for every key;
                # a mix says nothing.
                if affected in (len(taken), 2 * len(taken)):
                    did = Did.CREATED if affected == len(taken) else Did.REPLACED
                    return [(did, t.due_at_ms) for t in taken]
                raise _Mixed()
        except _Mixed:
            # Rolled back: done again with the rows read first (a mix is the rare bulk create).
            return self.schedule(taken, [IfExists.REPLACE] * len(taken), now_ms)

    def _upsert_returning(self, tasks: Sequence[NewTask], now_ms: int) -> list[tuple[Did, int]]:
        # PostgreSQL: one statement returns each row's key and whether it was inserted, in one
        # round trip (`array_upsert_sql`): a single create on the autocommit pool, a bulk one in
        # a transaction, 5,000 tasks a statement. A statement may not touch one row twice ("ON
        # CONFLICT DO UPDATE command cannot affect row a second time"): a key given again goes
        # in a later statement, so the later create wins, as on the other engines.
        if len(tasks) == 1 and self._autocommit is not None:
            # On the DBAPI connection itself: SQLAlchemy's Connection around one statement
            # cost a single create more than its round trip.
            if self._scalar_upsert is None:
                self._scalar_upsert = scalar_upsert_sql()
            params = scalar_upsert_params(tasks[0], now_ms)
            rows = self._autocommitted_rows(self._scalar_upsert, params)
            return [(Did.CREATED if rows[0][1] else Did.REPLACED, tasks[0].due_at_ms)]
        if self._array_upsert is None:
            self._array_upsert = array_upsert_sql()
        sql = self._array_upsert
        inserted: dict[str, list[bool]] = {}
        with self._tx() as conn:
            for group in _distinct_keys(tasks):
                for start in range(0, len(group), 5000):
                    params = array_upsert_params(group[start : start + 5000], now_ms)
                    for key, new in conn.exec_driver_sql(sql, params):
                        inserted.setdefault(str(key), []).append(bool(new))
        # A key given twice was written in order, one statement each: its answers in order too.
        return [
            (Did.CREATED if inserted[t.key].pop(0) else Did.REPLACED, t.due_at_ms) for t in tasks
        ]

    def _upsert_sqlite(self, tasks: Sequence[NewTask], now_ms: int) -> list[tuple[Did, int]]:
        # Under the write lock from the start, the rows inserted are those whose id passes the
        # largest id before (a rowid table numbers new rows upwards); a reset row keeps its id.
        # Reading the new rows back after the write costs less than reading every key before.
        # The two reads and the BEGIN go to sqlite3's cursor directly: through SQLAlchemy each
        # cost a single create more than the upsert itself.
        rows = [self._bound_row(t, now_ms) for t in tasks]
        dbapi_error = self.engine.dialect.loaded_dbapi.Error
        try:
            with self._tx() as conn:
                cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
                try:
                    cursor.execute("BEGIN IMMEDIATE")
                    (before,) = cursor.execute(f"SELECT max(id) FROM {TABLE_NAME}").fetchone()
                    # One statement run as executemany: sqlite3 loops in C.
                    for start in range(0, len(rows), 5000):
                        conn.execute(self._upsert, rows[start : start + 5000])
                    after = (before or 0,)
                    (n,) = cursor.execute(
                        f"SELECT count(*) FROM {TABLE_NAME} WHERE id > ?", after
                    ).fetchone()
                    if n in (0, len(tasks)):  # all new or all existing: no key to fetch
                        did = Did.CREATED if n else Did.REPLACED
                        return [(did, t.due_at_ms) for t in tasks]
                    found = cursor.execute(f"SELECT task_key FROM {TABLE_NAME} WHERE id > ?", after)
                    inserted = {key for (key,) in found}
                finally:
                    cursor.close()
        except dbapi_error as exc:  # from the cursor used directly, unwrapped
            wrapped = DBAPIError.instance(None, None, exc, dbapi_error, dialect=self.engine.dialect)
            raise self._store_error(wrapped) from exc
        return [(Did.CREATED if t.key in inserted else Did.REPLACED, t.due_at_ms) for t in tasks]

    def cancel_in(self, conn: Connection, keys: Sequence[str], now_ms: int) -> list[str]:
        """`cancel` on the caller's connection, in its transaction."""
        try:
            return self._cancel_on(conn, keys, now_ms, f"cancel:{uuid.uuid4().hex}")
        except SQLAlchemyError as exc:
            raise self._store_error(exc) from exc

    @retried_once
    def identity(self) -> tuple[str, ...]:
        """What names the ledger's database (`transactions.database_identity`)."""
        with self._tx() as conn:
            return database_identity(conn)

    def cancel(self, keys: Sequence[str], now_ms: int) -> list[str]:
        """Cancel those of `keys` that are pending; return the keys actually cancelled."""
        if not keys:
            return []
        # The token is fixed before any retry, so a retry after an ambiguous commit still
        # reports the rows the first attempt cancelled: the answer stays truthful.
        return self._cancel(keys, now_ms, f"cancel:{uuid.uuid4().hex}")

    @retried_once
    def _cancel(self, keys: Sequence[str], now_ms: int, token: str) -> list[str]:
        with self._tx() as conn:
            return self._cancel_on(conn, keys, now_ms, token)

    @staticmethod
    def _cancel_on(conn: Connection, keys: Sequence[str], now_ms: int, token: str) -> list[str]:
        if not keys:
            return []
        return Store._cancel_where(conn, T.c.task_key.in_(list(keys)), now_ms, token)

    @staticmethod
    def _cancel_where(
        conn: Connection, match: ColumnElement[bool], now_ms: int, token: str
    ) -> list[str]:
        """Cancel the pending rows `match` selects; the token they are marked with names the
        rows this call cancelled (also after a retry of an ambiguous commit)."""
        conn.execute(
            update(T)
            .where(match, T.c.status == TaskStatus.PENDING.value)
            .values(
                status=TaskStatus.CANCELLED.value,
                updated_at_ms=now_ms,
                finished_at_ms=now_ms,
                claimed_by=token,
            )
        )
        got = conn.execute(select(T.c.task_key).where(T.c.claimed_by == token, match))
        return [r[0] for r in got]

    def cancel_tag(self, tag: str, now_ms: int) -> list[str]:
        """Cancel every pending task tagged `tag`; return the keys cancelled."""
        return self._cancel_tag(tag, now_ms, f"cancel:{uuid.uuid4().hex}")

    @retried_once
    def _cancel_tag(self, tag: str, now_ms: int, token: str) -> list[str]:
        with self._tx() as conn:
            return self._cancel_where(conn, T.c.tag == tag, now_ms, token)

    def retry(self, keys: Sequence[str], *, due_at_ms: int, now_ms: int) -> list[str]:
        """Requeue those of `keys` that are dead or failed and waiting for their next attempt:
        pending at `due_at_ms`, attempts reset, earlier errors kept. Returns the keys requeued."""
        if not keys:
            return []
        # As in `cancel`: a token fixed before any retry keeps the answer truthful.
        return self._retry(keys, due_at_ms, now_ms, f"retry:{uuid.uuid4().hex}")

    @retried_once
    def _retry(self, keys: Sequence[str], due_at_ms: int, now_ms: int, token: str) -> list[str]:
        waiting = and_(T.c.status == TaskStatus.PENDING.value, T.c.attempts > 0)
        with self._tx() as conn:
            conn.execute(
                update(T)
                .where(
                    T.c.task_key.in_(list(keys)),
                    or_(T.c.status == TaskStatus.DEAD.value, waiting),
                )
                .values(
                    status=TaskStatus.PENDING.value,
                    attempts=0,
                    due_at_ms=due_at_ms,
                    updated_at_ms=now_ms,
                    started_at_ms=None,
                    finished_at_ms=None,
                    lease_until_ms=None,
                    claimed_by=token,
                )
            )
            got = conn.execute(
                select(T.c.task_key).where(T.c.claimed_by == token, T.c.task_key.in_(list(keys)))
            )
            return [r[0] for r in got]

    @retried_once
    def dead_page(
        self,
        *,
        after_id: int,
        limit: int,
        class_name: str | None = None,
        since_ms: int | None = None,
    ) -> list[tuple[int, str]]:
        """(id, key) of dead rows after `after_id`, by id: of one class, finished since a time."""
        q = select(T.c.id, T.c.task_key).where(
            T.c.status == TaskStatus.DEAD.value, T.c.id > after_id
        )
        if class_name is not None:
            q = q.where(T.c.class_name == class_name)
        if since_ms is not None:
            q = q.where(T.c.finished_at_ms >= since_ms)
        with self._tx() as conn:
            rows = conn.execute(q.order_by(T.c.id).limit(limit)).all()
        return [(int(i), str(k)) for i, k in rows]

    @retried_once
    def count_dead(self, *, class_name: str | None = None, since_ms: int | None = None) -> int:
        """How many dead rows `dead_page` would walk."""
        q = select(func.count()).where(T.c.status == TaskStatus.DEAD.value)
        if class_name is not None:
            q = q.where(T.c.class_name == class_name)
        if since_ms is not None:
            q = q.where(T.c.finished_at_ms >= since_ms)
        with self._tx() as conn:
            return int(conn.execute(q).scalar_one())

    @retried_once
    def get(self, key: str) -> TaskRow | None:
        """The row for `key`, or None."""
        with self._tx() as conn:
            r = conn.execute(select(T).where(T.c.task_key == key)).first()
        return _row(r, self.key_prefix) if r is not None else None

    @retried_once
    def get_many(self, keys: Sequence[str]) -> dict[str, TaskRow]:
        """Rows for `keys`, by key (missing keys are absent)."""
        if not keys:
            return {}
        with self._tx() as conn:
            rows = conn.execute(select(T).where(T.c.task_key.in_(list(keys)))).all()
        prefix = self.key_prefix
        return {row.key: row for row in (_row(r, prefix) for r in rows)}

    @retried_once
    def list_tasks(
        self, status: TaskStatus | None = None, limit: int = 50, *, tag: str | None = None
    ) -> list[TaskRow]:
        """Rows ordered by due time, optionally of one status, optionally of one tag.

        Without a status: the first `limit` of each status, each read in (due_at_ms, task_key)
        order off the (status, due_at_ms, task_key) index, merged, and those of a status
        outside `TaskStatus` (malformed: shown, not hidden). One ORDER BY over every row
        would sort the whole table (10 M rows). With a tag: its rows in order on the (tag,
        due_at_ms) index."""
        if tag is not None:
            q = select(T).where(T.c.tag == tag)
            if status is not None:
                q = q.where(T.c.status == status.value)
            with self._tx() as conn:
                rows = conn.execute(q.order_by(T.c.due_at_ms, T.c.id).limit(limit)).all()
            return [_row(r, self.key_prefix) for r in rows]
        statuses = [status] if status is not None else list(TaskStatus)
        with self._tx() as conn:
            runs = [
                [
                    _row(r, self.key_prefix)
                    for r in conn.execute(
                        select(T)
                        .where(T.c.status == s.value)
                        .order_by(T.c.due_at_ms, T.c.task_key)
                        .limit(limit)
                    )
                ]
                for s in statuses
            ]
            if status is None:
                runs.append(
                    [
                        _row(r, self.key_prefix)
                        for r in conn.execute(
                            select(T)
                            .where(unknown_status())
                            .order_by(T.c.due_at_ms, T.c.task_key)
                            .limit(limit)
                        )
                    ]
                )
        merged = heapq.merge(*runs, key=lambda row: (row.due_at_ms, row.key))
        return list(itertools.islice(merged, limit))

    @retried_once
    def counts(self) -> dict[str, int]:
        """Number of rows per status."""
        with self._tx() as conn:
            rows = conn.execute(select(T.c.status, func.count()).group_by(T.c.status)).all()
        return {str(s): int(n) for s, n in rows}
