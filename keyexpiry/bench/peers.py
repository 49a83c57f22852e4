"""The steady scenario on huey and arq, measured like keyexpiry's (optional extra `peers`).

Each peer's consumer runs in its own process (`python -m keyexpiry.bench.peer_apps`) with the
library's default settings, against the benchmark's redis-server (flushed first). Lateness is the
handler's start (`time.time()`) minus the due time; both come from this host's clock.
"""

from __future__ import annotations

import importlib.util
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keyexpiry.bench.harness import MeasuredProcess, Servers, percentiles
from keyexpiry.bench.peer_apps import PEERS, schedule

__all__ = ["PEERS", "PeerProcess", "Run", "figures", "missing", "parse", "steady"]

# What "default settings" means for each peer, carried into the JSON and the docs.
SETTINGS = {
    "huey": "RedisHuey defaults; consumer: 1 worker thread, scheduler every 1 s",
    "arq": "Worker defaults: max_jobs 10, poll_delay 0.5 s",
}
WARMUP = -1  # the job that shows the consumer is up; not counted


def missing() -> list[str]:
    """The peers that are not importable here (install the `peers` extra)."""
    return [lib for lib in PEERS if importlib.util.find_spec(lib) is None]


@dataclass(frozen=True)
class Run:
    """One handler run as the handler recorded it (epoch ms, host clock)."""

    i: int
    due_ms: int
    start_ms: float
    end_ms: float


def parse(text: str) -> list[Run]:
    """The complete `i due_ms start_ms end_ms` lines of a record file (a torn last line is
    skipped: the consumer may be writing it)."""
    runs = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4:
            runs.append(Run(int(parts[0]), int(parts[1]), float(parts[2]), float(parts[3])))
    return runs


def figures(runs: list[Run]) -> dict[str, Any]:
    """Lateness percentiles (ms), fired, extra runs and tasks/s, named as keyexpiry's figures.

    `fired` counts distinct tasks; a task's lateness is its first run's; `extra_runs` counts
    runs beyond the first; tasks/s is distinct tasks over (last finish - first start), as for
    keyexpiry.
    """
    first: dict[int, Run] = {}
    for r in runs:
        if r.i != WARMUP and (r.i not in first or r.start_ms < first[r.i].start_ms):
            first[r.i] = r
    counted = len([r for r in runs if r.i != WARMUP])
    out: dict[str, Any] = {
        f"late_{k}_ms": v
        for k, v in percentiles([r.start_ms - r.due_ms for r in first.values()]).items()
    }
    out["fired"] = len(first)
    out["extra_runs"] = counted - len(first)
    if len(first) > 1:
        span_s = (
            max(r.end_ms for r in first.values()) - min(r.start_ms for r in first.values())
        ) / 1000
        out["tasks_per_s"] = len(first) / span_s if span_s > 0 else float("nan")
    return out


@dataclass
class PeerProcess(MeasuredProcess):
    """A huey or arq consumer recording its runs to `out`."""

    lib: str = ""
    redis_url: str = ""
    out: Path = Path()

    def argv(self) -> list[str]:
        """`python -m keyexpiry.bench.peer_apps <lib> <redis_url> <out>`."""
        return ["-m", "keyexpiry.bench.peer_apps", self.lib, self.redis_url, str(self.out)]

    def runs(self) -> list[Run]:
        """What the handler recorded so far."""
        return parse(self.out.read_text()) if self.out.exists() else []

    def wait_ready(self, timeout_s: float = 30) -> None:
        """Until a job due now has run (the consumer is up and polling)."""
        schedule(self.lib, self.redis_url, [(WARMUP, _now_ms())])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(r.i == WARMUP for r in self.runs()):
                self.mark_ready()
                return
            if self.proc is not None and self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{self.lib} consumer did not run the warm-up job")


def steady(
    srv: Servers, lib: str, *, n: int, span_s: float, cap_s: float, lead_s: float | None = None
) -> dict[str, Any]:
    """`n` noop jobs due evenly over `span_s` on `lib`; the same figures as `due_wave`.

    Neither peer has a bulk schedule call, so by default the first job is due 3 s plus 1 s per
    1,000 jobs after scheduling starts: scheduling (and huey's worker moving every future job to
    its schedule) is over before anything is due, as keyexpiry's bulk create is in `due_wave`.
    """
    if lead_s is None:
        lead_s = 3.0 + n / 1000
    redis_url = srv.redis.url()
    client = srv.redis.client()
    client.flushall()
    client.close()
    out = srv.workdir / f"{lib}-{secrets.token_hex(3)}.runs"
    with PeerProcess(lib=lib, redis_url=redis_url, out=out) as consumer:
        consumer.wait_ready()
        first_due = _now_ms() + int(lead_s * 1000)
        step = span_s * 1000 / max(n - 1, 1)
        jobs = [(i, int(first_due + i * step)) for i in range(n)]
        start = time.perf_counter()
        schedule(lib, redis_url, jobs)
        create_s = time.perf_counter() - start
        created_late_ms = max(0, _now_ms() - first_due)
        wait_s = max(0.0, (first_due - _now_ms()) / 1000)
        begin = time.monotonic()
        while time.monotonic() - begin < wait_s + span_s + cap_s:
            if len({r.i for r in consumer.runs()} - {WARMUP}) >= n:
                break
            time.sleep(0.25)
        waited = time.monotonic() - begin
        cpu_s = consumer.cpu_since_start()
        result = figures(consumer.runs())
        result.update(
            n=n,
            create_s=round(create_s, 3),
            # > 0: scheduling was still going when the first job fell due
            created_after_first_due_ms=created_late_ms,
            all_fired=result["fired"] == n,
            waited_s=round(waited, 1),
            listener_cpu_s=round(cpu_s, 2),
            listener_rss_mb=round(consumer.rss_max_mb, 1),
            settings=SETTINGS[lib],
        )
    return result


def _now_ms() -> int:
    return int(time.time() * 1000)
