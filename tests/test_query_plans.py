"""Every ledger read of the listener, reconciliation, the dashboard and /metrics uses an index
range that skips finished rows, on MariaDB and on PostgreSQL with 2 M finished rows (a ledger
months old). Each query is captured as it is really sent, then EXPLAINed with the same
parameters."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from psycopg import ClientCursor
from sqlalchemy import event, insert, text

from keyexpiry.bench.ledger import QUERIES
from keyexpiry.ledger.rows import TaskStatus
from keyexpiry.ledger.store import Outcome, Store, T, make_engine
from keyexpiry.ledger.table import index_on
from tests.ke import see_raw_outcomes

NOW = 1_900_000_000_000
DAY = 86_400_000
FINISHED = 2_000_000
"""Finished rows: done, and one in 400 dead (5,000, finished over the past day)."""
LATER = 20_000
"""Pending rows due next month, never run."""

# Pages and lists ordered by due time read that order off the index: a sort there would sort
# every pending row for each page of 1,000. (Retrying sorts the pending rows that failed, a
# range of their own index: a few, not every pending row.)
UNSORTED = {
    "upcoming", "overdue", "pending_keys_page", "pending_keys_page due soon",
    "list --status", "overdue_rows", "running", "dead newest", "retrying", "prune batch",
    "list (every status)", "list --tag",
    "list --tag --status",
}  # fmt: skip
# Retention walks finished rows on purpose, 1,000 at a time (LIMIT), in index order; the
# unfiltered list reads the first 50 of each status, finished ones included. The counts of
# live rows read each pending row's index entry once (/metrics caches them 5 s).
FINISHED_ON_PURPOSE = {"prune batch", "list (every status)"}
LIVE_ON_PURPOSE = {"count_pending", "active_counts"}
# Keyset pages over pending rows: their range is every pending row after the page's first, but
# read in index order (no sort, checked below) the LIMIT ends the read after one page. (Only if
# the range starts at the page: on PostgreSQL no Filter may skip rows before it.)
PAGED = {"pending_keys_page", "list --status"}
# Read off one index alone, no row lookups: the walk over every pending key, and the reads
# whose range holds many finished rows (every dead task; a day's finished rows).
INDEX_ONLY = {"pending_keys_page", "pending_keys_page due soon", "count_dead", "prune batch"}
WALKS_ON_PURPOSE = FINISHED_ON_PURPOSE | LIVE_ON_PURPOSE | PAGED
MAX_ROWS = 10_000
"""Rows an index range may hold unless its read walks them on purpose (MariaDB: EXPLAIN's
estimate of them; PostgreSQL: counted, `_pg_scans`)."""
MAX_SORTED = 1000
"""Rows a read whose order should come off an index may sort."""


def _row(key: str, status: str, due_ms: int, **extra: Any) -> dict[str, Any]:
    """A row with every column named: one INSERT of many rows takes its columns from the first
    (a `tag` only later rows give would be dropped)."""
    cls, method, arg = key.split("@")
    return {
        "task_key": key, "class_name": cls, "method": method, "args": f'["{arg}"]',
        "status": status, "attempts": 1, "due_at_ms": due_ms, "created_at_ms": NOW,
        "updated_at_ms": NOW, "finished_at_ms": None, "lease_until_ms": None,
        "claimed_by": None, "tag": None, **extra,
    }  # fmt: skip


def _probe_rows() -> list[dict[str, Any]]:
    """The rows the reads look for: dead, running (claimed by a listener gone), pending tagged."""
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
    return rows


def _fill_mariadb(store: Store) -> None:
    """Rows written as they end up, not updated into place: an UPDATE of `status` leaves
    delete-marked index entries until InnoDB's purge runs, which no months-old ledger has.
    The finished rows come from MariaDB's SEQUENCE engine, server-side (seconds, not minutes);
    they were all run by one listener, the one that is silent now."""
    with store.engine.begin() as conn:
        conn.execute(insert(T), _probe_rows())
        # InnoDB builds an index on 2 M rows by sorting them far faster than it grows seven
        # indexes row by row: drop them, fill, and have the upgrade path build them again.
        for index in T.indexes:
            if index_on(str(index.name), conn.dialect):
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
            {"one": 1, "now": NOW, "day": DAY},
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
            {"now": NOW, "day": DAY},
        )
    assert store.create_schema(all_indexes=True) == []
    with store.engine.begin() as conn:
        conn.execute(text("ANALYZE TABLE time_limit_task"))


def _fill_postgres(store: Store) -> None:
    """The same rows as `_fill_mariadb`, from `generate_series`; then VACUUM, which a
    months-old ledger has had (autovacuum): the visibility map it sets is what lets an index
    range be read without looking up each row (an index-only scan)."""
    with store.engine.begin() as conn:
        conn.execute(insert(T), _probe_rows())
        # As on MariaDB: building each index once, by sorting, is far faster than growing
        # them row by row. PostgreSQL names an index within the schema (no ON table).
        for index in T.indexes:
            if index_on(str(index.name), conn.dialect):
                conn.execute(text(f"DROP INDEX {index.name}"))
        # The times as bigint literals, added to `g`.
        conn.execute(
            text(
                "INSERT INTO time_limit_task (task_key, class_name, method, args, status, "
                "attempts, due_at_ms, created_at_ms, updated_at_ms, finished_at_ms, claimed_by) "
                "SELECT 'Done@m@' || g, 'Done', 'm', '[\"' || g || '\"]', "
                "CASE WHEN g % 400 = 0 THEN 'dead' ELSE 'done' END, 1, "
                f"{NOW - DAY} + g, {NOW}, {NOW}, {NOW - DAY} + g, 'gone:1:abc:' || (g / 1000) "
                f"FROM generate_series(1, {FINISHED}) AS g"
            )
        )
        conn.execute(
            text(
                "INSERT INTO time_limit_task (task_key, class_name, method, args, status, "
                "attempts, due_at_ms, created_at_ms, updated_at_ms) "
                "SELECT 'Later@m@' || g, 'Later', 'm', '[]', 'pending', 0, "
                f"{NOW + DAY} + g, {NOW}, {NOW} "
                f"FROM generate_series(1, {LATER}) AS g"
            )
        )
    assert store.create_schema(all_indexes=True) == []
    # VACUUM runs outside a transaction only.
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM (ANALYZE) time_limit_task"))


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


def _reads(store: Store) -> dict[str, Callable[[], object]]:
    """Each ledger read (and write) the test EXPLAINs, by the name the ledger benchmark uses."""
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
    return reads


def _sent_statements(
    store: Store, reads: dict[str, Callable[[], object]] | None = None
) -> Iterator[tuple[str, str, Any]]:
    """(read's name, statement, parameters) of each ledger statement each read (by default
    every one of `_reads`) sends, as the driver gets it, read by read: EXPLAIN one before the
    next read runs."""
    sent: list[tuple[str, Any]] = []

    def capture(_c: Any, _cur: Any, statement: str, params: Any, _ctx: Any, _many: bool) -> None:
        verb = statement.lstrip().split(None, 1)[0].upper()
        # WITH: PostgreSQL's claim, an UPDATE … RETURNING in a CTE.
        if verb in ("SELECT", "UPDATE", "DELETE", "WITH") and "time_limit_task" in statement:
            sent.append((statement, params))

    # The main pool, and the autocommit one (claims, single creates).
    engines = [e for e in (store.engine, store._autocommit) if e is not None]
    for engine in engines:
        event.listen(engine, "before_cursor_execute", capture)
    # A MariaDB claim sends its statements straight to PyMySQL, back to back, with their values
    # written in (`ClaimQueries._claim_pipelined`): no cursor event; seen where they are made.
    texts = store._claim_texts

    def claim_texts(*args: Any) -> list[str]:
        made = texts(*args)
        for statement in made:
            capture(None, None, statement, None, None, False)
        return made

    store._claim_texts = claim_texts  # type: ignore[method-assign,assignment]
    # PostgreSQL's claim goes to psycopg's own cursor (`ClaimQueries._claim_returning`): no
    # cursor event either; seen as it is sent.
    named_rows = store._autocommitted_named_rows

    def autocommitted_named_rows(sql: str, params: Any) -> Any:
        capture(None, None, sql, params, None, False)
        return named_rows(sql, params)

    store._autocommitted_named_rows = autocommitted_named_rows  # type: ignore[method-assign]
    # So are its outcomes' successes (`OutcomeQueries._record_plain_raw`).
    see_raw_outcomes(store, lambda sql, params: capture(None, None, sql, params, None, False))
    try:
        for name, read in (_reads(store) if reads is None else reads).items():
            sent.clear()
            read()
            assert sent, f"{name}: no statement captured"
            for statement, params in list(sent):
                yield name, statement, params
    finally:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", capture)


def _is_select(statement: str) -> bool:
    return statement.lstrip().upper().startswith("SELECT")


# Building the eight secondary indexes over 2 M rows takes most of a minute on 2 cores, and
# twice that when other processes share them: the suite's 120 s would fail a plan that is fine.
@pytest.mark.timeout(240)
@pytest.mark.xdist_group("heavy")
def test_dashboard_and_metrics_reads_use_an_index(mysql_url: str) -> None:
    store = Store(make_engine(mysql_url))
    store.create_schema()
    _fill_mariadb(store)
    problems: list[str] = []
    raw = store.engine.raw_connection()
    try:
        cur = raw.cursor()
        for name, statement, params in _sent_statements(store):
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
                elif rows > MAX_ROWS and name not in WALKS_ON_PURPOSE:
                    problems.append(f"{name}: walks {row['rows']} rows: {row}")
                elif name in UNSORTED and "Using filesort" in extra and rows > MAX_SORTED:
                    problems.append(f"{name}: sorts instead of reading the index: {row}")
                elif name in INDEX_ONLY and _is_select(statement) and "Using index" not in extra:
                    problems.append(f"{name}: reads rows, not the index alone: {row}")
    finally:
        raw.close()
        store.engine.dispose()
    assert not problems, "\n".join(problems)


def _plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """`node` and every node under it (its "Plans", recursively)."""
    yield node
    for child in node.get("Plans", ()):
        yield from _plan_nodes(child)


def _unwrapped(cond: str) -> str:
    """`cond` without the parentheses that enclose all of it."""
    cond = cond.strip()
    while cond.startswith("(") and cond.endswith(")"):
        depth, quoted = 0, False
        for i, ch in enumerate(cond):
            if ch == "'":
                quoted = not quoted
            elif not quoted and ch in "()":
                depth += 1 if ch == "(" else -1
                if depth == 0 and i < len(cond) - 1:
                    return cond  # "(a) AND (b)": the first parenthesis closes early
        cond = cond[1:-1].strip()
    return cond


def _conjuncts(cond: str) -> list[str]:
    """The terms of the AND that `cond` (a condition as EXPLAIN prints it) is."""
    cond = _unwrapped(cond)
    terms, depth, quoted, start = [], 0, False, 0
    for i, ch in enumerate(cond):
        if ch == "'":
            quoted = not quoted
        elif not quoted and ch in "()":
            depth += 1 if ch == "(" else -1
        elif not quoted and depth == 0 and cond.startswith(" AND ", i):
            terms.append(cond[start:i])
            start = i + len(" AND ")
    terms.append(cond[start:])
    return [_unwrapped(t) for t in terms]


_COLUMN_TEST = re.compile(r"^\(?(\w+)\)?(?:::[a-z ]+?)?\s*(=|<=|>=|<|>|IS NULL|IS NOT NULL)")
_ROW_TEST = re.compile(r"^ROW\(\(?(\w+)")


@dataclass
class _PgIndex:
    columns: list[str]
    """Its key columns, in order (not an INCLUDE list)."""
    where: str | None
    """A partial index's predicate."""
    unique: bool = False


def _range_bounds(index_cond: str | None, index: _PgIndex) -> list[str]:
    """The conditions that bound the range a B-tree scan of `index` walks: a partial index's
    predicate, and the terms of `index_cond` on its leading columns, equalities up to the first
    column compared otherwise. A term on a later column (`attempts` of (status, due_at_ms,
    task_key, attempts) when due_at_ms is not compared) is checked on each entry of the range,
    which it does not narrow."""
    by_column: dict[str, list[tuple[str, bool]]] = {}
    for term in _conjuncts(index_cond) if index_cond else []:
        row = _ROW_TEST.match(term)
        test = _COLUMN_TEST.match(term)
        if row is not None:  # ROW(a, b) > ROW(x, y): a range starting at (x, y)
            by_column.setdefault(row.group(1), []).append((term, False))
        elif test is not None:
            equal = test.group(2) in ("=", "IS NULL")  # `= ANY (…)`: a few equal ranges
            by_column.setdefault(test.group(1), []).append((term, equal))
    bounds = [] if index.where is None else [index.where]
    for column in index.columns:
        terms = by_column.get(column, [])
        bounds += [term for term, _ in terms]
        if not terms or not any(equal for _, equal in terms):
            break
    return bounds


@dataclass
class _PgScan:
    """A node of a plan that reads `time_limit_task` (or one of its indexes), measured."""

    node: dict[str, Any]
    walked: int | None
    """Rows in the index range it walks (the whole table for a full scan); None for a Bitmap
    Heap Scan, which reads the rows its Bitmap Index Scans found."""
    returned: int
    """Rows it returns: those of its range that pass every condition."""

    def __str__(self) -> str:
        kind, node = self.node["Node Type"], self.node
        where = node.get("Index Name") or node.get("Relation Name")
        conds = "; ".join(
            f"{key}: {node[key]}" for key in ("Index Cond", "Recheck Cond", "Filter") if key in node
        )
        walked = "" if self.walked is None else f"walks {self.walked}, "
        counted = f"{walked}returns {self.returned}, estimated {node['Plan Rows']}"
        return f"{kind} on {where} ({counted}; {conds})"


_OUTER_VALUE = re.compile(
    r"^\(?(\w+)\)?(?:::[a-z ]+?)? = (?:ANY \(\$\d+\)|\(?\w+\.\w+\)?(?:::[a-z ]+?)?)$"
)
"""`column = outer.column` or `column = ANY ($1)`: a value the statement computed before this
scan (a correlated subquery's row, an InitPlan's array), which no count outside it can name."""


def _by_outer_values(cond: str | None, index: _PgIndex | None) -> bool:
    """Whether `cond` looks a unique index up by values computed earlier in the statement:
    each is at most one row, so the scan reads no more rows than it was given values."""
    if not cond or index is None or not index.unique:
        return False
    terms = _conjuncts(cond)
    matched = [m.group(1) for t in terms if (m := _OUTER_VALUE.match(t))]
    return len(matched) == len(terms) and set(matched) == set(index.columns)


def _pg_scans(
    plan: dict[str, Any], indexes: dict[str, _PgIndex], count: Callable[[list[str]], int]
) -> dict[int, _PgScan]:
    """Each node of `plan` that reads the table, by its id(): its range and its rows, counted.

    Counted, not EXPLAIN's estimates: PostgreSQL multiplies the selectivities of `status =
    'pending'` and `due_at_ms <= now` as if they were independent, and a months-old ledger's
    finished rows are all due in the past, so it estimates 20,000 overdue rows where 73 are;
    and an estimate counts the rows a scan returns, not those its range walks past."""
    scans: dict[int, _PgScan] = {}
    for node in _plan_nodes(plan):
        index = node.get("Index Name")
        if "Scan" not in node["Node Type"] or not (
            node.get("Relation Name") == T.name or index in indexes
        ):
            continue
        own = [node[key] for key in ("Index Cond", "Recheck Cond", "Filter") if key in node]
        cond = node.get("Index Cond", node.get("Recheck Cond"))
        if _by_outer_values(cond, indexes.get(index or "")) or (
            node["Node Type"] == "Bitmap Heap Scan" and "ANY ($" in str(cond)
        ):
            scans[id(node)] = _PgScan(node, None, node["Plan Rows"])
            continue
        if node["Node Type"] == "Bitmap Heap Scan":
            walked = None
        elif index in indexes:
            walked = count(_range_bounds(node.get("Index Cond"), indexes[index]))
            own += [] if indexes[index].where is None else [indexes[index].where]
        else:
            walked = count([])  # a Seq Scan reads every row
        scans[id(node)] = _PgScan(node, walked, count(own))
    return scans


def _pg_problems(
    name: str, statement: str, plan: dict[str, Any], scans: dict[int, _PgScan]
) -> Iterator[str]:
    """What is wrong with `plan` (EXPLAIN (FORMAT JSON)'s "Plan") of `name`'s `statement`."""
    for node in _plan_nodes(plan):
        kind = node["Node Type"]
        scan = scans.get(id(node))
        if scan is not None and kind == "Seq Scan":
            yield f"{name}: reads the whole table: {scan}"
        elif (
            scan is not None
            and scan.walked is not None
            and scan.walked > MAX_ROWS
            and name not in FINISHED_ON_PURPOSE | LIVE_ON_PURPOSE
            # A page read in index order (no sort: checked below) ends at its LIMIT, as long
            # as its range starts at the page's first row: no Filter skips rows before it.
            and not (name in PAGED and scan.walked == scan.returned)
        ):
            yield f"{name}: walks {scan.walked} rows: {scan}"
        elif kind in ("Sort", "Incremental Sort") and name in UNSORTED:
            # A sort reads all of its input before it returns a row: the order did not come off
            # an index. An incremental one sorts each group of its presorted keys; how big they
            # are a plan does not say, so its input counts whole.
            inputs = node.get("Plans", ())
            sorted_rows = sum(
                max(c["Plan Rows"], scans[id(c)].returned if id(c) in scans else 0) for c in inputs
            )
            if sorted_rows > MAX_SORTED:
                below = "; ".join(str(scans[id(n)]) for c in inputs for n in _plan_nodes(c)
                                  if id(n) in scans)  # fmt: skip
                keys = ", ".join(node.get("Sort Key", ()))
                yield f"{name}: sorts {sorted_rows} rows by {keys}, read by {below}"
        elif (
            scan is not None
            and name in INDEX_ONLY
            and _is_select(statement)
            and kind != "Index Only Scan"
        ):
            yield f"{name}: reads rows, not the index alone: {scan}"


# The fill and the index builds take 15-20 s on 2 cores; as the MariaDB test, time to spare.
@pytest.mark.timeout(240)
@pytest.mark.xdist_group("heavy")
def test_postgres_reads_use_an_index(pg_url: str) -> None:
    store = Store(make_engine(pg_url))
    store.create_schema()
    _fill_postgres(store)
    try:
        problems = _pg_plan_problems(store)
    finally:
        store.engine.dispose()
    assert not problems, "\n".join(problems)


def _pg_store_with_due_rows(pg_url: str, prefix: str, n: int) -> Store:
    """A ledger on `pg_url` holding `n` pending rows due before NOW, keys `prefix@1` … `@n`,
    written by one statement (no statistics taken)."""
    store = Store(make_engine(pg_url))
    store.create_schema()
    cls, method = prefix.split("@")
    with store.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO time_limit_task (task_key, class_name, method, args, status, "
                "attempts, due_at_ms, created_at_ms, updated_at_ms) "
                f"SELECT '{prefix}@' || g, '{cls}', '{method}', '[]', 'pending', 0, "
                f"{NOW} - g, {NOW}, {NOW} FROM generate_series(1, {n}) AS g"
            )
        )
    return store


@pytest.mark.timeout(120)
@pytest.mark.xdist_group("heavy")
def test_a_postgres_claim_finds_its_rows_by_key_whatever_the_backlog(pg_url: str) -> None:
    """30,000 tasks fell due at once (a wave, or the backlog after downtime) in a table whose
    statistics have not seen them: a claim of 256 of their keys must look those up, not walk
    every due row. (It walked all 30,000 on the `(status, due_at_ms, …)` index: a claim's cost
    grew with the backlog it was there to drain, and a wave ran at half MariaDB's rate.)"""
    store = _pg_store_with_due_rows(pg_url, "Wave@m", 30_000)
    keys = [f"Wave@m@{i}" for i in range(1, 257)]
    reads: dict[str, Callable[[], object]] = {
        "claim": lambda: store.claim(keys, now_ms=NOW, lease_until_ms=NOW + 1, token="x:1")
    }
    try:
        problems = _pg_plan_problems(store, reads)
    finally:
        store.engine.dispose()
    assert not problems, "\n".join(problems)


def _numbered(statement: str) -> tuple[str, list[str]]:
    """`statement`'s named parameters (psycopg's `%(name)s`) as PREPARE's `$1`, `$2`, …, and
    the names in their order."""
    names: list[str] = []

    def number(m: re.Match[str]) -> str:
        if m.group(1) not in names:
            names.append(m.group(1))
        return f"${names.index(m.group(1)) + 1}"

    return re.sub(r"%\((\w+)\)s", number, statement).replace("%%", "%"), names


@pytest.mark.timeout(120)
def test_a_new_postgres_ledger_keeps_key_lookups_in_its_cached_plans(pg_url: str) -> None:
    """psycopg prepares a statement after five runs, and PostgreSQL may then keep one generic
    plan for it for the connection's life. Made on a new ledger, never analyzed (taken for 10
    pages), the claim's and the outcomes' generic plans were Seq Scans, and stayed so while the
    table grew until the first autoanalyze (the Patroni soak's first minute). The pool those
    statements run on must give them index lookups in their generic plans too."""
    store = _pg_store_with_due_rows(pg_url, "Probe@record", 300)
    reads: dict[str, Callable[[], object]] = {
        "claim": lambda: store.claim(
            ["Probe@record@7", "Probe@record@8"], now_ms=NOW, lease_until_ms=NOW + 1, token="x:1"
        ),
        "record": lambda: _claim_and_record(store),
    }
    assert store._autocommit is not None
    problems: list[str] = []
    raw = store._autocommit.raw_connection()  # with the pool's own session settings
    try:
        driver: Any = raw.driver_connection
        driver.prepare_threshold = None
        cur = raw.cursor()
        # Values written into EXECUTE's arguments: the generic plan is the prepared text's.
        literal = ClientCursor(driver)
        for name, statement, params in _sent_statements(store, reads):
            prepared, names = _numbered(statement)
            cur.execute(f"PREPARE hot AS {prepared}")
            cur.execute("SET plan_cache_mode = force_generic_plan")
            args = ", ".join(["%s"] * len(names))
            literal.execute(
                f"EXPLAIN (FORMAT JSON) EXECUTE hot({args})", [params[n] for n in names]
            )
            ((explained,),) = literal.fetchall()
            if isinstance(explained, str):
                explained = json.loads(explained)
            plan = explained[0]["Plan"]
            problems += [
                f"{name}: a generic plan reads the whole table: {statement}"
                for node in _plan_nodes(plan)
                if node["Node Type"] == "Seq Scan" and node.get("Relation Name") == T.name
            ]
            cur.execute("DEALLOCATE hot")
            cur.execute("RESET plan_cache_mode")
            raw.rollback()
    finally:
        raw.rollback()
        raw.close()
        store.engine.dispose()
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(120)
def test_postgres_claims_and_outcomes_run_on_one_generic_plan(pg_url: str) -> None:
    """psycopg prepares a statement after five runs; left to choose, PostgreSQL judged the
    claim's generic plan dearer than its custom ones and planned every claim again, most of a
    claim's server time. The claims and outcomes of the pool they run on must use the one
    generic plan from the first prepared run on (none planned for its values)."""
    store = _pg_store_with_due_rows(pg_url, "Probe@record", 300)
    try:
        for i in range(1, 13):
            token = f"x:{i}"
            (row,) = store.claim(
                [f"Probe@record@{i}"], now_ms=NOW, lease_until_ms=NOW + 1000, token=token
            )
            done = Outcome(row.id, row.key, token, TaskStatus.DONE, NOW, row.due_at_ms, None)
            assert store.record([done], NOW) == 1
        assert store._autocommit is not None
        # One connection served every call (one at a time): its prepared statements are theirs.
        assert store._autocommit.pool.checkedin() == 1  # type: ignore[attr-defined]
        with store._autocommit.connect() as conn:
            plans = conn.execute(
                text(
                    "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
                    " WHERE statement LIKE '%time_limit_task%'"
                )
            ).all()
    finally:
        store.engine.dispose()
    kinds = {"claim": "UNION ALL", "outcome": "unnest"}
    for kind, sign in kinds.items():
        found = [
            p for p in plans if sign in p.statement and "UPDATE time_limit_task" in p.statement
        ]
        assert found, f"no prepared {kind} statement among {[p.statement[:60] for p in plans]}"
        for p in found:
            assert (p.custom_plans, p.generic_plans > 0) == (0, True), f"{kind}: {p}"


def _pg_plan_problems(
    store: Store, reads: dict[str, Callable[[], object]] | None = None
) -> list[str]:
    """What is wrong with the plans of the statements `reads` (by default every one of
    `_reads`) send."""
    problems: list[str] = []
    raw = store.engine.raw_connection()
    try:
        driver: Any = raw.driver_connection
        # No server-side prepared statements on this connection: after five runs of one text
        # psycopg prepares it, and a generic plan prints $1 where the values were.
        driver.prepare_threshold = None
        cur = raw.cursor()
        cur.execute(
            "SELECT c.relname, array_agg(a.attname ORDER BY k.n), "
            "pg_get_expr(i.indpred, i.indrelid), i.indisunique FROM pg_index i "
            "JOIN pg_class c ON c.oid = i.indexrelid "
            "CROSS JOIN unnest(i.indkey) WITH ORDINALITY AS k(attnum, n) "
            "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
            "WHERE i.indrelid = %(t)s::regclass AND k.n <= i.indnkeyatts "
            "GROUP BY c.relname, i.indpred, i.indrelid, i.indisunique",
            {"t": T.name},
        )
        indexes = {
            str(name): _PgIndex(list(cols), where, unique)
            for name, cols, where, unique in cur.fetchall()
        }

        def count(conditions: list[str]) -> int:
            # The conditions as the plan prints them: SQL, with the statement's values.
            where = " AND ".join(f"({c})" for c in conditions) or "true"
            try:
                cur.execute(f"SELECT count(*) FROM {T.name} WHERE {where}")
            except store.engine.dialect.loaded_dbapi.Error as exc:
                raise AssertionError(f"cannot count the rows where {where}: {exc}") from exc
            ((n,),) = cur.fetchall()
            return int(n)

        for name, statement, params in _sent_statements(store, reads):
            # Server-side binding, as the ledger's own statement: the plan is the one its
            # values get. EXPLAIN without ANALYZE runs nothing (a claim's UPDATE included).
            cur.execute("EXPLAIN (FORMAT JSON) " + statement, params)
            ((explained,),) = cur.fetchall()
            if isinstance(explained, str):
                explained = json.loads(explained)
            plan = explained[0]["Plan"]
            found = list(_pg_problems(name, statement, plan, _pg_scans(plan, indexes, count)))
            if found:
                problems += found
                problems.append(f"  statement: {statement}\n  params: {params}")
            raw.rollback()  # EXPLAIN UPDATE locks the table (ROW EXCLUSIVE) until then
    finally:
        raw.rollback()
        raw.close()
    return problems
