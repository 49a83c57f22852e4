"""`bench --scenario cluster`: the steady wave on a local 3-primary Redis Cluster, beside the
same wave on the single redis-server, round by round (the machine's noise moves both)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from keyexpiry.bench.harness import Servers, median_of, redis_server_binary
from keyexpiry.bench.scenarios import due_wave
from keyexpiry.bench.servers.cluster import LocalCluster

SINGLE = "single node driver=on"
CLUSTER = "3 primaries driver=on"


def run(
    srv: Servers,
    backend: str,
    *,
    runs: int,
    size: float,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Each round: the steady wave (10k due over 10 s at full size) on one node, then on the
    cluster (3 primaries, no replicas: the machine's cores go to the primaries and listener)."""
    # A longer lead than steady's 3 s: creating the wave on a loaded 2-core machine took up to
    # 9 s on the cluster, and a wave created after it falls due measures the creation.
    kw: dict[str, Any] = {"n": int(10_000 * size), "span_s": 10 * size, "cap_s": 60, "lead_s": 15}
    results: dict[str, list[dict[str, Any]]] = {SINGLE: [], CLUSTER: []}
    cluster = LocalCluster(
        srv.workdir / "cluster", primaries=3, replicas=0, binary=redis_server_binary()
    )
    cluster.start()
    try:
        for i in range(runs):
            for name in (SINGLE, CLUSTER):
                t = time.monotonic()
                redis_url, db_url = srv.fresh(backend)
                if name == CLUSTER:
                    cluster.flushall()
                    redis_url = cluster.url()
                got = due_wave(srv, (redis_url, db_url), driver=True, **kw)
                results[name].append(got)
                say(
                    f"  {name} run {i + 1}/{runs}: p50={got['late_p50_ms']:.1f} "
                    f"p99={got['late_p99_ms']:.1f} max={got['late_max_ms']:.1f} ms, "
                    f"fired={got['fired']}, cpu_s={got['listener_cpu_s']} "
                    f"({time.monotonic() - t:.0f} s)"
                )
    finally:
        cluster.stop()
    return {name: {"median": median_of(rs), "runs": rs} for name, rs in results.items()}
