"""Run the scenarios (driver on and off, several runs each), print a table, write JSON."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keyexpiry.bench import aio as aio_bench
from keyexpiry.bench import churn as churn_bench
from keyexpiry.bench import cluster as cluster_bench
from keyexpiry.bench import django_bench as django_scenario
from keyexpiry.bench import flow as flow_bench
from keyexpiry.bench import ledger as ledger_bench
from keyexpiry.bench import listeners as listeners_bench
from keyexpiry.bench import memory as memory_bench
from keyexpiry.bench import peers as peer_bench
from keyexpiry.bench import runnow as runnow_bench
from keyexpiry.bench import scenarios
from keyexpiry.bench.harness import Servers, machine, median_of, servers
from keyexpiry.bench.probe import probe_cpu_ms

SCENARIOS = (
    "steady", "sparse", "burst", "throughput", "create", "listeners", "ledger", "aio", "cluster",
    "memory", "flow", "run-now", "django", "churn", "soak",
)  # fmt: skip
DEFAULT_SCENARIOS = SCENARIOS[:6]
"""What `keyexpiry bench` runs unnamed: the others start servers of their own (a cluster) or fill
millions of rows, and are run by name."""


def _runs(label: str, runs: int, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    results = []
    for i in range(runs):
        t = time.monotonic()
        before_ms = probe_cpu_ms()
        results.append(fn())
        # The machine's pace around the run: a dip it shares is not the program's.
        results[-1]["probe_cpu_ms"] = round((before_ms + probe_cpu_ms()) / 2, 2)
        print(
            f"  {label} run {i + 1}/{runs}: {_short(results[-1])} ({time.monotonic() - t:.0f} s)",
            flush=True,
        )
    return {"median": median_of(results), "runs": results}


def _short(r: dict[str, Any]) -> str:
    keys = (
        "late_p50_ms",
        "late_p99_ms",
        "late_max_ms",
        "fired",
        "extra_runs",
        "tasks_per_s",
        "single_per_s",
        "single_cold_per_s",
        "bulk_per_s",
        "redis_bytes_per_task",
        "settled_late_p99_ms",
        "full_pass_s",
        "probe_cpu_ms",
    )
    return ", ".join(
        f"{k}={r[k]:.0f}" if isinstance(r[k], float) else f"{k}={r[k]}" for k in keys if k in r
    )


def _fresh_wave(srv: Servers, backend: str, driver: bool, kw: dict[str, Any]) -> dict[str, Any]:
    return scenarios.due_wave(srv, srv.fresh(backend), driver=driver, **kw)


def _peer_runs(srv: Servers, runs: int, kw: dict[str, Any]) -> dict[str, Any]:
    """The steady workload `kw` on each peer library."""
    return {
        lib: _runs(lib, runs, functools.partial(peer_bench.steady, srv, lib, **kw))
        for lib in peer_bench.PEERS
    }


def run(
    names: list[str],
    *,
    runs: int,
    backend: str,
    quick: bool,
    out: Path,
    peers: bool = True,
    minutes: float = 10.0,
) -> dict[str, Any]:
    """Run `names` and return (and write to `out`) every figure.

    With `peers` (and the `peers` extra installed), steady also runs on huey and arq, and
    run-now on Celery, Dramatiq, RQ, arq and huey (those installed).
    """
    size = 0.2 if quick else 1.0
    report: dict[str, Any] = {
        "machine": machine(),
        "backend": backend,
        "runs": runs,
        "quick": quick,
        "scenarios": {},
    }
    if peers and "steady" in names and (absent := peer_bench.missing()):
        report["peers_skipped"] = (
            f"peers skipped: {', '.join(absent)} not installed"
            " (`make bench-peers` runs them in .venv-peers)"
        )
        print(report["peers_skipped"], flush=True)
        peers = False
    backends = backend.split(",")
    with servers(with_mariadb="mariadb" in backends, with_postgres="postgres" in backends) as srv:
        for name in names:
            print(f"{name}:", flush=True)
            res: dict[str, Any] = {}
            if name == "churn":  # every backend at once, side by side, for `minutes`
                report["scenarios"][name] = churn_bench.run(srv, backends, minutes=minutes)
                out.write_text(json.dumps(report, indent=2, default=str))
                continue
            for i, one in enumerate(backends):
                if len(backends) > 1:
                    print(f"  on {one}:", flush=True)
                # The peers run once: their ledger is not keyexpiry's.
                got = _scenario(
                    srv, name, one, runs=runs, size=size, quick=quick, peers=peers and i == 0
                )
                res.update(got if len(backends) == 1 else {f"{one} {k}": v for k, v in got.items()})
            report["scenarios"][name] = res
            out.write_text(json.dumps(report, indent=2, default=str))
    print_table(report)
    return report


def _scenario(
    srv: Servers, name: str, backend: str, *, runs: int, size: float, quick: bool, peers: bool
) -> dict[str, Any]:
    """Scenario `name`'s figures on one ledger `backend`, by variant."""
    res: dict[str, Any] = {}
    if name == "aio":
        res = aio_bench.run(srv, backend, runs=runs, size=size, say=lambda m: print(m, flush=True))
    elif name == "memory":
        res = memory_bench.run(
            srv, backend, runs=runs, size=size, say=lambda m: print(m, flush=True)
        )
    elif name == "flow":
        res = flow_bench.run(
            srv, backend, runs=runs, quick=quick, say=lambda m: print(m, flush=True)
        )
    elif name == "django":
        res = django_scenario.run(
            srv, backend, runs=runs, quick=quick, say=lambda m: print(m, flush=True)
        )
    elif name == "run-now":
        res = runnow_bench.run(
            srv, backend, runs=runs, quick=quick, peers=peers, say=lambda m: print(m, flush=True)
        )
    elif name == "listeners":
        res = listeners_bench.run(
            srv, backend, runs=runs, size=size, say=lambda m: print(m, flush=True)
        )
    elif name == "ledger":
        rows = 1_000_000 if quick else 10_000_000
        label = f"rows={rows}"
        res[label] = _runs(
            label, runs, functools.partial(ledger_bench.ledger, srv, backend, rows=rows)
        )
        print(ledger_bench.format_queries(res[label]["runs"][-1]), flush=True)
    elif name == "cluster":
        res = cluster_bench.run(
            srv, backend, runs=runs, size=size, say=lambda m: print(m, flush=True)
        )
    elif name == "create":
        # Plain, and every task with a 1 KB payload, in the same run: their ratio is the cost.
        for label, payload in (("default", None), ("payload=1KB", scenarios.PAYLOAD_1KB)):
            res[label] = _runs(
                f"create {label}",
                runs,
                functools.partial(
                    scenarios.create_rates,
                    srv,
                    backend,
                    single=int(5000 * size),
                    bulk=int(100_000 * size),
                    payload=payload,
                ),
            )
    elif name == "sparse":
        for others in [100_000] if quick else [100_000, 1_000_000]:
            urls = scenarios.prepare_sparse(srv, backend, others)
            for driver in (True, False):
                label = f"N={others} driver={'on' if driver else 'off'}"
                res[label] = _runs(
                    label,
                    runs,
                    functools.partial(
                        scenarios.due_wave,
                        srv,
                        urls,
                        driver=driver,
                        n=int(10_000 * size),
                        span_s=10 * size,
                        cap_s=60,
                    ),
                )
    else:
        # Throughput also runs two listeners: what a second one costs or gains.
        variants = [(True, 1), (False, 1)] + ([(True, 2)] if name == "throughput" else [])
        for driver, listeners in variants:
            label = f"driver={'on' if driver else 'off'}"
            label += f" listeners={listeners}" if listeners > 1 else ""
            if name == "steady":
                kw: dict[str, Any] = {
                    "n": int(10_000 * size),
                    "span_s": 10 * size,
                    "cap_s": 60,
                }
            elif name == "burst":
                kw = {
                    "n": int(100_000 * size),
                    "span_s": 1.0,
                    "cap_s": 60,
                    "lead_s": 30 * size,
                }
            else:  # throughput: everything due at once, rate is what counts
                kw = {"n": int(30_000 * size), "span_s": 0.0, "cap_s": 60, "lead_s": 5}
            res[label] = _runs(
                label,
                runs,
                functools.partial(
                    _fresh_wave, srv, backend, driver, {**kw, "listeners": listeners}
                ),
            )
        if name == "steady":
            # The same wave, every task carrying a 1 KB payload (the claim reads it back): its
            # lateness and CPU beside driver=on's are the payload's cost.
            res["driver=on payload=1KB"] = _runs(
                "driver=on payload=1KB",
                runs,
                functools.partial(
                    _fresh_wave,
                    srv,
                    backend,
                    True,
                    {**kw, "listeners": 1, "payload": scenarios.PAYLOAD_1KB},
                ),
            )
        if name == "steady":
            # The same wave with the driver looking every key up the millisecond it expires
            # (`driver_tick_ms` 0, default 4): what the tick saves in CPU and costs in lateness.
            res["driver=on tick=0"] = _runs(
                "driver=on tick=0",
                runs,
                functools.partial(
                    _fresh_wave,
                    srv,
                    backend,
                    True,
                    {**kw, "listeners": 1, "listener_env": {"KEYEXPIRY_DRIVER_TICK_MS": "0"}},
                ),
            )
        if name == "steady" and peers:
            res.update(_peer_runs(srv, runs, kw))
    return res


COLUMNS = (
    "late_p50_ms",
    "late_p90_ms",
    "late_p99_ms",
    "late_max_ms",
    "fired",
    "sent_per_s",
    "tasks_per_s",
    "drain_per_s",
    "enqueue_s",
    "cpu_s_per_10k",
    "worker_rss_mb",
    "worker_rss_sum_mb",
    "listener_cpu_s",
    "listener_rss_mb",
    "ledger_cpu_us_per_task",
    "ledger_wal_bytes_per_task",
    "rate_vs_one",
    "cpu_vs_one",
    "single_per_s",
    "single_wall_us",
    "single_client_cpu_us",
    "single_ledger_cpu_us",
    "single_redis_cpu_us",
    "single_waiting_us",
    "bulk_per_s",
    "redis_bytes_per_task",
    "creates_per_s",
    "max_tick_gap_ms",
    "rss_after_warm_up_mb",
    "rss_end_mb",
    "rss_mb_per_100k",
    "rss_mb_per_100k_late",
    "due_to_last_start_s",
    "due_to_last_end_s",
    "max_starts_1s",
    "max_claims_1s",
    "max_at_once",
    "time_vs_unlimited",
    "cpu_vs_unlimited",
    "enqueue_us",
    "enqueue_cpu_us",
    "p50_vs_native",
    "p99_vs_native",
    "enqueue_cpu_vs_native",
    "bytes_at_warm_up",
    "bytes_peak_after",
    "peak_over_warm_up",
)
"""The figures in the table, in order; a column no row has a value for is left out."""


def _cell(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def format_table(report: dict[str, Any]) -> str:
    """The medians, one line per scenario and variant, each column as wide as its widest cell
    and two spaces apart: headers stand over their values whatever their width."""
    medians = [
        (f"{name} {variant}", data["median"])
        for name, variants in report["scenarios"].items()
        for variant, data in variants.items()
    ]
    cols = [c for c in COLUMNS if any(c in m for _, m in medians)]
    heads = [
        c.removeprefix("late_").removesuffix("_ms") if c.startswith("late_") else c for c in cols
    ]
    table = [["scenario", *heads]]
    table += [[label, *(_cell(m[c]) if c in m else "" for c in cols)] for label, m in medians]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = [f"medians of {report['runs']} run(s), backend {report['backend']}"]
    for row in table:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(w) for cell, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def print_table(report: dict[str, Any]) -> None:
    """Print `format_table(report)` after a blank line."""
    print("\n" + format_table(report))
