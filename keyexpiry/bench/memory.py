"""`bench --scenario memory`: does a listener's memory stay flat while it runs task after task?

A listener is meant to run for months, so what matters is the slope, not the level: one
`keyexpiry listen` (concurrency 8, finished rows pruned after 60 s) is fed `rate_per_s` trivial
tasks a second, due 1 s ahead, as `create_many` calls of one second's worth, until `n` tasks
have run. Its RSS is sampled every `SAMPLE_S`; the slope is a least-squares fit of RSS on tasks
run, after the warm-up (imports, pools, caches and the allocator's arenas filling) and between
the two checkpoints, in MB per 100,000 tasks. At a third of the way and at the end the listener
notes tracemalloc's count of Python-level allocations, with the source lines that grew most in
between.

Variants: SQLite, MariaDB, and MariaDB with `--http` on and nobody scraping (the run metrics'
observations pile up until a scrape or their fold threshold).

Measured here: RSS climbs for about the first 150,000 tasks (SQLite's page cache and the
allocator's arenas filling as pruning starts, every 60 s, on 30,000 rows at a time), then levels
off; Python-level allocations stay flat throughout. `--quick` (60,000 tasks) ends inside that
climb: its slope is a smoke test, not the figure to compare with the goal.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keyexpiry import Client, TaskRequest
from keyexpiry.bench.harness import (
    ListenerProcess,
    Servers,
    handler_lateness,
    median_of,
    percentiles,
    settings_for,
)
from keyexpiry.bench.servers import free_port
from keyexpiry.bench.tasks import MEMORY_AT_ENV, MEMORY_OUT_ENV

SAMPLE_S = 5.0
GOAL_MB_PER_100K = 1.0
"""Flat: what a listener may grow per 100,000 tasks after its warm-up."""


def slope_per_100k(samples: list[tuple[int, float]]) -> float:
    """Least-squares slope of RSS (MB) on tasks run, per 100,000 tasks (NaN with < 2 points)."""
    if len(samples) < 2 or len({t for t, _ in samples}) < 2:
        return float("nan")
    tasks = [float(t) for t, _ in samples]
    rss = [m for _, m in samples]
    return statistics.linear_regression(tasks, rss).slope * 100_000


def _count_lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def one_run(
    srv: Servers,
    backend: str,
    *,
    http: bool,
    n: int,
    rate_per_s: int,
    warm_up_s: float,
) -> dict[str, Any]:
    """Feed one listener `n` tasks at `rate_per_s`; its memory figures."""
    redis_url, db_url = srv.fresh(backend)
    notes = Path(tempfile.mkstemp(prefix="ke-memory-", suffix=".jsonl")[1])
    checkpoints = [n // 3, n]
    with (
        Client(settings_for(redis_url, db_url)) as client,
        ListenerProcess(
            redis_url=redis_url,
            db_url=db_url,
            http=f"127.0.0.1:{free_port()}" if http else "",
            extra_env={
                "KEYEXPIRY_RETAIN_DONE_S": "60",
                MEMORY_AT_ENV: ",".join(map(str, checkpoints)),
                MEMORY_OUT_ENV: str(notes),
            },
        ) as listener,
    ):
        listener.wait_subscribed(client)
        proc = listener.measured()
        start_s = time.monotonic()
        next_batch_s = next_sample_s = start_s
        created = 0
        samples: list[tuple[float, int, float]] = []  # (seconds in, tasks run, RSS MB)
        first_seen: dict[str, int] = {}
        deadline_s = start_s + n / rate_per_s + 120
        while time.monotonic() < deadline_s:
            now_s = time.monotonic()
            if created < n and now_s >= next_batch_s:
                count = min(rate_per_s, n - created)
                client.create_many(
                    TaskRequest("Bench.noop", (created + i,), ttl_ms=1000) for i in range(count)
                )
                created += count
                next_batch_s += 1.0
            if now_s >= next_sample_s:
                ran = _count_lines(listener.starts_path)
                samples.append((now_s - start_s, ran, proc.memory_info().rss / 2**20))
                if not first_seen:
                    first_seen = {"threads": proc.num_threads(), "fds": proc.num_fds()}
                next_sample_s += SAMPLE_S
                if ran >= n:
                    break
            time.sleep(max(0.0, min(next_batch_s, next_sample_s) - time.monotonic()))
        last = {"threads": proc.num_threads(), "fds": proc.num_fds()}
        late = handler_lateness([listener.starts_path])
        checkpoints_seen = [json.loads(line) for line in notes.read_text().splitlines()]
    notes.unlink(missing_ok=True)
    # The slope is read between the checkpoints: the first one's snapshot is a one-off step in
    # RSS, the last one's comes with the last run.
    steady_from = checkpoints[0] + rate_per_s * SAMPLE_S
    steady = [
        (ran, rss) for t_s, ran, rss in samples if t_s >= warm_up_s and steady_from <= ran < n
    ]
    after_warm_up = steady[0][1] if steady else float("nan")
    figures: dict[str, Any] = {
        "tasks": n,
        "ran": len(late),
        "rate_per_s": rate_per_s,
        "rss_start_mb": round(samples[0][2], 1),
        "rss_after_warm_up_mb": round(after_warm_up, 1),
        "rss_end_mb": round(samples[-1][2], 1),
        "rss_mb_per_100k": round(slope_per_100k(steady), 2),
        # The second half alone: where a bounded growth (caches, the allocator's arenas) has
        # levelled off, a leak still climbs.
        "rss_mb_per_100k_late": round(
            slope_per_100k([(ran, rss) for _, ran, rss in samples if n // 2 <= ran < n]), 2
        ),
        "threads": f"{first_seen['threads']} -> {last['threads']}",
        "fds": f"{first_seen['fds']} -> {last['fds']}",
        "samples": [(round(t, 1), ran, round(rss, 1)) for t, ran, rss in samples],
    }
    figures.update({f"late_{k}_ms": v for k, v in percentiles(late).items()})
    for note in checkpoints_seen:
        figures[f"traced_mb_at_{note['runs']}"] = round(note["traced_bytes"] / 2**20, 2)
        if "grew" in note:
            figures["traced_grew_most"] = note["grew"]
    return figures


def variants(backend: str) -> list[tuple[str, str, bool]]:
    """(label, ledger backend, --http) for each variant this run's servers allow."""
    out = [("sqlite", "sqlite", False)]
    if backend == "mariadb":
        out += [("mariadb", "mariadb", False), ("mariadb http", "mariadb", True)]
    return out


def run(
    srv: Servers,
    backend: str,
    *,
    runs: int,
    size: float,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every variant `runs` times: 300,000 tasks at 500/s after a 60 s warm-up (`size` scales
    the tasks and the warm-up: --quick runs 60,000 with 30 s)."""
    n = int(300_000 * size)
    warm_up_s = 60.0 if size >= 1 else 30.0
    results: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in variants(backend)}
    for i in range(runs):
        for label, kind, http in variants(backend):
            t = time.monotonic()
            got = one_run(srv, kind, http=http, n=n, rate_per_s=500, warm_up_s=warm_up_s)
            results[label].append(got)
            traced = ", ".join(
                f"{k.removeprefix('traced_mb_at_')} tasks {v} MB"
                for k, v in got.items()
                if k.startswith("traced_mb_at_")
            )
            say(
                f"  {label} run {i + 1}/{runs}: ran {got['ran']}/{n}, RSS "
                f"{got['rss_after_warm_up_mb']} -> {got['rss_end_mb']} MB, "
                f"{got['rss_mb_per_100k']} MB per 100k tasks (second half "
                f"{got['rss_mb_per_100k_late']}; goal < {GOAL_MB_PER_100K}), "
                f"traced {traced}, threads {got['threads']}, fds {got['fds']}, "
                f"late p99 {got['late_p99_ms']:.0f} ms ({time.monotonic() - t:.0f} s)"
            )
    return {label: {"median": median_of(rs), "runs": rs} for label, rs in results.items()}
