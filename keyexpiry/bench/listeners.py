"""`bench --scenario listeners`: 1, 2 and 3 listeners on the same wave of trivial tasks.

What a fleet costs and gains: tasks/s and the listeners' summed CPU, each as a ratio to one
listener in the same round (the machine's noise moves all variants of a round together). Run
unthrottled, listeners share the machine's cores with Redis, MariaDB and each other, so the CPU
ratio is the figure; with a quota of half a core each (cgroups, as root) a listener's CPU share
is its own, and the rate ratio says whether work spreads over listeners.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from keyexpiry.bench import cpuquota
from keyexpiry.bench.harness import Servers, median_of
from keyexpiry.bench.scenarios import due_wave

QUOTA_ENV = "KEYEXPIRY_BENCH_QUOTA_CORES"
"""The CPU quota per listener in the quota variants (cores; default 0.5)."""


def quota_cores() -> float:
    """The quota per listener (`KEYEXPIRY_BENCH_QUOTA_CORES`, default half a core)."""
    return float(os.environ.get(QUOTA_ENV, "0.5"))


def variants() -> list[tuple[int, float | None]]:
    """(listeners, quota) pairs; the quota ones only where cgroups allow it."""
    out: list[tuple[int, float | None]] = [(1, None), (2, None), (3, None)]
    if cpuquota.unavailable() is None:
        cores = quota_cores()
        out += [(1, cores), (2, cores), (3, cores)]
    return out


def label(listeners: int, cores: float | None) -> str:
    """The variant's name in the report."""
    return f"listeners={listeners}" + (f" quota={cores:g}" if cores is not None else "")


def run(
    srv: Servers,
    backend: str,
    *,
    runs: int,
    size: float,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Each round runs every variant once; ratios are to one listener of the same round."""
    kw: dict[str, Any] = {"n": int(30_000 * size), "span_s": 0.0, "cap_s": 90, "lead_s": 6}
    results: dict[str, list[dict[str, Any]]] = {label(n, c): [] for n, c in variants()}
    if (reason := cpuquota.unavailable()) is not None:
        say(f"  quota variants skipped: {reason}")
    for i in range(runs):
        base: dict[float | None, dict[str, Any]] = {}
        for n, cores in variants():
            t = time.monotonic()
            got = due_wave(srv, srv.fresh(backend), driver=True, listeners=n, cpu_cores=cores, **kw)
            if n == 1:
                base[cores] = got
            one = base[cores]
            got["rate_vs_one"] = round(got["tasks_per_s"] / one["tasks_per_s"], 3)
            got["cpu_vs_one"] = round(got["listener_cpu_s"] / one["listener_cpu_s"], 3)
            results[label(n, cores)].append(got)
            say(
                f"  {label(n, cores)} run {i + 1}/{runs}: tasks_per_s={got['tasks_per_s']:.0f} "
                f"(x{got['rate_vs_one']}), cpu_s={got['listener_cpu_s']} "
                f"(x{got['cpu_vs_one']}), fired={got['fired']}, max_attempts="
                f"{got['max_attempts']}, throttled_s={got['throttled_s']} "
                f"({time.monotonic() - t:.0f} s)"
            )
    return {name: {"median": median_of(rs), "runs": rs} for name, rs in results.items()}
