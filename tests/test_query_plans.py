"""The dashboard's and /metrics' ledger reads use an index, never a full scan of the table, on
MariaDB with most rows finished (as a ledger months old is). Each query is captured as it is
really sent, then EXPLAINed with the same parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import event, insert, text

from keyexpiry.rows import TaskStatus
from keyexpiry.store import Store, T, make_engine

NOW = 1_900_000_000_000
FINISHED = 20_000


def _row(key: str, status: str, due_ms: int, **extra: Any) -> dict[str, Any]:
    cls, method, arg = key.split("@")
    return {
        "task_key": key, "class_name": cls, "method": method, "args": f'["{arg}"]',
        "status": status, "attempts": 1, "due_at_ms": due_ms, "created_at_ms": NOW,
        "updated_at_ms": NOW, **extra,
    }  # fmt: skip


def _fill(store: Store) -> None:
    """Rows written as they end up, not updated into place: an UPDATE of `status` leaves
    delete-marked index entries until InnoDB's purge runs, which no months-old ledger has."""
    rows = [_row(f"Done@m@{i}", "done", NOW - 86_400_000 + i) for i in range(FINISHED)]
    rows += [_row(f"Probe@record@{i}", "dead", NOW + i, finished_at_ms=NOW) for i in range(20)]
    rows += [
        _row(f"Probe@record@{i}", "running", NOW + i, lease_until_ms=NOW + 5000)
        for i in range(20, 25)
    ]
    rows += [_row(f"Probe@record@{i}", "pending", NOW + i) for i in range(25, 300)]
    with store.engine.begin() as conn:
        conn.execute(insert(T), rows)
    with store.engine.begin() as conn:
        conn.execute(text("ANALYZE TABLE time_limit_task"))


def test_dashboard_and_metrics_reads_use_an_index(mysql_url: str) -> None:
    store = Store(make_engine(mysql_url))
    store.create_schema()
    _fill(store)
    sent: list[tuple[str, Any]] = []

    @event.listens_for(store.engine, "before_cursor_execute")
    def capture(_c: Any, _cur: Any, statement: str, params: Any, _ctx: Any, _many: bool) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "time_limit_task" in statement:
            sent.append((statement, params))

    reads: dict[str, Callable[[], object]] = {
        "active_counts": store.active_counts,
        "pending_due_before": lambda: store.pending_due_before([NOW, NOW + 60_000]),
        "overdue_rows": lambda: store.overdue_rows(now_ms=NOW, limit=20),
        "running": lambda: store.rows_with_status(TaskStatus.RUNNING, limit=20),
        "dead newest": lambda: store.rows_with_status(TaskStatus.DEAD, limit=20, newest_first=True),
        "retrying": lambda: store.retrying(limit=20),
        "search": lambda: store.search("Probe@record@1", limit=100),
        "count_dead": lambda: store.count_dead(class_name="Probe", since_ms=NOW - 1),
        "dead_page": lambda: store.dead_page(after_id=0, limit=500, class_name="Probe"),
    }
    problems: list[str] = []
    raw = store.engine.raw_connection()
    try:
        cur = raw.cursor()
        for name, read in reads.items():
            sent.clear()
            read()
            assert sent, f"{name}: no SELECT captured"
            for statement, params in sent:
                cur.execute("EXPLAIN " + statement, params)
                columns = [d[0] for d in cur.description]
                for plan in cur.fetchall():
                    row = dict(zip(columns, plan, strict=True))
                    if row["type"] == "ALL" or row["key"] is None:
                        problems.append(f"{name}: {row}")
                    elif int(row["rows"] or 0) > FINISHED // 10:
                        problems.append(f"{name}: walks {row['rows']} rows: {row}")
    finally:
        raw.close()
        store.engine.dispose()
    assert not problems, "\n".join(problems)
