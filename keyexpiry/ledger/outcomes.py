"""The recorder's ledger queries: finished runs recorded in batches (one statement for every
success), an ended occurrence of a schedule turned into its next, a transactional handler's
outcome recorded in its own transaction.

Like the claims (`ledger/claims.py`), the hot statements are compiled once per list size."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from sqlalchemy import (
    VARCHAR,
    BigInteger,
    ClauseElement,
    Connection,
    Text,
    any_,
    bindparam,
    case,
    func,
    select,
    update,
)
from sqlalchemy.exc import SQLAlchemyError

from keyexpiry.ledger.base import Ledger, retried_once
from keyexpiry.ledger.batches import (
    ID_PARAMS,
    RESULT_PARAMS,
    TOKEN_PARAMS,
    array_param,
    padded_lists,
    unindexed,
)
from keyexpiry.ledger.recurring import readable_schedule
from keyexpiry.ledger.rows import Outcome, TaskStatus
from keyexpiry.ledger.table import S, T, storable_text, with_earlier_errors
from keyexpiry.schedules.rules import next_after_run

RESULTS_MAX_BYTES = 1_000_000
"""The results one statement writes, together, at most (a single bigger one goes alone): below
the smallest `max_allowed_packet` a server is likely to have, whatever the batch size."""


def _done_values(result: Any) -> dict[str, Any]:
    """What a recorded success writes: `result` is NULL, or an expression of the values bound."""
    return {
        "status": TaskStatus.DONE.value,
        "finished_at_ms": bindparam("now"),
        "last_error": None,
        "lease_until_ms": None,
        "updated_at_ms": bindparam("now"),
        "result": result,
    }


def record_done(size: int, with_results: bool = False) -> ClauseElement:
    # One statement for runs of many claims: each row is matched by its id and must still be
    # held by the token of the run that ended, as in one UPDATE per claim. The id list is what
    # the index looks up; the CASE only checks the token of each row found.
    token_of_id = case(
        *[
            (bindparam(i), bindparam(t))
            for i, t in zip(ID_PARAMS[:size], TOKEN_PARAMS, strict=False)
        ],
        value=T.c.id,
    )
    # Most handlers return None: their statement writes NULL and binds no result at all.
    result: Any = None
    if with_results:
        result = case(
            *[
                (bindparam(i), bindparam(r, type_=Text))
                for i, r in zip(ID_PARAMS[:size], RESULT_PARAMS, strict=False)
            ],
            value=T.c.id,
        )
    return (
        update(T)
        .where(
            T.c.id.in_([bindparam(name) for name in ID_PARAMS[:size]]),
            T.c.status == TaskStatus.RUNNING.value,
            T.c.claimed_by == token_of_id,
        )
        .values(**_done_values(result))
    )


_IDS = array_param("ids", BigInteger())


def record_done_by_arrays(with_results: bool) -> ClauseElement:
    """PostgreSQL's `record_done`: the ids, their tokens (and results) bound as three arrays,
    one statement for every batch size. Each row is found by id (the primary key, its status
    only checked: `unindexed`) and matched to its token by its place in the id array."""
    at = func.array_position(_IDS, T.c.id)
    result: Any = array_param("results", Text())[at] if with_results else None
    return (
        update(T)
        .where(
            T.c.id == any_(_IDS),
            unindexed(T.c.status) == TaskStatus.RUNNING.value,
            T.c.claimed_by == array_param("tokens", VARCHAR())[at],
        )
        .values(**_done_values(result))
    )


def by_result_bytes(outcomes: list[Outcome]) -> Iterator[list[Outcome]]:
    """`outcomes` in runs whose results add up to at most `RESULTS_MAX_BYTES` (at least one
    outcome each)."""
    part: list[Outcome] = []
    size = 0
    for o in outcomes:
        n = len(o.result or "")  # characters: a lower bound of bytes; JSON is mostly ASCII
        if part and size + n > RESULTS_MAX_BYTES:
            yield part
            part, size = [], 0
        part.append(o)
        size += n
    if part:
        yield part


def distinct_ids(outcomes: list[Outcome]) -> Iterator[list[Outcome]]:
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


class OutcomeQueries(Ledger):
    """Outcomes: the hot path's other half, one set-based statement per batch of successes."""

    @retried_once
    def record(
        self,
        outcomes: Sequence[Outcome],
        now_ms: int,
        rearm: list[tuple[str, int]] | None = None,
    ) -> int:
        """Record finished runs (in one transaction when a schedule advances, else each statement
        autocommitted); a run whose claim was lost is skipped, and so is one its handler's
        transaction recorded already (`Outcome.recorded`). An ended occurrence of a schedule
        becomes its next occurrence: its (key, due) is added to `rearm`, for the caller to arm
        once this has committed.

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
        plain = [o for o in done if o.result is None]
        if self.postgres and not advancing and self._autocommit is not None:
            # The bulk of a batch, successes without a value, as the claim runs its statement:
            # on psycopg's held cursor, without a SQLAlchemy connection and result around it.
            count = self._record_plain_raw(plain, now_ms)
            done = [o for o in done if o.result is not None]
            if not done and not others:
                return count
            plain = []
        else:
            count = 0
        # Without a schedule to advance, every statement stands alone (each is guarded by its
        # claim's token, so one applied before a lost connection finds nothing the second
        # time): autocommitted, a batch costs its statements' round trips only, not a BEGIN
        # (psycopg sends one) and a COMMIT besides. A schedule's advance reads and writes
        # under its row lock: a transaction.
        with self._tx() if advancing else self._statements() as conn:
            # Successes, the bulk of any batch: one statement for all of them, whatever claims
            # they came from (those that returned a value in statements of their own, as few
            # as their size allows).
            valued = [o for o in done if o.result is not None]
            for group in distinct_ids(plain):
                for part in self._parts(group):
                    count += self._record_done_part(conn, part, now_ms, False)
            for group in distinct_ids(valued):
                for chunk in by_result_bytes(group):
                    for part in self._parts(chunk):
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

    def _record_plain_raw(self, plain: list[Outcome], now_ms: int) -> int:
        """PostgreSQL: successes that returned no value, one array statement per group of
        distinct ids, on the raw autocommit path (`Ledger._on_raw_autocommit`)."""
        if not plain:
            return 0
        prepared = self._prepare(record_done_by_arrays, False)
        groups = [
            {
                **prepared.constants,
                "now": now_ms,
                "ids": [o.task_id for o in group],
                "tokens": [o.token for o in group],
            }
            for group in distinct_ids(plain)
        ]
        return self._autocommitted_each(prepared.sql, groups)

    def _parts(self, outcomes: list[Outcome]) -> Iterator[list[Outcome]]:
        """The statements' lists: padded, or on PostgreSQL all of them (one array each)."""
        if self.postgres:
            yield outcomes
        else:
            yield from padded_lists(outcomes)

    def _record_done_part(
        self, conn: Connection, part: list[Outcome], now_ms: int, with_results: bool
    ) -> int:
        if self.postgres:
            arrays: dict[str, Any] = {
                "now": now_ms,
                "ids": [o.task_id for o in part],
                "tokens": [o.token for o in part],
            }
            if with_results:
                arrays["results"] = [o.result for o in part]
            by_arrays = self._prepare(record_done_by_arrays, with_results)
            return int(by_arrays.run(conn, arrays).rowcount)
        values: dict[str, Any] = {"now": now_ms}
        values.update(zip(ID_PARAMS, [o.task_id for o in part], strict=False))
        values.update(zip(TOKEN_PARAMS, [o.token for o in part], strict=False))
        if with_results:
            values.update(zip(RESULT_PARAMS, [o.result for o in part], strict=False))
        statement = self._prepare(record_done, len(part), with_results)
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
