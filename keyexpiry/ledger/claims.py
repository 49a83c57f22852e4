"""The listener's ledger queries: claim a batch, record outcomes, release, extend a lease.

The claimer and the recorder run transactions of a few rows many times a second, so what a call
costs whatever its size matters most: their statements are compiled once per store (`Prepared`),
one for each list size of a few sizes (`_size`), instead of being built and looked up in
SQLAlchemy's cache on every call.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

from pymysql.constants import COMMAND
from sqlalchemy import (
    ClauseElement,
    Connection,
    Select,
    Text,
    Update,
    bindparam,
    case,
    select,
    update,
)
from sqlalchemy.exc import SQLAlchemyError

from keyexpiry.ledger.base import Ledger, Prepared, driver_error, retried_once
from keyexpiry.ledger.recurring import readable_schedule
from keyexpiry.ledger.rows import (
    CLAIM_SETS,
    CLAIM_SKIPS,
    Outcome,
    TaskRow,
    TaskStatus,
    claimed_row_from_db,
)
from keyexpiry.ledger.table import S, T, not_serving, storable_text, with_earlier_errors
from keyexpiry.schedules.rules import next_after_run

_X = TypeVar("_X")

_MAX_LIST = 1024
"""The most keys or outcomes one statement names: a bigger batch takes several statements in the
same transaction (SQLite refuses more than 32,766 parameters; fewer sizes to compile)."""

# Bind parameter names of list elements, by position.
_KEY = tuple(f"k{i}" for i in range(_MAX_LIST))
_ID = tuple(f"i{i}" for i in range(_MAX_LIST))
_TOKEN = tuple(f"t{i}" for i in range(_MAX_LIST))
_RESULT = tuple(f"r{i}" for i in range(_MAX_LIST))

_RESULTS_MAX_BYTES = 1_000_000
"""The results one statement writes, together, at most (a single bigger one goes alone): below
the smallest `max_allowed_packet` a server is likely to have, whatever the batch size."""


def _size(n: int) -> int:
    """The list size a statement for `n` values is compiled for: 1, 2, 3, 4, 6, 8, 12, 16, 24, …
    (powers of two and halfway between), so a handful of statements serve every batch and a
    list is padded by at most half."""
    if n <= 4:
        return n
    power = 1 << (n - 1).bit_length()
    return power * 3 // 4 if n <= power * 3 // 4 else power


def _lists(values: Sequence[_X]) -> Iterator[list[_X]]:
    """`values` in lists of at most `_MAX_LIST`, each padded to its statement's size with its own
    last value again: a value named twice in an IN list (or a CASE) matches its row once."""
    for start in range(0, len(values), _MAX_LIST):
        part = list(values[start : start + _MAX_LIST])
        part += part[-1:] * (_size(len(part)) - len(part))
        yield part


def _claim_update(size: int) -> Update:
    return (
        update(T)
        .where(
            T.c.task_key.in_([bindparam(name) for name in _KEY[:size]]),
            T.c.status == TaskStatus.PENDING.value,
            T.c.due_at_ms <= bindparam("now"),
        )
        .values(
            status=TaskStatus.RUNNING.value,
            claimed_by=bindparam("token"),
            lease_until_ms=bindparam("lease"),
            attempts=T.c.attempts + 1,
            started_at_ms=bindparam("now"),
            finished_at_ms=None,
            updated_at_ms=bindparam("now"),
        )
    )


_READ_BACK = [c for c in T.c if c.name not in CLAIM_SETS | CLAIM_SKIPS]


def _claimed_rows(size: int) -> Select[Any]:
    # Found by key (the unique index), then checked for the claim's token: the running rows of
    # the whole fleet are never walked.
    return select(*_READ_BACK).where(
        T.c.task_key.in_([bindparam(name) for name in _KEY[:size]]),
        T.c.claimed_by == bindparam("token"),
        T.c.status == TaskStatus.RUNNING.value,
    )


def _claim_returning(size: int) -> ClauseElement:
    """PostgreSQL's claim in one statement (one round trip, autocommitted): the UPDATE returns
    the rows it took, and the rows of `keys` a claim under the same token took before (a repeat
    after a lost reply) come from the statement's snapshot, taken before the UPDATE, so no row
    is read twice.

    Not `SELECT … FOR UPDATE SKIP LOCKED`: the listener claims the keys its events name (and the
    due rows a scan found), not whatever rows are next, and a row another listener is claiming
    right now is one this listener must not run anyway; the UPDATE's row lock is enough, and
    its WHERE is checked again on the row version the other claim committed.
    """
    claimed = _claim_update(size).returning(*_READ_BACK).cte("claimed")
    return select(*claimed.c).union_all(_claimed_rows(size))


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


def _record_done(size: int, with_results: bool = False) -> ClauseElement:
    # One statement for runs of many claims: each row is matched by its id and must still be
    # held by the token of the run that ended, as in one UPDATE per claim. The id list is what
    # the index looks up; the CASE only checks the token of each row found.
    token_of_id = case(
        *[(bindparam(i), bindparam(t)) for i, t in zip(_ID[:size], _TOKEN, strict=False)],
        value=T.c.id,
    )
    # Most handlers return None: their statement writes NULL and binds no result at all.
    result: Any = None
    if with_results:
        result = case(
            *[
                (bindparam(i), bindparam(r, type_=Text))
                for i, r in zip(_ID[:size], _RESULT, strict=False)
            ],
            value=T.c.id,
        )
    return (
        update(T)
        .where(
            T.c.id.in_([bindparam(name) for name in _ID[:size]]),
            T.c.status == TaskStatus.RUNNING.value,
            T.c.claimed_by == token_of_id,
        )
        .values(
            status=TaskStatus.DONE.value,
            finished_at_ms=bindparam("now"),
            last_error=None,
            lease_until_ms=None,
            updated_at_ms=bindparam("now"),
            result=result,
        )
    )


def _by_result_bytes(outcomes: list[Outcome]) -> Iterator[list[Outcome]]:
    """`outcomes` in runs whose results add up to at most `_RESULTS_MAX_BYTES` (at least one
    outcome each)."""
    part: list[Outcome] = []
    size = 0
    for o in outcomes:
        n = len(o.result or "")  # characters: a lower bound of bytes; JSON is mostly ASCII
        if part and size + n > _RESULTS_MAX_BYTES:
            yield part
            part, size = [], 0
        part.append(o)
        size += n
    if part:
        yield part


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


def _distinct_ids(outcomes: list[Outcome]) -> Iterator[list[Outcome]]:
    """`outcomes` in groups where no task id appears twice, in order: the same task can end twice
    in one batch (a run whose claim was lost, and its run under a new claim), and one CASE on
    the id can only name one of its tokens."""
    while outcomes:
        seen: set[int] = set()
        group: list[Outcome] = []
        later: list[Outcome] = []
        for o in outcomes:
            (later if o.task_id in seen else group).append(o)
            seen.add(o.task_id)
        yield group
        outcomes = later


class ClaimQueries(Ledger):
    """Claims and outcomes: the hot path, one set-based statement per batch."""

    def prepare_claims(self, max_batch: int) -> int:
        """Compile now the claim statements of every list size a batch of up to `max_batch`
        keys takes, and the statement recording successes without results at every size
        (outcomes gathered for 50 ms are not bound by the claim batch), instead of on first use
        in a busy second (a big size took milliseconds, with every due task waiting); returns
        how many were compiled. Successes with results compile on first use."""
        every = sorted({_size(n) for n in range(1, _MAX_LIST + 1)})
        claims = [size for size in every if size <= _size(min(max_batch, _MAX_LIST))]
        for size in claims:
            if self.postgres:
                self._prepare(_claim_returning, size)
                continue
            self._prepare(_claim_update, size)
            self._prepare(_claimed_rows, size)
        for size in every:
            self._prepare(_record_done, size, False)
        return 2 * len(claims) + len(every)

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
        parts = list(_lists(keys))
        if self.postgres:
            return self._claim_returning(parts, now_ms, lease_until_ms, token)
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
                    **dict(zip(_KEY, part, strict=False)),
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
            .run(conn, {**dict(zip(_KEY, part, strict=False)), "token": token})
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
            keys = dict(zip(_KEY, part, strict=False))
            update_values = {**keys, "now": now_ms, "token": token, "lease": lease_until_ms}
            statements.append(
                _render(self._prepare(_claim_update, len(part)), update_values, escape)
            )
        for part in parts:
            keys = dict(zip(_KEY, part, strict=False))
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
        self, parts: list[list[str]], now_ms: int, lease_until_ms: int, token: str
    ) -> list[TaskRow]:
        found: dict[int, Any] = {}
        with self._statements() as conn:
            for part in parts:
                values = {
                    **dict(zip(_KEY, part, strict=False)),
                    "now": now_ms,
                    "token": token,
                    "lease": lease_until_ms,
                }
                for row in self._prepare(_claim_returning, len(part)).run(conn, values):
                    found[row.id] = row  # by id: a key given twice, in two lists, is one run
        prefix = self.key_prefix
        return [
            claimed_row_from_db(
                r, prefix, token=token, now_ms=now_ms, lease_until_ms=lease_until_ms
            )
            for r in found.values()
        ]

    @retried_once
    def record(
        self,
        outcomes: Sequence[Outcome],
        now_ms: int,
        rearm: list[tuple[str, int]] | None = None,
    ) -> int:
        """Record finished runs in one transaction; a run whose claim was lost is skipped, and
        so is one its handler's transaction recorded already (`Outcome.recorded`). An ended
        occurrence of a schedule becomes its next occurrence: its (key, due) is added to
        `rearm`, for the caller to arm once this has committed.

        Returns how many rows were updated.
        """
        done: list[Outcome] = []
        others: list[Outcome] = []
        advancing: list[Outcome] = []
        for o in outcomes:
            if o.recorded:
                continue
            if o.occurrence is not None:
                advancing.append(o)
            elif o.status is TaskStatus.DONE and o.last_error is None:
                done.append(o)
            else:
                others.append(o)
        if not done and not others and not advancing:
            return 0
        count = 0
        with self._tx() as conn:
            # Successes, the bulk of any batch: one statement for all of them, whatever claims
            # they came from (those that returned a value in statements of their own, as few
            # as their size allows).
            plain = [o for o in done if o.result is None]
            valued = [o for o in done if o.result is not None]
            for group in _distinct_ids(plain):
                for part in _lists(group):
                    count += self._record_done_part(conn, part, now_ms, False)
            for group in _distinct_ids(valued):
                for chunk in _by_result_bytes(group):
                    for part in _lists(chunk):
                        count += self._record_done_part(conn, part, now_ms, True)
            if others:
                count += conn.execute(
                    self._record_one, self._record_params(others, now_ms)
                ).rowcount
            # Schedule rows locked in one order, as every other path does: no deadlock.
            for o in sorted(advancing, key=lambda o: o.occurrence.schedule if o.occurrence else ""):
                count += self._record_occurrence(conn, o, now_ms, rearm)
        return count

    def _record_occurrence(
        self, conn: Connection, o: Outcome, now_ms: int, rearm: list[tuple[str, int]] | None
    ) -> int:
        """An occurrence of a schedule ended: under the schedule's lock, its row becomes the next
        occurrence (`keyexpiry.schedules.rules.next_after_run`), or ends when the schedule has ended
        or is paused, and the schedule notes the run: all in the caller's transaction, and only
        while the run's claim still holds. A retry, or a schedule removed meanwhile: a plain
        outcome."""
        occ = o.occurrence
        assert occ is not None
        found = conn.execute(select(S).where(S.c.name == occ.schedule).with_for_update()).first()
        sched = None if found is None else readable_schedule(found)
        if sched is None or sched.task_key != o.key or o.status is TaskStatus.PENDING:
            return int(conn.execute(self._record_one, self._record_params([o], now_ms)).rowcount)
        nxt = (
            sched.occurrence_ms
            if occ.extra
            else next_after_run(
                sched.recurrence,
                occ.scheduled_for_ms,
                # When the handler ended, not when its outcome is written (batched, or held by
                # an outage): an occurrence due in between did not overlap the run.
                o.finished_at_ms if o.finished_at_ms is not None else now_ms,
                sched.anchor_ms,
                sched.overlap,
                occ.started_ms,
            )
        )
        if nxt is None or sched.paused:
            matched = conn.execute(self._record_one, self._record_params([o], now_ms)).rowcount
        else:
            matched = conn.execute(
                update(T)
                .where(
                    T.c.id == o.task_id,
                    T.c.claimed_by == o.token,
                    T.c.status == TaskStatus.RUNNING.value,
                )
                .values(
                    status=TaskStatus.PENDING.value,
                    due_at_ms=nxt,
                    attempts=0,
                    finished_at_ms=o.finished_at_ms,
                    last_error=None,
                    result=o.result,
                    lease_until_ms=None,
                    claimed_by=None,
                    updated_at_ms=now_ms,
                )
            ).rowcount
            if matched and rearm is not None:
                rearm.append((o.key, nxt))
        if matched:
            status = "skipped" if occ.skipped else o.status.value
            finished_ms = o.finished_at_ms or now_ms
            conn.execute(
                update(S)
                .where(S.c.name == occ.schedule)
                .values(
                    occurrence_ms=nxt,
                    last_scheduled_for_ms=occ.scheduled_for_ms,
                    last_status=status,
                    last_finished_ms=finished_ms,
                    last_success_ms=finished_ms
                    if status == TaskStatus.DONE.value
                    else S.c.last_success_ms,
                    last_error=storable_text(o.last_error),
                    updated_at_ms=now_ms,
                )
            )
        return int(matched)

    def _record_done_part(
        self, conn: Connection, part: list[Outcome], now_ms: int, with_results: bool
    ) -> int:
        values: dict[str, Any] = {"now": now_ms}
        values.update(zip(_ID, [o.task_id for o in part], strict=False))
        values.update(zip(_TOKEN, [o.token for o in part], strict=False))
        if with_results:
            values.update(zip(_RESULT, [o.result for o in part], strict=False))
        statement = self._prepare(_record_done, len(part), with_results)
        return int(statement.run(conn, values).rowcount)

    @staticmethod
    def _record_params(outcomes: Sequence[Outcome], now_ms: int) -> list[dict[str, Any]]:
        return [
            {
                "b_id": o.task_id,
                "b_token": o.token,
                "b_status": o.status.value,
                "b_finished": o.finished_at_ms,
                "b_due": o.due_at_ms,
                "b_error": storable_text(o.last_error),
                "b_result": o.result,
                "b_now": now_ms,
            }
            for o in outcomes
        ]

    _record_one = (
        update(T)
        .where(
            T.c.id == bindparam("b_id"),
            T.c.claimed_by == bindparam("b_token"),
            T.c.status == TaskStatus.RUNNING.value,
        )
        .values(
            status=bindparam("b_status"),
            finished_at_ms=bindparam("b_finished"),
            due_at_ms=bindparam("b_due"),
            last_error=with_earlier_errors(bindparam("b_error", type_=Text)),
            result=bindparam("b_result", type_=Text),
            lease_until_ms=None,
            updated_at_ms=bindparam("b_now"),
        )
    )

    def record_in(self, conn: Connection, outcome: Outcome, now_ms: int) -> bool:
        """Record `outcome` in the caller's transaction on `conn` (a transactional handler's),
        only while its claim still holds; False when it was lost (taken over, requeued,
        rescheduled): then the caller must roll back. The row stays locked until it ends.

        The claim token is what proves the claim: an expired lease nobody acted on still
        leaves the row `running` under it, and no one else has run the task.
        """
        try:
            result = conn.execute(self._record_one, self._record_params([outcome], now_ms))
        except SQLAlchemyError as exc:
            raise self._store_error(exc) from exc
        return result.rowcount == 1

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
