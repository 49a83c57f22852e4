"""`bench --scenario churn`: does the ledger stay small under steady churn with retention on?

Each backend named gets a listener and a producer of its own, side by side (each on a Redis
database of its own, so neither hears the other's keys): `RATE_PER_S` tasks a second, each due
a second after its create, finished rows kept `RETAIN_S` and pruned every `PRUNE_EVERY_S` (the
soak's settings), for `minutes`. Every `SAMPLE_S` the table's size with its indexes is read
(PostgreSQL: `pg_total_relation_size`; MariaDB: `data_length + index_length` after `ANALYZE
TABLE`), with its rows and, on PostgreSQL, its dead row versions and autovacuum runs.

The figure is the largest size after the warm-up (the first `WARM_UP_S`, or a third of a
shorter run: retention needs `RETAIN_S` to start deleting) against the size at its end;
issue 41's bound is 1.5x.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import text

from keyexpiry import Client, TaskRequest
from keyexpiry.bench.harness import ListenerProcess, Servers, settings_for

RATE_PER_S = 500
RETAIN_S = 60
PRUNE_EVERY_S = 10
SAMPLE_S = 30.0
WARM_UP_S = 300.0
TICK_S = 0.1
BOUND = 1.5
"""The largest size after the warm-up may be this many times the size at its end."""


def _size(client: Client) -> dict[str, Any]:
    """Table and index bytes, rows (and PostgreSQL's dead row versions, autovacuum runs)."""
    engine = client.store.engine
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT count(*) FROM time_limit_task")).scalar_one()
        if engine.dialect.name == "postgresql":
            size = conn.execute(
                text("SELECT pg_total_relation_size('time_limit_task')")
            ).scalar_one()
            dead, vacuums = conn.execute(
                text(
                    "SELECT n_dead_tup, autovacuum_count FROM pg_stat_user_tables "
                    "WHERE relname = 'time_limit_task'"
                )
            ).one()
            return {"bytes": int(size), "rows": int(rows), "dead": int(dead), "vacuums": vacuums}
        conn.execute(text("ANALYZE TABLE time_limit_task")).all()
        size = conn.execute(
            text(
                "SELECT data_length + index_length FROM information_schema.tables "
                "WHERE table_schema = DATABASE() AND table_name = 'time_limit_task'"
            )
        ).scalar_one()
        return {"bytes": int(size), "rows": int(rows)}


def _churn(redis_url: str, db_url: str, minutes: float, stop: threading.Event) -> dict[str, Any]:
    """One backend's run: its samples and verdict."""
    env = {
        "KEYEXPIRY_RETAIN_DONE_S": str(RETAIN_S),
        "KEYEXPIRY_RETAIN_DEAD_S": str(RETAIN_S),
        "KEYEXPIRY_PRUNE_EVERY_S": str(PRUNE_EVERY_S),
    }
    samples: list[dict[str, Any]] = []
    with (
        Client(settings_for(redis_url, db_url)) as client,
        ListenerProcess(redis_url=redis_url, db_url=db_url, extra_env=env) as proc,
    ):
        proc.wait_subscribed(client)
        start = time.monotonic()
        end = start + minutes * 60
        next_sample = start
        i = 0
        while time.monotonic() < end and not stop.is_set():
            tick = time.monotonic()
            n = round(RATE_PER_S * TICK_S)
            client.create_many(TaskRequest("Bench.noop", (i + k,), ttl_ms=1000) for k in range(n))
            i += n
            if tick >= next_sample:
                samples.append({"s": round(tick - start), **_size(client)})
                next_sample += SAMPLE_S
            stop.wait(max(0.0, tick + TICK_S - time.monotonic()))
        samples.append({"s": round(time.monotonic() - start), **_size(client)})
        created_per_s = i / max(time.monotonic() - start, 1e-9)
    return {**verdict(samples, minutes), "created_per_s": round(created_per_s), "samples": samples}


def verdict(samples: list[dict[str, Any]], minutes: float) -> dict[str, Any]:
    """The size at the warm-up's end, the largest after it, their ratio, within `BOUND`."""
    warm_s = min(WARM_UP_S, minutes * 60 / 3)
    after = [s for s in samples if s["s"] >= warm_s]
    if not after:
        return {"warm_up_s": warm_s, "ok": None}
    warm, peak = after[0]["bytes"], max(s["bytes"] for s in after)
    ratio = peak / warm if warm else float("nan")
    return {
        "warm_up_s": warm_s,
        "bytes_at_warm_up": warm,
        "bytes_peak_after": peak,
        "bytes_at_end": after[-1]["bytes"],
        "peak_over_warm_up": round(ratio, 2),
        "ok": ratio <= BOUND,
    }


def run(
    srv: Servers, backends: list[str], *, minutes: float, say: Callable[[str], None] = print
) -> dict[str, Any]:
    """Every backend's churn, side by side; figures by backend (as `median` beside the one
    run, samples included, as the other scenarios' results are shaped)."""
    stop = threading.Event()
    results: dict[str, dict[str, Any]] = {}
    # Empty ledgers, and Redis flushed once, before any run starts; a Redis database each.
    urls = {b: (srv.redis.url(i + 1), srv.fresh(b)[1]) for i, b in enumerate(backends)}

    def one(backend: str) -> None:
        try:
            results[backend] = _churn(*urls[backend], minutes, stop)
        except Exception as exc:  # said, and the other backend's run goes on
            results[backend] = {"error": repr(exc)}

    threads = [threading.Thread(target=one, args=(b,), name=f"churn-{b}") for b in backends]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shaped = {}
    for backend, r in results.items():
        figures = {k: v for k, v in r.items() if k != "samples"}
        say(f"  churn {backend}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))
        shaped[backend] = {"median": figures, "runs": [r]}
    return shaped
