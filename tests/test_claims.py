"""The listener's claim and record statements, compiled once per list size: padded lists take
exactly the keys asked for, a claim reads back what the ledger holds, one UPDATE records the
successes of many claims (on SQLite and MariaDB)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Integer, TypeDecorator, bindparam, event, select
from sqlalchemy.dialects import sqlite

from keyexpiry.ledger.base import Prepared
from keyexpiry.ledger.batches import MAX_LIST as _MAX_LIST
from keyexpiry.ledger.batches import list_size as _size
from keyexpiry.ledger.batches import padded_lists as _lists
from keyexpiry.ledger.store import NewTask, Outcome, Store, T, TaskStatus
from tests.ke import see_raw_outcomes

NOW = 1_700_000_000_000


def new(key: str, due: int = NOW, schedule: tuple[float, ...] | None = None) -> NewTask:
    return NewTask(key, "A", "m", (key, "é@"), due, schedule)


def updates(store: Store) -> list[str]:
    """The UPDATE statements the store sends from now on (on its pool, and on its pool of
    autocommitted statements where it has one: outcomes go there)."""
    sent: list[str] = []

    def capture(_c: Any, _cur: Any, statement: str, _p: Any, _ctx: Any, _many: bool) -> None:
        if statement.lstrip().upper().startswith("UPDATE"):
            sent.append(statement)

    for engine in {store.engine, store._autocommit or store.engine}:
        event.listen(engine, "before_cursor_execute", capture)
    see_raw_outcomes(store, lambda sql, params: capture(None, None, sql, params, None, False))
    return sent


def test_lists_are_padded_with_their_own_values_only() -> None:
    for n in [*range(1, 70), 767, 768, 769, 1023, 1024, 1025, 2100, 5000]:
        values = list(range(n))
        parts = list(_lists(values))
        assert [v for part in parts for v in dict.fromkeys(part)] == values, n
        for part in parts:
            assert len(part) == _size(len(set(part))) <= _MAX_LIST
            assert len(part) < 2 * len(set(part)) or len(part) == 1, n
    assert len({_size(n) for n in range(1, _MAX_LIST + 1)}) == 20


@pytest.mark.parametrize("n", [1, 3, 5, 7, 13, 50, _MAX_LIST + 77])
def test_a_padded_claim_takes_each_key_asked_for_once(store: Store, n: int) -> None:
    asked = [f"A@m@{i}" for i in range(n)]
    others = [f"A@m@other{i}" for i in range(5)]
    store.upsert_pending([new(k) for k in asked + others], NOW)
    store.upsert_pending([new("A@m@later", NOW + 1)], NOW)
    rows = store.claim([*asked, "A@m@later"], now_ms=NOW, lease_until_ms=NOW + 9, token="t")
    assert sorted(r.key for r in rows) == sorted(asked)
    assert {(r.status, r.attempts, r.claimed_by) for r in rows} == {(TaskStatus.RUNNING, 1, "t")}
    assert store.counts() == {"running": n, "pending": 6}


def test_a_claim_returns_the_rows_as_the_ledger_holds_them(store: Store) -> None:
    store.upsert_pending([new("A@m@1", schedule=(1.5, 30.0)), new("A@m@2"), new("A@m@3")], NOW)
    # An earlier attempt that failed: the row carries its error and its attempt.
    (first,) = store.claim(["A@m@1"], now_ms=NOW, lease_until_ms=NOW + 5, token="t0")
    failed = Outcome(first.id, first.key, "t0", TaskStatus.PENDING, NOW + 1, NOW + 2, "boom\x00ü")
    assert store.record([failed], NOW + 1) == 1

    def claim() -> list[Any]:
        rows = store.claim(
            ["A@m@1", "A@m@2", "A@m@3"], now_ms=NOW + 2, lease_until_ms=NOW + 99, token="t1"
        )
        return sorted(rows, key=lambda r: r.key)

    rows = claim()
    assert rows == [store.get(k) for k in ("A@m@1", "A@m@2", "A@m@3")]
    assert (rows[0].attempts, rows[0].last_error, rows[0].retry_schedule_s) == (
        2,
        "boom\\0ü",  # a NUL kept as `\\0` (PostgreSQL text cannot hold it)
        (1.5, 30.0),
    )
    # Repeated under the same token (its COMMIT's answer lost): the rows the first one took.
    assert claim() == rows


def test_one_update_records_the_successes_of_many_claims(store: Store) -> None:
    keys = [f"A@m@{i}" for i in range(6)]
    store.upsert_pending([new(k) for k in keys], NOW)
    a, b = store.claim(keys[:2], now_ms=NOW, lease_until_ms=NOW + 50, token="t1")
    (c,) = store.claim(keys[2:3], now_ms=NOW, lease_until_ms=NOW + 50, token="t2")
    (d,) = store.claim(keys[3:4], now_ms=NOW, lease_until_ms=NOW + 5, token="t3")
    # d's lease ran out and it was claimed again: its first run's outcome must not count.
    (lost,) = store.expired_leases(NOW + 10)
    assert store.requeue_lost(lost, status=TaskStatus.PENDING, error="gone", now_ms=NOW + 10)
    (d2,) = store.claim(keys[3:4], now_ms=NOW + 10, lease_until_ms=NOW + 50, token="t4")
    (e,) = store.claim(keys[4:5], now_ms=NOW, lease_until_ms=NOW + 50, token="t5")

    def done(row: Any, token: str) -> Outcome:
        return Outcome(row.id, row.key, token, TaskStatus.DONE, NOW + 20, row.due_at_ms, None)

    sent = updates(store)
    batch = [done(a, "t1"), done(c, "t2"), done(d, "t3"), done(b, "t2"), done(e, "t5")]
    assert store.record(batch, NOW + 20) == 3
    assert len(sent) == 1
    status = {k: r.status for k, r in store.get_many(keys).items()}
    assert status == {
        keys[0]: TaskStatus.DONE,
        keys[1]: TaskStatus.RUNNING,  # recorded under another claim's token
        keys[2]: TaskStatus.DONE,
        keys[3]: TaskStatus.RUNNING,  # its stale run ended; the new one goes on
        keys[4]: TaskStatus.DONE,
        keys[5]: TaskStatus.PENDING,
    }
    done_row = store.get(keys[0])
    assert done_row is not None
    assert (done_row.finished_at_ms, done_row.updated_at_ms, done_row.lease_until_ms) == (
        NOW + 20,
        NOW + 20,
        None,
    )

    # The same task twice in a batch, the stale run first: the current run is still recorded.
    dead = Outcome(b.id, b.key, "t1", TaskStatus.DEAD, NOW + 30, b.due_at_ms, "no")
    assert store.record([done(d2, "t3"), done(d2, "t4"), dead], NOW + 30) == 2
    after = store.get_many([keys[1], keys[3]])
    assert (after[keys[1]].status, after[keys[1]].last_error) == (TaskStatus.DEAD, "no")
    assert after[keys[3]].status is TaskStatus.DONE


def test_many_successes_take_several_statements_in_one_batch(store: Store) -> None:
    keys = [f"A@m@{i}" for i in range(_MAX_LIST + 10)]
    store.upsert_pending([new(k) for k in keys], NOW)
    rows = store.claim(keys, now_ms=NOW, lease_until_ms=NOW + 50, token="t")
    outcomes = [
        Outcome(r.id, r.key, "t", TaskStatus.DONE, NOW + 1, r.due_at_ms, None) for r in rows
    ]
    assert store.record(outcomes, NOW + 1) == len(keys)
    assert store.counts() == {"done": len(keys)}


class _Upper(TypeDecorator[str]):
    impl = Integer
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> Any:
        return value


def test_a_statement_whose_values_need_conversion_is_not_prepared() -> None:
    with pytest.raises(TypeError, match="needs conversion"):
        Prepared.compile(
            select(T.c.id).where(T.c.id == bindparam("x", type_=_Upper())), sqlite.dialect()
        )
