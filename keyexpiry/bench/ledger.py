"""The `ledger` scenario: a ledger months old (10 M rows, 90 % finished, 10 % pending over the
next month), the time of each query the listener, reconciliation, the CLI and the dashboard run
on it, and the lateness of a wave due right after a listener (re)starts on it.

The rows are written by the database itself from a sequence (MariaDB's SEQUENCE engine, SQLite's
recursive CTE), and the pending rows' keys by a Lua script generating the same keys and due
times: minutes for 10 M rows, where `create_many` would take hours.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text

from keyexpiry import Client
from keyexpiry.bench import scenarios
from keyexpiry.bench.harness import Servers, analyze, settings_for
from keyexpiry.bench.servers import free_port
from keyexpiry.ledger.rows import Outcome, TaskStatus
from keyexpiry.ledger.store import Store

DAY_MS = 86_400_000
PENDING_SHARE = 10
"""One row in this many is pending; the rest are done (94 %), cancelled (5 %) or dead (1 %)."""
_STRIDE = 1000
"""Pending row n is due at slot (n % 1000) * slots + n // 1000 of the month: due order is not
insertion order, as in a real ledger (a page in due order reads rows all over the table)."""
_INSERT_CHUNK = 1_000_000
_KEYS_PER_SCRIPT = 20_000
_PROBE_BATCH = 256
"""Keys per claim, as the claimer's default `claim_batch`."""
_REPEATS = 5

QUERIES = (
    "claim",
    "record",
    "extend_lease",
    "get_many",
    "upcoming",
    "overdue",
    "expired_leases",
    "count_pending",
    "pending_keys_page",
    "pending_keys_page due soon",
    "runs_of a listener that ran 2 M tasks",
    "cancel",
    "list --status",
    "list (every status)",
    "prune batch",
    "active_counts",
    "pending_due_before",
    "overdue_rows",
    "running",
    "dead newest",
    "retrying",
    "search",
    "count_dead",
    "dead_page",
    "list --tag",
    "list --tag --status",
    "cancel_tag",
)
"""The reads and writes timed here: those tests/test_query_plans.py EXPLAINs (a test keeps the
two lists the same), on a ledger of the size asked for."""

_ARM_SCRIPT = """
local prefix, first, last = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local start, step, slots = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
for n = first, last do
  local due = start + ((n % 1000) * slots + math.floor(n / 1000)) * step
  redis.call('SET', prefix .. string.format('%d', n), '', 'PXAT', string.format('%d', due))
end
return last - first + 1
"""


@dataclass(frozen=True)
class LedgerShape:
    """Where the filled rows are: pending keys `{prefix}Bench@other@{1..pending}`, finished
    `{prefix}Bench@old@{1..finished}` (claimed by `gone:1:abc:{n // 1000}`)."""

    now_ms: int
    pending: int
    finished: int
    first_due_ms: int
    step_ms: int
    slots: int

    def due_of(self, n: int) -> int:
        """The due time of pending row `n` (what the SQL and the Lua script both compute)."""
        return self.first_due_ms + ((n % _STRIDE) * self.slots + n // _STRIDE) * self.step_ms


def _cat(dialect: str, *parts: str) -> str:
    return " || ".join(parts) if dialect == "sqlite" else f"CONCAT({', '.join(parts)})"


def _div(dialect: str, a: str, b: str) -> str:
    return f"({a} / {b})" if dialect == "sqlite" else f"({a} DIV {b})"


def _source(dialect: str, first: int, last: int) -> tuple[str, str]:
    """(WITH clause, FROM source) of the integers `seq` in [first, last]."""
    if dialect == "sqlite":
        return (
            f"WITH RECURSIVE s(seq) AS (SELECT {first} UNION ALL SELECT seq + 1 FROM s "
            f"WHERE seq < {last}) ",
            "s",
        )
    return "", f"seq_{first}_to_{last}"


_COLUMNS = (
    "INSERT INTO time_limit_task (task_key, class_name, method, args, status, attempts, "
    "due_at_ms, created_at_ms, updated_at_ms, started_at_ms, finished_at_ms, claimed_by, "
    "last_error) "
)


def _finished_sql(d: str, first: int, last: int) -> str:
    with_, source = _source(d, first, last)
    at = ":since + seq * :step"
    key = _cat(d, ":prefix", "'Bench@old@'", "seq")
    args = _cat(d, "'[\"'", "seq", "'\"]'")
    claimed_by = _cat(d, "'gone:1:abc:'", _div(d, "seq", "1000"))
    return (
        f"{with_}{_COLUMNS}SELECT {key}, 'Bench', 'old', {args}, "
        "CASE WHEN seq % 100 < 94 THEN 'done' WHEN seq % 100 < 99 THEN 'cancelled' "
        "ELSE 'dead' END, CASE WHEN seq % 100 = 99 THEN 3 ELSE 1 END, "
        f"{at}, :since, {at} + 2, {at} + 1, {at} + 2, {claimed_by}, "
        f"CASE WHEN seq % 100 = 99 THEN 'boom' END FROM {source}"
    )


def _pending_sql(d: str, first: int, last: int) -> str:
    with_, source = _source(d, first, last)
    key = _cat(d, ":prefix", "'Bench@other@'", "seq")
    args = _cat(d, "'[\"'", "seq", "'\"]'")
    slot = f"(seq % 1000) * :slots + {_div(d, 'seq', '1000')}"
    return (
        f"{with_}{_COLUMNS}SELECT {key}, 'Bench', 'other', {args}, 'pending', 0, "
        f":first + ({slot}) * :step, :now, :now, NULL, NULL, NULL, NULL FROM {source}"
    )


def fill(client: Client, rows: int) -> LedgerShape:
    """`rows` rows: a tenth pending, due over the month after the next hour (keys armed), the
    rest finished over the past 90 days. Returns where they are."""
    now = client.clock.now_ms()
    pending = rows // PENDING_SHARE
    finished = rows - pending
    slots = -(-pending // _STRIDE) + 1
    shape = LedgerShape(
        now_ms=now,
        pending=pending,
        finished=finished,
        first_due_ms=now + 3_600_000,
        step_ms=max(1, 30 * DAY_MS // (slots * _STRIDE)),
        slots=slots,
    )
    dialect = client.store.engine.dialect.name
    prefix = client.settings.key_prefix
    for sql, total, params in (
        (_finished_sql, finished, {"since": now - 90 * DAY_MS, "step": 90 * DAY_MS // finished}),
        (
            _pending_sql,
            pending,
            {"first": shape.first_due_ms, "slots": slots, "step": shape.step_ms},
        ),
    ):
        for first in range(1, total + 1, _INSERT_CHUNK):
            last = min(total, first + _INSERT_CHUNK - 1)
            with client.store.engine.begin() as conn:
                conn.execute(
                    text(sql(dialect, first, last)), {"prefix": prefix, "now": now, **params}
                )
    script = client.redis.register_script(_ARM_SCRIPT)
    for first in range(1, pending + 1, _KEYS_PER_SCRIPT):
        last = min(pending, first + _KEYS_PER_SCRIPT - 1)
        script(
            args=[f"{prefix}Bench@other@", first, last, shape.first_due_ms, shape.step_ms, slots]
        )
    analyze(client)
    return shape


def _probes(client: Client, n: int) -> list[str]:
    """`n` pending rows due a minute ago (no keys): what the timed claims take."""
    now = client.clock.now_ms()
    keys = [f"{client.settings.key_prefix}Bench@probe@{i}" for i in range(n)]
    with client.store.engine.begin() as conn:
        conn.execute(
            text(
                _COLUMNS + "VALUES (:k, 'Bench', 'probe', '[]', 'pending', 0, :due, :now, :now, "
                "NULL, NULL, NULL, NULL)"
            ),
            [{"k": k, "due": now - 60_000, "now": now} for k in keys],
        )
    return keys


def _timed(fn: Callable[[], object], repeats: int = _REPEATS) -> dict[str, float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return {"median_ms": round(statistics.median(times), 2), "max_ms": round(max(times), 2)}


def query_times(client: Client, shape: LedgerShape) -> dict[str, dict[str, float]]:
    """Median and max ms of `_REPEATS` runs of each query in `QUERIES`."""
    store: Store = client.store
    now = client.clock.now_ms()
    prefix = client.settings.key_prefix
    probes = _probes(client, _PROBE_BATCH * _REPEATS)
    batches = [probes[i : i + _PROBE_BATCH] for i in range(0, len(probes), _PROBE_BATCH)]
    claimed: list[list[Outcome]] = []

    def claim() -> None:
        rows = store.claim(
            batches[len(claimed)],
            now_ms=now,
            lease_until_ms=now + 60_000,
            token=f"bench:{len(claimed)}",
        )
        claimed.append(
            [
                Outcome(r.id, r.key, str(r.claimed_by), TaskStatus.DONE, now, r.due_at_ms, None)
                for r in rows
            ]
        )

    recorded = iter(claimed)
    middle = shape.due_of(shape.pending // 2)
    pending_key, finished_key = f"{prefix}Bench@other@7", f"{prefix}Bench@old@7"
    reads: dict[str, Callable[[], object]] = {
        # the listener and reconciliation
        "claim": claim,
        "record": lambda: store.record(next(recorded), now),
        "extend_lease": lambda: store.extend_lease(1, "bench:0", now + 5, now),
        "get_many": lambda: store.get_many([pending_key, finished_key]),
        "upcoming": lambda: store.upcoming(after_ms=now, upto_ms=now + 60_000, limit=50_000),
        "overdue": lambda: store.overdue(now_ms=now, limit=1000),
        "expired_leases": lambda: store.expired_leases(now),
        "count_pending": store.count_pending,
        "pending_keys_page": lambda: store.pending_keys_page(after=(middle, ""), limit=500),
        "pending_keys_page due soon": lambda: store.pending_keys_page(
            upto_ms=now + 300_000, limit=500
        ),
        "runs_of a listener that ran 2 M tasks": lambda: store.runs_of("gone:1:abc"),
        "cancel": lambda: store.cancel([f"{prefix}Bench@other@{shape.pending}"], now),
        "list --status": lambda: store.list_tasks(TaskStatus.PENDING, 50),
        "list (every status)": lambda: store.list_tasks(None, 50),
        "prune batch": lambda: store.delete_finished_before(
            TaskStatus.DONE, now - 60 * DAY_MS, 1000
        ),
        # the dashboard and /metrics
        "active_counts": store.active_counts,
        "pending_due_before": lambda: store.pending_due_before([now, now + 60_000]),
        "overdue_rows": lambda: store.overdue_rows(now_ms=now, limit=20),
        "running": lambda: store.rows_with_status(TaskStatus.RUNNING, limit=20),
        "dead newest": lambda: store.rows_with_status(TaskStatus.DEAD, limit=20, newest_first=True),
        "retrying": lambda: store.retrying(limit=20),
        "search": lambda: store.search(f"{prefix}Bench@old@1", limit=100),
        "count_dead": lambda: store.count_dead(class_name="Bench", since_ms=now - 7 * DAY_MS),
        "dead_page": lambda: store.dead_page(after_id=0, limit=500, class_name="Bench"),
        # business code's reads by tag
        "list --tag": lambda: store.list_tasks(None, 50, tag="order:7"),
        "list --tag --status": lambda: store.list_tasks(TaskStatus.PENDING, 50, tag="order:7"),
        "cancel_tag": lambda: store.cancel_tag("order:8", now),
    }
    assert tuple(reads) == QUERIES
    times: dict[str, dict[str, float]] = {}
    for name, fn in reads.items():
        try:
            times[name] = _timed(fn)
        except (AttributeError, TypeError):  # a query (or an argument) the base lacks (A/B)
            times[name] = {"median_ms": float("nan"), "max_ms": float("nan")}
    return times


def ledger(srv: Servers, backend: str, *, rows: int, wave: int = 10_000) -> dict[str, Any]:
    """Fill a ledger of `rows`; time each query on it; then a wave of `wave` tasks due over 10 s
    right after a listener starts (lateness to handler start), and the same wave once a fresh
    listener's start-up pass has ended (`settled_*`; `full_pass_s` is that pass's length)."""
    urls = srv.fresh(backend)
    with Client(settings_for(*urls)) as client:
        start = time.perf_counter()
        shape = fill(client, rows)
        fill_s = time.perf_counter() - start
        queries = query_times(client, shape)
    restart = scenarios.due_wave(srv, urls, driver=True, n=wave, span_s=10, cap_s=60)
    # The same wave for a listener whose start-up pass has ended: the lateness of a ledger this
    # big without a restart, and the length of that pass (from the listener's start).
    settled = scenarios.due_wave(
        srv, urls, driver=True, n=wave, span_s=10, cap_s=60, settle_port=free_port()
    )
    figures = dict(restart)
    figures.update(
        rows=rows,
        pending=shape.pending,
        fill_s=round(fill_s, 1),
        full_pass_s=settled["full_pass_s"],
        settled_late_p50_ms=settled["late_p50_ms"],
        settled_late_p99_ms=settled["late_p99_ms"],
        settled_late_max_ms=settled["late_max_ms"],
        queries=queries,
    )
    return figures


def format_queries(result: dict[str, Any]) -> str:
    """The query table of one run: name, median and max ms."""
    queries: dict[str, dict[str, float]] = result["queries"]
    width = max(len(n) for n in queries)
    lines = [f"{'query'.ljust(width)}  median ms  max ms"]
    lines += [
        f"{name.ljust(width)}  {q['median_ms']:>9.2f}  {q['max_ms']:>6.2f}"
        for name, q in queries.items()
    ]
    return "\n".join(lines)
