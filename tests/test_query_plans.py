"""Every ledger read of the listener, reconciliation, the dashboard and /metrics uses an index
range that skips finished rows, on MariaDB with 2 M finished rows (a ledger months old). Each
query is captured as it is really sent, then EXPLAINed with the same parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import event, insert, text

from keyexpiry.bench.ledger import QUERIES
from keyexpiry.ledger.rows import TaskStatus
from keyexpiry.ledger.store import Outcome, Store, T, make_engine

NOW = 1_900_000_000_000
FINISHED = 2_000_000
"""Finished rows: done, and one in 400 dead (5,000, finished over the past day)."""
LATER = 20_000
"""Pending rows due next month, never run."""


def _row(key: str, status: str, due_ms: int, **extra: Any) -> dict[str, Any]:
    cls, method, arg = key.split("@")
    return {
        "task_key": key, "class_name": cls, "method": method, "args": f'["{arg}"]',
        "status": status, "attempts": 1, "due_at_ms": due_ms, "created_at_ms": NOW,
        "updated_at_ms": NOW, "finished_at_ms": None, "lease_until_ms": None,
        "claimed_by": None, **extra,
    }  # fmt: skip


def _fill(store: Store) -> None:
    """Rows written as they end up, not updated into place: an UPDATE of `status` leaves
    delete-marked index entries until InnoDB's purge runs, which no months-old ledger has.
    The finished rows come from MariaDB's SEQUENCE engine, server-side (seconds, not minutes);
    they were all run by one listener, the one that is silent now."""
    rows = [_row(f"Probe@record@{i}", "dead", NOW + i, finished_at_ms=NOW) for i in range(20)]
    rows += [
        _row(f"Probe@record@{i}", "running", NOW + i, lease_until_ms=NOW + 5000,
             claimed_by=f"gone:1:abc:{i}")
        for i in range(20, 25)
    ]  # fmt: skip
    rows += [
        _row(f"Probe@record@{i}", "pending", NOW + i, tag=f"order:{i % 100}")
        for i in range(25, 300)
    ]
    with store.engine.begin() as conn:
        conn.execute(insert(T), rows)
        # InnoDB builds an index on 2 M rows by sorting them far faster than it grows seven
        # indexes row by row: drop them, fill, and have the upgrade path build them again.
        for index in T.indexes:
            conn.execute(text(f"DROP INDEX {index.name} ON time_limit_task"))
        conn.execute(
            text(
                "INSERT INTO time_limit_task (task_key, class_name, method, args, status, "
                "attempts, due_at_ms, created_at_ms, updated_at_ms, finished_at_ms, claimed_by) "
                "SELECT CONCAT('Done@m@', seq), 'Done', 'm', CONCAT('[\"', seq, '\"]'), "
                "IF(seq % 400 = 0, 'dead', 'done'), :one, :now - :day + seq, :now, :now, "
                ":now - :day + seq, CONCAT('gone:1:abc:', seq DIV 1000) "
                f"FROM seq_1_to_{FINISHED}"
            ),
            {"one": 1, "now": NOW, "day": 86_400_000},
        )
        # Pending rows due next month that never ran: the retrying list must not walk them.
        conn.execute(
            text(
                "INSERT INTO time_limit_task (task_key, class_name, method, args, status, "
                "attempts, due_at_ms, created_at_ms, updated_at_ms) "
                "SELECT CONCAT('Later@m@', seq), 'Later', 'm', '[]', 'pending', 0, "
                ":now + :day + seq, :now, :now "
                f"FROM seq_1_to_{LATER}"
            ),
            {"now": NOW, "day": 86_400_000},
        )
    assert store.create_schema(all_indexes=True) == []
    with store.engine.begin() as conn:
        conn.execute(text("ANALYZE TABLE time_limit_task"))


def _claim_and_record(store: Store) -> None:
    """The recorder's statements: the successes of two claims and a failure, one batch."""
    rows = [
        row
        for i, key in enumerate(["Probe@record@60", "Probe@record@61", "Probe@record@62"])
        for row in store.claim([key], now_ms=NOW + 100, lease_until_ms=NOW + 200, token=f"x:{i}")
    ]
    assert len(rows) == 3
    outcomes = [
        Outcome(r.id, r.key, r.claimed_by or "", TaskStatus.DONE, NOW, r.due_at_ms, None)
        for r in rows
    ]
    dead = rows[2]
    outcomes[2] = Outcome(dead.id, dead.key, "x:2", TaskStatus.DEAD, NOW, dead.due_at_ms, "e")
    assert store.record(outcomes, NOW + 100) == 3


# Building the eight secondary indexes over 2 M rows takes most of a minute on 2 cores, and
# twice that when other processes share them: the suite's 120 s would fail a plan that is fine.
@pytest.mark.timeout(240)
def test_dashboard_and_metrics_reads_use_an_index(mysql_url: str) -> None:
    store = Store(make_engine(mysql_url))
    store.create_schema()
    _fill(store)
    sent: list[tuple[str, Any]] = []

    def capture(_c: Any, _cur: Any, statement: str, params: Any, _ctx: Any, _many: bool) -> None:
        verb = statement.lstrip().split(None, 1)[0].upper()
        if verb in ("SELECT", "UPDATE", "DELETE") and "time_limit_task" in statement:
            sent.append((statement, params))

    # The main pool, and the autocommit one (claims, single creates).
    for engine in (store.engine, store._autocommit):
        if engine is not None:
            event.listen(engine, "before_cursor_execute", capture)

    reads: dict[str, Callable[[], object]] = {
        # the listener and reconciliation
        "claim": lambda: store.claim(
            ["Probe@record@30", "Done@m@5"], now_ms=NOW, lease_until_ms=NOW + 1, token="x:1"
        ),
        "record": lambda: _claim_and_record(store),
        "extend_lease": lambda: store.extend_lease(1, "x:1", NOW + 5, NOW),
        "get_many": lambda: store.get_many(["Probe@record@40", "Done@m@7"]),
        "upcoming": lambda: store.upcoming(after_ms=NOW, upto_ms=NOW + 60_000, limit=1000),
        "overdue": lambda: store.overdue(now_ms=NOW + 100, limit=1000),
        "expired_leases": lambda: store.expired_leases(NOW + 10_000),
        "count_pending": store.count_pending,
        "pending_keys_page": lambda: store.pending_keys_page(after=(NOW + 100, ""), limit=500),
        "pending_keys_page due soon": lambda: store.pending_keys_page(upto_ms=NOW + 200, limit=500),
        "runs_of a listener that ran 2 M tasks": lambda: store.runs_of("gone:1:abc"),
        "cancel": lambda: store.cancel(["Probe@record@50"], NOW),
        "list --status": lambda: store.list_tasks(TaskStatus.PENDING, 50),
        "list (every status)": lambda: store.list_tasks(None, 50),
        "prune batch": lambda: store.delete_finished_before(TaskStatus.DONE, NOW - 1000, 1000),
        # the dashboard and /metrics
        "active_counts": store.active_counts,
        "pending_due_before": lambda: store.pending_due_before([NOW, NOW + 60_000]),
        "overdue_rows": lambda: store.overdue_rows(now_ms=NOW, limit=20),
        "running": lambda: store.rows_with_status(TaskStatus.RUNNING, limit=20),
        "dead newest": lambda: store.rows_with_status(TaskStatus.DEAD, limit=20, newest_first=True),
        "retrying": lambda: store.retrying(limit=20),
        "search": lambda: store.search("Probe@record@1", limit=100),
        "count_dead": lambda: store.count_dead(class_name="Probe", since_ms=NOW - 1),
        "dead_page": lambda: store.dead_page(after_id=0, limit=500, class_name="Probe"),
        # business code's reads by tag (a tag's tasks, finished ones included)
        "list --tag": lambda: store.list_tasks(None, 50, tag="order:7"),
        "list --tag --status": lambda: store.list_tasks(TaskStatus.PENDING, 50, tag="order:7"),
        "cancel_tag": lambda: store.cancel_tag("order:8", NOW),
    }
    # The ledger benchmark (`keyexpiry bench --scenario ledger`) times the same list on 10 M rows.
    assert tuple(reads) == QUERIES
    # Pages and lists ordered by due time read that order off the index: a filesort there
    # would sort every pending row for each page of 1,000. (Retrying sorts the pending rows
    # that failed, a range of their own index: a few, not every pending row.)
    unsorted = {
        "upcoming", "overdue", "pending_keys_page", "pending_keys_page due soon",
        "list --status", "overdue_rows", "running", "dead newest", "retrying", "prune batch",
        "list (every status)", "list --tag",
        "list --tag --status",
    }  # fmt: skip
    # Retention walks finished rows on purpose, 1,000 at a time (LIMIT), in index order; the
    # unfiltered list reads the first 50 of each status, finished ones included. The counts of
    # live rows read each pending row's index entry once (/metrics caches them 5 s).
    finished_on_purpose = {"prune batch", "list (every status)"}
    live_on_purpose = {"count_pending", "active_counts"}
    # Keyset pages over pending rows: EXPLAIN's estimate is their whole range, but read in index
    # order (no filesort, checked below) the LIMIT ends the read after one page.
    paged = {"pending_keys_page", "list --status"}
    # Read off one index alone, no row lookups: the walk over every pending key, and the reads
    # whose range holds many finished rows (every dead task; a day's finished rows).
    index_only = {"pending_keys_page", "pending_keys_page due soon", "count_dead", "prune batch"}
    problems: list[str] = []
    raw = store.engine.raw_connection()
    try:
        cur = raw.cursor()
        for name, read in reads.items():
            sent.clear()
            read()
            assert sent, f"{name}: no statement captured"
            for statement, params in sent:
                cur.execute("EXPLAIN " + statement, params)
                columns = [d[0] for d in cur.description]
                for plan in cur.fetchall():
                    row = dict(zip(columns, plan, strict=True))
                    rows = int(str(row["rows"] or 0).split()[0])
                    extra = str(row["Extra"]).split("; ")
                    if "noticed after reading const tables" in str(row["Extra"]):
                        # Rows read by a unique key first (a claim's keys) and found not to
                        # match: MariaDB names no index for that plan.
                        continue
                    if row["type"] == "ALL" or row["key"] is None:
                        problems.append(f"{name}: {row}")
                    elif (
                        rows > 10_000 and name not in finished_on_purpose | live_on_purpose | paged
                    ):
                        problems.append(f"{name}: walks {row['rows']} rows: {row}")
                    elif name in unsorted and "Using filesort" in extra and rows > 1000:
                        problems.append(f"{name}: sorts instead of reading the index: {row}")
                    elif (
                        name in index_only
                        and statement.lstrip().upper().startswith("SELECT")
                        and "Using index" not in extra
                    ):
                        problems.append(f"{name}: reads rows, not the index alone: {row}")
    finally:
        raw.close()
        store.engine.dispose()
    assert not problems, "\n".join(problems)
