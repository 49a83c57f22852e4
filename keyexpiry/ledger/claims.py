"""The listener's ledger queries: claim a batch, release, extend a lease (outcomes are recorded
by `ledger/outcomes.py`).

The claimer and the recorder run transactions of a few rows many times a second, so what a call
costs whatever its size matters most: their statements are compiled once per store (`Prepared`),
one for each list size of a few sizes (`list_size`), instead of being built and looked up in
SQLAlchemy's cache on every call.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence
from typing import Any

from pymysql.constants import COMMAND
from sqlalchemy import (
    VARCHAR,
    ClauseElement,
    ColumnElement,
    Connection,
    Select,
    Update,
    any_,
    bindparam,
    func,
    select,
    update,
)

from keyexpiry.ledger.base import Ledger, Prepared, driver_error, retried_once
from keyexpiry.ledger.batches import (
    KEY_PARAMS,
    MAX_LIST,
    array_param,
    list_size,
    padded_lists,
    unindexed,
)
from keyexpiry.ledger.engine import not_serving
from keyexpiry.ledger.outcomes import record_done, record_done_by_arrays
from keyexpiry.ledger.reading import CLAIM_SETS, CLAIM_SKIPS, claimed_row_from_db
from keyexpiry.ledger.rows import TaskRow, TaskStatus
from keyexpiry.ledger.table import T

_CLAIM_VALUES: dict[str, Any] = {
    "status": TaskStatus.RUNNING.value,
    "claimed_by": bindparam("token"),
    "lease_until_ms": bindparam("lease"),
    "attempts": T.c.attempts + 1,
    "started_at_ms": bindparam("now"),
    "finished_at_ms": None,
    "updated_at_ms": bindparam("now"),
}


def _claim_update(size: int) -> Update:
    return (
        update(T)
        .where(
            T.c.task_key.in_([bindparam(name) for name in KEY_PARAMS[:size]]),
            T.c.status == TaskStatus.PENDING.value,
            T.c.due_at_ms <= bindparam("now"),
        )
        .values(**_CLAIM_VALUES)
    )


_READ_BACK = [c for c in T.c if c.name not in CLAIM_SETS | CLAIM_SKIPS]


def _claimed_rows(size: int) -> Select[Any]:
    # Found by key (the unique index), then checked for the claim's token: the running rows of
    # the whole fleet are never walked.
    return select(*_READ_BACK).where(
        T.c.task_key.in_([bindparam(name) for name in KEY_PARAMS[:size]]),
        T.c.claimed_by == bindparam("token"),
        T.c.status == TaskStatus.RUNNING.value,
    )


def _ids_of_keys() -> ColumnElement[Any]:
    """`ARRAY(SELECT (SELECT id … WHERE task_key = k) FROM unnest(%(keys)s) k)`: the ids of the
    rows of the array parameter `keys`, each looked up in the unique key index by itself,
    computed once before the statement reads the table (an InitPlan).

    PostgreSQL's planner picks an IN list's index from its statistics. Fed a wave, or the backlog
    after downtime, that the statistics have not seen yet, it estimated a handful of pending due
    rows and walked the `(status, due_at_ms, …)` index: every claim of 256 keys read every due
    row (29,744 removed by its filter at a 30k wave), and a claim's cost grew with the backlog
    it was there to drain. A lookup by one key is the unique index whatever the statistics say.
    """
    keys = func.unnest(_KEYS).table_valued("k").render_derived().alias("keys")
    by_key = T.alias("by_key")
    id_of_key = select(by_key.c.id).where(by_key.c.task_key == keys.c.k).scalar_subquery()
    return func.array(select(id_of_key).select_from(keys).scalar_subquery())


_KEYS = array_param("keys", VARCHAR())
"""PostgreSQL's claim binds its keys as one array: one statement for every batch size, short
enough for psycopg to keep it parsed (it parses a query of more than 50 parameters or 4 KB again
at every execution) and prepared on the server after its fifth use."""


def _claim_returning() -> ClauseElement:
    """PostgreSQL's claim in one statement (one round trip, autocommitted): the UPDATE returns
    the rows it took, and the rows of `keys` a claim under the same token took before (a repeat
    after a lost reply) come from the statement's snapshot, taken before the UPDATE, so no row
    is read twice. Rows are found by id from their keys (`_ids_of_keys`), their status and due
    time only checked.

    Not `SELECT … FOR UPDATE SKIP LOCKED`: the listener claims the keys its events name (and the
    due rows a scan found), not whatever rows are next, and a row another listener is claiming
    right now is one this listener must not run anyway; the UPDATE's row lock is enough, and
    its WHERE is checked again on the row version the other claim committed.
    """
    claimed = (
        update(T)
        .where(
            T.c.id == any_(_ids_of_keys()),
            unindexed(T.c.status) == TaskStatus.PENDING.value,
            unindexed(T.c.due_at_ms) <= bindparam("now"),
        )
        .values(**_CLAIM_VALUES)
        .returning(*_READ_BACK)
        .cte("claimed")
    )
    # A claim repeated passes the lost one's lease: its rows hold exactly that one (no run has
    # them yet to extend it). Read through a `status`-led index: at worst every running row of
    # the fleet (bounded by its concurrency, not by the backlog), at best, on `(status,
    # lease_until_ms)`, a millisecond's; never every key looked up a second time.
    before = select(*_READ_BACK).where(
        T.c.status == TaskStatus.RUNNING.value,
        T.c.lease_until_ms == bindparam("lease"),
        T.c.claimed_by == bindparam("token"),
        T.c.task_key == any_(_KEYS),
    )
    return select(*claimed.c).union_all(before)


_PYMYSQL_READ = ("_next_seq_id", "_read_query_result", "_result")
"""PyMySQL's private reply-reading parts `_claim_pipelined` uses, besides the sending ones
`Ledger._pipelines` checks."""


def _render(prepared: Prepared, values: dict[str, Any], escape: Any) -> str:
    """`prepared`'s SQL with `values` (and its constants) written in as PyMySQL's cursor writes
    them (`Cursor.mogrify`: each value escaped by the connection's `escape`)."""
    params = {**prepared.constants, **values}
    return prepared.sql % {name: escape(value) for name, value in params.items()}


@functools.lru_cache(maxsize=8)
def _row_type(names: tuple[str, ...]) -> Any:
    """A named tuple for rows of these columns: read by attribute, as SQLAlchemy's rows are."""
    return collections.namedtuple("ClaimedRow", names)


def _extend_lease() -> ClauseElement:
    return (
        update(T)
        .where(
            T.c.id == bindparam("id"),
            T.c.claimed_by == bindparam("token"),
            T.c.status == TaskStatus.RUNNING.value,
        )
        .values(lease_until_ms=bindparam("lease"), updated_at_ms=bindparam("now"))
    )


class ClaimQueries(Ledger):
    """Claims: the hot path, one set-based statement per batch."""

    def prepare_claims(self, max_batch: int) -> int:
        """Compile now the claim statements of every list size a batch of up to `max_batch`
        keys takes, and the statement recording successes without results at every size
        (outcomes gathered for 50 ms are not bound by the claim batch), instead of on first use
        in a busy second (a big size took milliseconds, with every due task waiting), and the
        lease extension a run queued behind others needs when it starts; returns how many were
        compiled. Successes with results compile on first use."""
        # A wave's runs wait behind each other: the first to start past half its lease's grace
        # extends it, and compiled it then, with every due task waiting.
        self._prepare(_extend_lease)
        if self.postgres:
            # One statement each, for every batch size: their lists are bound as arrays.
            self._prepare(_claim_returning)
            self._prepare(record_done_by_arrays, False)
            return 3
        every = sorted({list_size(n) for n in range(1, MAX_LIST + 1)})
        for size in every:
            self._prepare(record_done, size, False)
        claims = [size for size in every if size <= list_size(min(max_batch, MAX_LIST))]
        for size in claims:
            self._prepare(_claim_update, size)
            self._prepare(_claimed_rows, size)
        return 1 + 2 * len(claims) + len(every)

    @retried_once
    def claim(
        self, keys: Sequence[str], *, now_ms: int, lease_until_ms: int, token: str
    ) -> list[TaskRow]:
        """Atomically move due pending rows among `keys` to running under `token`; return them.

        Only rows that are pending and due are taken, so a stale event for a task rescheduled to
        later does nothing, and of several listeners racing for a row exactly one gets it.
        Returns every row of `keys` held under `token`, so a claim repeated after a lost reply
        finds the rows the first one took: `token` names one claim, and a repeat passes the same
        keys and times.
        On MySQL/MariaDB its statements are autocommitted (`Ledger._statements`): one round
        trip less; with PyMySQL they are also sent back to back (`_claim_pipelined`): one more.
        """
        if not keys:
            return []
        if self.postgres:
            return self._claim_returning(keys, now_ms, lease_until_ms, token)
        parts = list(padded_lists(keys))
        # Autocommitted statements: a row a create resets between the UPDATE and the SELECT is
        # not read back; it runs at its new due time, and not for the old one as well.
        with self._statements() as conn:
            if self._pipelines and self._autocommit is not None:
                rows = self._claim_pipelined(conn, parts, now_ms, lease_until_ms, token)
            else:
                rows = self._claim_statements(conn, parts, now_ms, lease_until_ms, token)
        prefix = self.key_prefix
        return [
            claimed_row_from_db(
                r, prefix, token=token, now_ms=now_ms, lease_until_ms=lease_until_ms
            )
            for r in rows
        ]

    def _claim_statements(
        self, conn: Connection, parts: list[list[str]], now_ms: int, lease_until_ms: int, token: str
    ) -> list[Any]:
        """The claim's statements one after the other, each answered before the next is sent
        (a driver other than PyMySQL)."""
        for part in parts:
            self._prepare(_claim_update, len(part)).run(
                conn,
                {
                    **dict(zip(KEY_PARAMS, part, strict=False)),
                    "now": now_ms,
                    "token": token,
                    "lease": lease_until_ms,
                },
            )
        # By id: a key given twice, in two lists, is still one run.
        found = {
            row.id: row
            for part in parts
            for row in self._prepare(_claimed_rows, len(part))
            .run(conn, {**dict(zip(KEY_PARAMS, part, strict=False)), "token": token})
            .all()
        }
        return list(found.values())

    def _claim_texts(
        self, parts: list[list[str]], now_ms: int, lease_until_ms: int, token: str, escape: Any
    ) -> list[str]:
        """The pipelined claim's statements with their values written in: every part's UPDATE,
        then every part's read-back (`tests/test_query_plans.py` EXPLAINs them)."""
        statements: list[str] = []
        for part in parts:
            keys = dict(zip(KEY_PARAMS, part, strict=False))
            update_values = {**keys, "now": now_ms, "token": token, "lease": lease_until_ms}
            statements.append(
                _render(self._prepare(_claim_update, len(part)), update_values, escape)
            )
        for part in parts:
            keys = dict(zip(KEY_PARAMS, part, strict=False))
            statements.append(
                _render(self._prepare(_claimed_rows, len(part)), {**keys, "token": token}, escape)
            )
        return statements

    def _claim_pipelined(
        self, conn: Connection, parts: list[list[str]], now_ms: int, lease_until_ms: int, token: str
    ) -> list[Any]:
        """The MySQL/MariaDB claim with its statements sent back to back on the autocommit
        connection and their replies read after: one round trip for the UPDATE and the SELECT
        instead of one each. The server runs a connection's commands one after the other, so
        the SELECT still runs after the UPDATE has committed and reads exactly what it took.

        Steady profile: the claim was about half of the listener's CPU, much of it SQLAlchemy's
        per-statement work around two small statements (an execution context, a result and its
        metadata per call), and its second round trip was part of every task's lateness (a
        4-key claim here: 478 -> 345 us CPU, 993 -> 849 us wall, measured in-process). Here
        the SQL is the same `Prepared` text with its values escaped by PyMySQL as its cursor
        does, and the rows are read straight off the driver's result. Errors are wrapped and a
        dead connection invalidated as `exec_driver_sql` does (`Ledger._pipelined` does the
        same for bulk creates); a statement that fails leaves the replies after it read, so the
        connection goes back to the pool in step.
        """
        dbapi: Any = conn.connection.driver_connection
        if not all(hasattr(dbapi, name) for name in _PYMYSQL_READ):
            # A PyMySQL whose reply reading differs: one statement at a time, as before.
            return self._claim_statements(conn, parts, now_ms, lease_until_ms, token)
        statements = self._claim_texts(parts, now_ms, lease_until_ms, token, dbapi.escape)
        dialect = conn.dialect
        found: dict[int, Any] = {}
        error: BaseException | None = None
        sent = 0
        try:
            for sql in statements:
                dbapi._execute_command(COMMAND.COM_QUERY, sql.encode(dbapi.encoding))
                sent += 1
            for i in range(len(statements)):
                # Each reply starts at sequence 1, as after its own command: PyMySQL expects the
                # numbering of the last command sent, so it is set back for every reply.
                dbapi._next_seq_id = 1
                try:
                    dbapi._read_query_result()
                except dialect.loaded_dbapi.Error as exc:
                    if dialect.is_disconnect(exc, dbapi, None) or not_serving(exc):
                        raise
                    error = error or exc  # the server runs the rest: their replies are read
                    continue
                if i >= len(parts) and error is None:
                    result = dbapi._result
                    row_type = _row_type(tuple(d[0] for d in result.description))
                    for values in result.rows:
                        row = row_type._make(values)
                        found[row.id] = row  # by id: a key given twice, in two lists, is one run
            if error is not None:
                raise error
        except dialect.loaded_dbapi.Error as exc:
            raise driver_error(conn, exc, statements[0]) from exc
        except BaseException:
            # Replies of commands sent may be unread (an interrupt): never reuse it.
            if sent:
                conn.invalidate()
            raise
        return list(found.values())

    def _claim_returning(
        self, keys: Sequence[str], now_ms: int, lease_until_ms: int, token: str
    ) -> list[TaskRow]:
        """PostgreSQL's claim on the driver's own cursor (`_autocommitted_rows`), its rows read
        as named tuples, as the MariaDB claim's are: through SQLAlchemy, each row was a `Row`
        whose every column read by name (the claimed row's conversion reads 16) cost several
        times a tuple's, and its `CursorResult` a fixed cost per claim besides. Profiled in the
        30k wave (py-spy `--gil`, one listener): the conversion of PostgreSQL's claimed rows
        took 790 samples against MariaDB's 270 for the same 30,000 rows."""
        prepared = self._prepare(_claim_returning)
        values = {
            **prepared.constants,
            "keys": list(keys),
            "now": now_ms,
            "token": token,
            "lease": lease_until_ms,
        }
        names, rows = self._autocommitted_named_rows(prepared.sql, values)
        make = _row_type(names)._make
        # By id: a key given twice is one run.
        found = {row.id: row for row in map(make, rows)}
        prefix = self.key_prefix
        return [
            claimed_row_from_db(
                r, prefix, token=token, now_ms=now_ms, lease_until_ms=lease_until_ms
            )
            for r in found.values()
        ]

    @retried_once
    def release(self, task_ids: Sequence[int], token: str, now_ms: int) -> int:
        """Give claimed-but-not-started runs back: pending again, the attempt not counted."""
        if not task_ids:
            return 0
        with self._tx() as conn:
            result = conn.execute(
                update(T)
                .where(
                    T.c.id.in_(list(task_ids)),
                    T.c.claimed_by == token,
                    T.c.status == TaskStatus.RUNNING.value,
                )
                .values(
                    status=TaskStatus.PENDING.value,
                    attempts=T.c.attempts - 1,
                    claimed_by=None,
                    lease_until_ms=None,
                    started_at_ms=None,
                    updated_at_ms=now_ms,
                )
            )
        return int(result.rowcount)

    @retried_once
    def extend_lease(self, task_id: int, token: str, lease_until_ms: int, now_ms: int) -> bool:
        """Push out the lease of a claimed run that starts late; False if the claim was lost."""
        with self._tx() as conn:
            result = self._prepare(_extend_lease).run(
                conn, {"id": task_id, "token": token, "lease": lease_until_ms, "now": now_ms}
            )
        return bool(result.rowcount)
