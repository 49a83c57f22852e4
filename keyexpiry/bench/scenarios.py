"""The benchmark scenarios; each returns one dict of figures per run."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
from sqlalchemy import text

from keyexpiry import Client, TaskRequest
from keyexpiry.bench.harness import (
    ListenerProcess,
    Servers,
    analyze,
    count_status,
    lateness_and_rate,
    purge,
    redis_used_bytes,
    settings_for,
    wait_done,
    wait_reconciled,
)
from keyexpiry.ledger.store import TaskStatus

NOOP = "Bench@noop@%"
CHUNK = 10_000
COLD = 200
"""A fresh client's first creates, timed apart from its one-at-a-time rate."""
BLOCK = 500
"""One-at-a-time creates between two blocks of bare round trips."""


def _create_wave(
    client: Client,
    n: int,
    first_due_ms: int,
    span_ms: int,
    payload: Any = None,
    task: str = "Bench.noop",
) -> float:
    """Create `n` `task` tasks (noop by default; argument: their index) due evenly over
    [first_due, first_due + span], each carrying `payload`; return seconds taken."""
    start = time.perf_counter()
    step = span_ms / max(n - 1, 1)
    now = client.clock.now_ms()
    for base in range(0, n, CHUNK):
        client.create_many(
            TaskRequest(task, (i,), ttl_ms=int(first_due_ms + i * step) - now, payload=payload)
            for i in range(base, min(n, base + CHUNK))
        )
    return time.perf_counter() - start


def _create_others(client: Client, n: int) -> None:
    """`n` pending tasks due a day from now, for Redis's sweep to wade through."""
    for base in range(0, n, CHUNK):
        client.create_many(
            TaskRequest("Bench.other", (i,), ttl_s=86_400 + i % 3600)
            for i in range(base, min(n, base + CHUNK))
        )
    analyze(client)


def due_wave(
    srv: Servers,
    urls: tuple[str, str],
    *,
    driver: bool,
    n: int,
    span_s: float,
    cap_s: float,
    lead_s: float = 3.0,
    concurrency: int = 8,
    listeners: int = 1,
    cpu_cores: float | None = None,
    settle_port: int | None = None,
    payload: Any = None,
    listener_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """`n` tasks due over `span_s` seconds (each carrying `payload`); lateness, rate, listener
    CPU/RSS, fired by the cap.

    With several `listeners` the CPU is their sum, the RSS the largest, the lateness of all;
    they share the keys (`keyexpiry.listener.partition`) before the wave is created.
    `cpu_cores` gives each listener a CPU quota of its own; `listener_env`, more settings
    (`KEYEXPIRY_*`) for every listener.
    """
    redis_url, db_url = urls
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(Client(settings_for(redis_url, db_url)))
        procs = [
            stack.enter_context(
                ListenerProcess(
                    redis_url=redis_url,
                    db_url=db_url,
                    driver=driver,
                    concurrency=concurrency,
                    cpu_cores=cpu_cores,
                    http=f"127.0.0.1:{settle_port}" if settle_port and i == 0 else "",
                    extra_env=dict(listener_env or {}),
                )
            )
            for i in range(listeners)
        ]
        for proc in procs:
            proc.wait_subscribed(client, listeners=len(procs))
        settled_s = None
        if settle_port is not None:
            # The wave falls due only after the first listener's start-up reconciliation ended.
            settled_s = wait_reconciled(settle_port, cap_s=1800)
        if listeners > 1:
            _wait_sharing(client, listeners)
        ledger_pid = _ledger_pid(srv, _BACKENDS.get(client.store.engine.dialect.name, ""))
        ledger_cpu_s = _server_cpu_s(ledger_pid) if ledger_pid else 0.0
        wal_lsn = _wal_lsn(client)
        first_due = client.clock.now_ms() + int(lead_s * 1000)
        create_s = _create_wave(client, n, first_due, int(span_s * 1000), payload)
        # Above 0 the wave was still being created when it fell due: raise lead_s.
        created_after_first_due_ms = max(0, client.clock.now_ms() - first_due)
        wait_s = max(0.0, (first_due - client.clock.now_ms()) / 1000)
        # Only the wave's rows: the ledger scenario starts with millions of done rows.
        waited = wait_done(client, n, cap_s=wait_s + span_s + cap_s, key_like=NOOP)
        ledger_figures = {}
        if ledger_pid:
            ledger_figures["ledger_cpu_us_per_task"] = round(
                (_server_cpu_s(ledger_pid) - ledger_cpu_s) / n * 1e6
            )
        if wal_lsn is not None:
            ledger_figures["ledger_wal_bytes_per_task"] = round(_wal_since(client, wal_lsn) / n)
        cpu_s = sum(p.cpu_since_start() for p in procs)
        thread_cpu: dict[str, float] = {}
        switches: dict[str, int] = {}
        for p in procs:
            for name, spent in p.thread_cpu_since_start().items():
                thread_cpu[name] = round(thread_cpu.get(name, 0.0) + spent, 3)
            for name, count in p.thread_switches_since_start().items():
                switches[name] = switches.get(name, 0) + count
        figures = lateness_and_rate(client, NOOP, [p.starts_path for p in procs])
        figures.update(
            n=n,
            create_s=round(create_s, 3),
            created_after_first_due_ms=created_after_first_due_ms,
            all_fired=figures["fired"] == n,
            waited_s=round(waited, 1),
            listener_cpu_s=round(cpu_s, 2),
            listener_thread_cpu_s=thread_cpu,
            listener_thread_switches=switches,
            listener_rss_mb=round(max(p.rss_max_mb for p in procs), 1),
            listeners=listeners,
            max_attempts=_max_attempts(client),
            throttled_s=round(sum(p.throttled_s() for p in procs), 2),
            **ledger_figures,
        )
        if settled_s is not None:
            figures["full_pass_s"] = settled_s
        purge(client, NOOP)
    return figures


def _wait_sharing(client: Client, listeners: int, timeout_s: float = 30) -> None:
    """Until `listeners` are live in the heartbeat table, then two beats more: each has read
    the others and dropped the buckets it gave up (`Partition.hold_s`)."""
    deadline = time.monotonic() + timeout_s
    while len(client.store.live_members(client.clock.now_ms() - 5000)) < listeners:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{listeners} listeners never all beat")
        time.sleep(0.1)
    time.sleep(2 * client.settings.heartbeat_s + 0.5)


def _max_attempts(client: Client) -> int:
    from sqlalchemy import func, select

    from keyexpiry.ledger.store import T

    with client.store.engine.connect() as conn:
        got = conn.execute(select(func.max(T.c.attempts)).where(T.c.task_key.like(NOOP))).scalar()
    return int(got or 0)


def _autocommit(driver: Any, engine: str, on: bool) -> None:
    if engine == "postgresql":
        driver.autocommit = on  # psycopg: an attribute
    elif engine != "sqlite":
        driver.autocommit(on)  # PyMySQL: a method


@contextlib.contextmanager
def _bare_round_trips(client: Client) -> Iterator[Callable[[], None]]:
    """A call that makes the two round trips a create cannot do without, and nothing else: a
    no-op statement on a held ledger connection, committed by the server as it runs (as a
    single create's upsert is on MySQL/MariaDB), then a PING on a held Redis connection."""
    engine = client.store.engine.dialect.name
    raw = client.store.engine.raw_connection()
    driver: Any = raw.driver_connection
    pool = client.redis.connection_pool
    conn = pool.get_connection()
    cursor = None
    try:
        cursor = raw.cursor()
        # Set back below: the connection goes back to the pool.
        _autocommit(driver, engine, True)
        no_op = "DO 1" if engine in ("mysql", "mariadb") else "SELECT 1"

        def bare() -> None:
            cursor.execute(no_op)
            cursor.fetchall()
            conn.send_command("PING")  # type: ignore[no-untyped-call]
            conn.read_response()

        yield bare
    finally:
        if cursor is not None:
            cursor.close()
        _autocommit(driver, engine, False)
        pool.release(conn)
        raw.close()


def _server_cpu_s(pid: int) -> float:
    """CPU seconds of a server process and its children (PostgreSQL serves each connection
    from a process of its own; MariaDB and Redis from threads of one)."""
    total = 0.0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


_BACKENDS = {"mysql": "mariadb", "mariadb": "mariadb", "postgresql": "postgres"}
"""The benchmark's backend name of a ledger's SQLAlchemy dialect (SQLite's is this process)."""


def _wal_lsn(client: Client) -> str | None:
    """PostgreSQL: where its write-ahead log is now (None on another ledger)."""
    if not client.store.postgres:
        return None
    with client.store.engine.connect() as conn:
        return str(conn.execute(text("SELECT pg_current_wal_lsn()")).scalar_one())


def _wal_since(client: Client, lsn: str) -> int:
    """Bytes of write-ahead log the PostgreSQL ledger's server wrote since `lsn` (every
    database of it: the benchmark's server serves one at a time)."""
    with client.store.engine.connect() as conn:
        since = text("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), CAST(:lsn AS pg_lsn))")
        return int(conn.execute(since, {"lsn": lsn}).scalar_one())


def _ledger_pid(srv: Servers, backend: str) -> int | None:
    server = {"mariadb": srv.mariadb, "postgres": srv.postgres}.get(backend)
    return None if server is None else server.pid


def create_rates(
    srv: Servers, backend: str, *, single: int, bulk: int, payload: Any = None
) -> dict[str, Any]:
    """Tasks/s for one-at-a-time and bulk create, and Redis bytes per pending task.

    The one-at-a-time rate is a running application's: its first `COLD` creates (which open
    the client's connections, tens of ms each with PyMySQL, and build its statements) are timed
    apart, as `single_cold_per_s`. Blocks of creates alternate with blocks of the same number of
    bare round trips (`_bare_round_trips`): `floor_per_s` is what this machine allowed, and
    `single_vs_floor` (the median of the blocks' ratios) is the figure the machine's noise
    moves least. `payload`: what every task carries (`create(..., payload=)`).

    Where a one-at-a-time create's time goes, in µs a create over the timed blocks (`single_*_us`):
    `client_cpu` (this process: keyexpiry, SQLAlchemy, the driver, redis-py), `ledger_cpu` and
    `redis_cpu` (the servers' processes), and `waiting` (the wall time none of them account for:
    the loopback, the scheduler's hand-overs between processes, a WAL or redo write's wait).
    """
    redis_url, db_url = srv.fresh(backend)
    with Client(settings_for(redis_url, db_url)) as client:
        start = time.perf_counter()
        for i in range(COLD):
            client.create("Bench.other", -1 - i, ttl_s=86_400, payload=payload)
        cold_rate = COLD / (time.perf_counter() - start)
        single_s = floor_s = 0.0
        ratios = []
        ledger_pid = _ledger_pid(srv, backend)
        # SQLite's work is this process's: no ledger column for it.
        cpu = dict.fromkeys(("client_cpu", "ledger_cpu", "redis_cpu"), 0.0)
        if ledger_pid is None:
            del cpu["ledger_cpu"]
        with _bare_round_trips(client) as bare:
            for first in range(0, single, BLOCK):
                count = min(BLOCK, single - first)
                ledger_cpu = _server_cpu_s(ledger_pid) if ledger_pid else 0.0
                redis_cpu = _server_cpu_s(srv.redis.pid)
                client_cpu = time.process_time()
                start = time.perf_counter()
                for i in range(first, first + count):
                    client.create("Bench.other", i, ttl_s=86_400, payload=payload)
                took_s = time.perf_counter() - start
                cpu["client_cpu"] += time.process_time() - client_cpu
                cpu["redis_cpu"] += _server_cpu_s(srv.redis.pid) - redis_cpu
                if ledger_pid:
                    cpu["ledger_cpu"] += _server_cpu_s(ledger_pid) - ledger_cpu
                start = time.perf_counter()
                for _ in range(count):
                    bare()
                bare_s = time.perf_counter() - start
                single_s, floor_s = single_s + took_s, floor_s + bare_s
                ratios.append(bare_s / took_s)
        single_rate = single / single_s
        before = redis_used_bytes(client.redis)
        start = time.perf_counter()
        for base in range(single, single + bulk, CHUNK):
            client.create_many(
                TaskRequest("Bench.other", (i,), ttl_s=86_400, payload=payload)
                for i in range(base, min(single + bulk, base + CHUNK))
            )
        bulk_rate = bulk / (time.perf_counter() - start)
        per_task = (redis_used_bytes(client.redis) - before) / bulk
        pending = count_status(client, TaskStatus.PENDING)
    return {
        "single_per_s": round(single_rate),
        "single_cold_per_s": round(cold_rate),
        "floor_per_s": round(single / floor_s),
        "single_vs_floor": round(statistics.median(ratios), 3),
        "single_wall_us": round(single_s / single * 1e6),
        **{f"single_{name}_us": round(s / single * 1e6) for name, s in cpu.items()},
        "single_waiting_us": round(max(0.0, single_s - sum(cpu.values())) / single * 1e6),
        "bulk_per_s": round(bulk_rate),
        "redis_bytes_per_task": round(per_task, 1),
        "pending": pending,
    }


def prepare_sparse(srv: Servers, backend: str, others: int) -> tuple[str, str]:
    """A Redis and ledger holding `others` pending tasks due a day from now."""
    urls = srv.fresh(backend)
    with Client(settings_for(*urls)) as client:
        _create_others(client, others)
    return urls


PAYLOAD_1KB = {
    "template": "reminder",
    "lines": [{"sku": f"SKU-{i:04d}", "qty": i} for i in range(34)],
}
"""A payload of about 1 KB of JSON, as a reminder with its order lines would carry."""
