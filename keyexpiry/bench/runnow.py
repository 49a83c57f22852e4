"""`bench --scenario run-now`: tasks due at once (`ttl_ms=0`) on keyexpiry beside Celery,
Dramatiq, RQ, arq and huey (optional extra `peers`), each on the benchmark's redis-server.

Two parts, each with fresh worker processes on a flushed Redis (and, for keyexpiry, an empty
ledger on the run's backend):

- latency: one worker process per system; a producer in this process enqueues `n` tasks one at
  a time at `RATE_PER_S`, paced with sleeps, each carrying the host time (`time.time()`) taken
  just before its enqueue call; the handler notes `time.time()` at its start. Enqueue-to-start
  percentiles come from those two, on the same host clock.
- burst: `n` tasks enqueued at once (keyexpiry: `create_many` in chunks of 10,000; the peers:
  their bulk call where they have one) while one, then `os.cpu_count()`, worker processes run;
  tasks/s from the first handler start to the last end (keyexpiry: to the last ledger row
  written done, if later).

Worker CPU is summed over every worker process (and the work horses RQ forks and reaps), from
their warm-up's end to the last task's end; RSS is the peak of the largest process and the sum of
every process's peak (forked processes share pages, so the sum overstates them).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from keyexpiry import Client, TaskRequest
from keyexpiry.bench.harness import (
    ListenerProcess,
    MeasuredProcess,
    Servers,
    median_of,
    percentiles,
    settings_for,
    wait_done,
)
from keyexpiry.bench.peer_runnow import PEERS, VARIANTS, WARMUP, Sender, sender
from keyexpiry.bench.scenarios import CHUNK, _wait_sharing

RATE_PER_S = 1000
TASK = "Bench.run_now"
KEY_LIKE = "Bench@run_now@%"  # `_` matches itself too; no escape SQLite would read
KEYEXPIRY = "keyexpiry"
SYSTEMS = (KEYEXPIRY, *PEERS, *VARIANTS)

SETTINGS = {
    KEYEXPIRY: "listener defaults: concurrency 8 threads, driver on; each run-now task's ledger "
    "row written (pending, then claimed, then done) on the run's backend",
    "celery": "worker --pool prefork (the default pool) with --concurrency = worker processes "
    "(1, then cores), prefetch multiplier 4, acks on receipt (acks_late off), no result backend",
    "dramatiq": "RedisBroker defaults, one Worker per process with 8 threads (the CLI's "
    "--threads default; the CLI's --processes N is N such processes), default middleware",
    "rq": "default Worker (forks a work horse per job, as `rq worker` does), one per process, "
    "log level WARNING; results kept 500 s in Redis (its default)",
    "rq-simple": "SimpleWorker (runs jobs in the worker process, no fork), one per process, "
    "log level WARNING",
    "arq": "Worker defaults: max_jobs 10, poll_delay 0.5 s, one per process; results kept 1 h",
    "huey": "RedisHuey defaults (blocking pop); consumer: 1 worker thread, or with several "
    "processes -k process -w N (one consumer); results stored (none returned)",
}
"""What each system ran with, carried into the JSON and the docs."""


def missing() -> list[str]:
    """The peers (and variants) whose library is not importable here."""
    return [s for s in (*PEERS, *VARIANTS) if importlib.util.find_spec(VARIANTS.get(s, s)) is None]


@dataclass(frozen=True)
class Run:
    """One handler run as the handler noted it (epoch ms, host clock)."""

    i: int
    sent_ms: float
    start_ms: float
    end_ms: float
    pid: int


def parse(text: str) -> list[Run]:
    """The complete `i sent_ms start_ms end_ms pid` lines (a torn last line is skipped: a worker
    may be writing it)."""
    runs = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 5:
            i, sent, start, end, pid = parts
            runs.append(Run(int(i), float(sent), float(start), float(end), int(pid)))
    return runs


def _firsts(runs: Iterable[Run]) -> dict[int, Run]:
    first: dict[int, Run] = {}
    for r in runs:
        if r.i != WARMUP and (r.i not in first or r.start_ms < first[r.i].start_ms):
            first[r.i] = r
    return first


def latency_figures(runs: list[Run]) -> dict[str, Any]:
    """Enqueue-to-start percentiles (ms) of each task's first run, fired, extra runs."""
    first = _firsts(runs)
    out: dict[str, Any] = {
        f"late_{k}_ms": round(v, 2)
        for k, v in percentiles([r.start_ms - r.sent_ms for r in first.values()]).items()
    }
    out["fired"] = len(first)
    out["extra_runs"] = len([r for r in runs if r.i != WARMUP]) - len(first)
    return out


def burst_figures(
    runs: list[Run], last_end_ms: float | None = None, enqueued_ms: float | None = None
) -> dict[str, Any]:
    """Fired, extra runs, tasks/s from the first start to the last end (or `last_end_ms`, when
    later: keyexpiry's last ledger row written done) and how many worker processes ran tasks.

    With `enqueued_ms` (when the producer's last bulk call returned), `drain_per_s` is the rate
    of the tasks that started after it: the workers' own, once no producer competes for the CPU
    or bounds the rate (left out when fewer than a tenth of the tasks were left by then).
    """
    first = _firsts(runs)
    out: dict[str, Any] = {
        "fired": len(first),
        "extra_runs": len([r for r in runs if r.i != WARMUP]) - len(first),
        "busy_workers": len({r.pid for r in first.values()}),
    }
    if len(first) > 1:
        end_ms = max(r.end_ms for r in first.values())
        if last_end_ms is not None:
            end_ms = max(end_ms, last_end_ms)
        span_s = (end_ms - min(r.start_ms for r in first.values())) / 1000
        out["tasks_per_s"] = round(len(first) / span_s) if span_s > 0 else float("nan")
        if enqueued_ms is not None:
            left = len([r for r in first.values() if r.start_ms >= enqueued_ms])
            if left >= len(first) / 10 and end_ms > enqueued_ms:
                out["drain_per_s"] = round(left / ((end_ms - enqueued_ms) / 1000))
    return out


def per_10k(cpu_s: float, tasks: int) -> float:
    """CPU seconds per 10,000 tasks (NaN for none)."""
    return round(cpu_s * 10_000 / tasks, 2) if tasks else float("nan")


def paced(n: int, rate_per_s: float, send: Callable[[int, float], Any]) -> float:
    """Call `send(i, sent_ms)` for i in range(n) at `rate_per_s`, sleeping to each call's slot
    (late calls go at once, to catch up); `sent_ms` is the host time just before the call.
    Returns the rate achieved."""
    start = time.perf_counter()
    for i in range(n):
        delay_s = start + i / rate_per_s - time.perf_counter()
        if delay_s > 0:
            time.sleep(delay_s)
        send(i, time.time() * 1000)
    return n / (time.perf_counter() - start)


@dataclass
class PeerWorker(MeasuredProcess):
    """A peer's worker (`python -m keyexpiry.bench.peer_runnow`), measured with its children:
    Celery's and huey's pool processes, RQ's work horses."""

    lib: str = ""
    redis_url: str = ""
    out: Path = Path()
    processes: int = 1
    _rss_peaks: dict[int, float] = field(default_factory=dict, init=False)

    def argv(self) -> list[str]:
        """`python -m keyexpiry.bench.peer_runnow <lib> <redis_url> <out> <processes>`."""
        out, processes = str(self.out), str(self.processes)
        return ["-m", "keyexpiry.bench.peer_runnow", self.lib, self.redis_url, out, processes]

    def _tree(self) -> list[psutil.Process]:
        return [self._ps, *self._ps.children(recursive=True)]

    def cpu_s(self) -> float:
        """CPU seconds of the process and its children, live and reaped."""
        total = 0.0
        for p in self._tree():
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
        return total

    def _sample(self) -> None:
        while not self._stop.is_set():
            for p in self._tree():
                with contextlib.suppress(psutil.Error):
                    mb = p.memory_info().rss / 2**20
                    self._rss_peaks[p.pid] = max(self._rss_peaks.get(p.pid, 0.0), mb)
            self.rss_max_mb = max(self._rss_peaks.values(), default=0.0)
            self._stop.wait(0.2)

    def rss_sum_mb(self) -> float:
        """The sum of every process's peak RSS (RQ's short-lived horses left out: they are
        forks of the worker, sharing its pages)."""
        live = {p.pid for p in self._tree() if p.is_running()}
        return sum(mb for pid, mb in self._rss_peaks.items() if pid in live)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.proc is None:
            return
        children = self._ps.children(recursive=True)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()


def _line_count(paths: list[Path]) -> int:
    return sum(p.read_bytes().count(b"\n") for p in paths if p.exists())


def _read(paths: list[Path]) -> list[Run]:
    return [r for p in paths if p.exists() for r in parse(p.read_text())]


def _wait_lines(paths: list[Path], lines: int, cap_s: float) -> float:
    """Until the record files hold `lines` lines or `cap_s` passes; seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < cap_s and _line_count(paths) < lines:
        time.sleep(0.1)
    return time.monotonic() - start


def _warm_up(
    send: Callable[[int, float], Any], paths: list[Path], workers: int, cap_s: float = 30
) -> tuple[int, int]:
    """Send warm-up tasks (each holds its worker a moment) until `workers` distinct processes
    ran one or `cap_s` passes, then until every one sent has run; returns (processes seen,
    warm-ups sent).

    Raises RuntimeError when no warm-up ran at all."""
    sent = 0
    deadline = time.monotonic() + cap_s
    seen: set[int] = set()
    while time.monotonic() < deadline:
        send(WARMUP, time.time() * 1000)
        sent += 1
        time.sleep(0.1)
        seen = {r.pid for r in _read(paths) if r.i == WARMUP}
        if len(seen) >= workers:
            break
    if not seen:
        raise RuntimeError("no warm-up task ran")
    _wait_lines(paths, sent, cap_s=30)
    return len(seen), sent


def _finish(
    figures: dict[str, Any],
    *,
    n: int,
    cpu_s: float,
    rss_max_mb: float,
    rss_sum_mb: float,
    workers: int,
    ready: int,
    system: str,
) -> dict[str, Any]:
    figures.update(
        n=n,
        all_fired=figures["fired"] == n,
        workers=workers,
        ready_workers=ready,
        worker_cpu_s=round(cpu_s, 2),
        cpu_s_per_10k=per_10k(cpu_s, figures["fired"]),
        worker_rss_mb=round(rss_max_mb, 1),
        worker_rss_sum_mb=round(rss_sum_mb, 1),
        settings=SETTINGS[system],
    )
    return figures


def peer_once(srv: Servers, lib: str, *, n: int, workers: int, burst: bool) -> dict[str, Any]:
    """One part (latency, or burst when `burst`) on peer `lib` with `workers` worker processes."""
    redis_url = srv.redis.url()
    client = srv.redis.client()
    client.flushall()
    client.close()
    out = srv.workdir / f"runnow-{lib}-{secrets.token_hex(3)}.runs"
    # Celery and huey run a pool of processes under one command; the others are one each.
    pooled = lib in ("celery", "huey")
    with contextlib.ExitStack() as stack:
        procs = [
            stack.enter_context(
                PeerWorker(
                    lib=lib, redis_url=redis_url, out=out, processes=workers if pooled else 1
                )
            )
            for _ in range(1 if pooled else workers)
        ]
        producer: Sender = sender(lib, redis_url)
        stack.callback(producer.close)
        ready, _ = _warm_up(producer.send, [out], workers)
        for p in procs:
            p.mark_ready()
        warm_lines = _line_count([out])
        enqueued_ms = 0.0
        start = time.perf_counter()
        if burst:
            base_ms = time.time() * 1000
            items = [(i, base_ms) for i in range(n)]
            for first in range(0, n, CHUNK):
                producer.send_many(items[first : first + CHUNK])
            enqueued_ms = time.time() * 1000
            figures: dict[str, Any] = {"enqueue_s": round(time.perf_counter() - start, 2)}
        else:
            figures = {"sent_per_s": round(paced(n, RATE_PER_S, producer.send))}
        figures["waited_s"] = round(_wait_lines([out], warm_lines + n, cap_s=_cap_s(n)), 1)
        cpu_s = sum(p.cpu_since_start() for p in procs)
        runs = _read([out])
        figures.update(burst_figures(runs, None, enqueued_ms) if burst else latency_figures(runs))
        return _finish(
            figures,
            n=n,
            cpu_s=cpu_s,
            rss_max_mb=max(p.rss_max_mb for p in procs),
            rss_sum_mb=sum(p.rss_sum_mb() for p in procs),
            workers=workers,
            ready=ready,
            system=lib,
        )


def _cap_s(n: int) -> float:
    """How long a part may take to drain once sent: 60 s plus 10 ms a task (RQ's forking worker
    runs a few hundred a second)."""
    return 60 + n / 100


def keyexpiry_once(
    srv: Servers, backend: str, *, n: int, workers: int, burst: bool
) -> dict[str, Any]:
    """One part on keyexpiry with `workers` listeners, its ledger on `backend`."""
    redis_url, db_url = srv.fresh(backend)
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(Client(settings_for(redis_url, db_url)))
        procs = [
            stack.enter_context(ListenerProcess(redis_url=redis_url, db_url=db_url))
            for _ in range(workers)
        ]
        for p in procs:
            p.wait_subscribed(client, listeners=workers)
        if workers > 1:
            _wait_sharing(client, workers)
        paths = [p.starts_path for p in procs]

        def create(i: int, sent_ms: float) -> None:
            client.create(TASK, i, sent_ms, ttl_ms=0)

        ready, warm_ups = _warm_up(create, paths, workers)
        for p in procs:
            p.mark_ready()
        warm_lines = _line_count(paths)
        enqueued_ms = 0.0
        start = time.perf_counter()
        if burst:
            for first in range(0, n, CHUNK):
                sent_ms = time.time() * 1000
                client.create_many(
                    TaskRequest(TASK, (i, sent_ms), ttl_ms=0)
                    for i in range(first, min(n, first + CHUNK))
                )
            enqueued_ms = time.time() * 1000
            figures: dict[str, Any] = {"enqueue_s": round(time.perf_counter() - start, 2)}
        else:
            figures = {"sent_per_s": round(paced(n, RATE_PER_S, create))}
        waited = _wait_lines(paths, warm_lines + n, cap_s=_cap_s(n))
        # The ledger rows written done too: the peers keep nothing but the broker's entries.
        waited += wait_done(client, n + warm_ups, cap_s=60, key_like=KEY_LIKE)
        figures["waited_s"] = round(waited, 1)
        cpu_s = sum(p.cpu_since_start() for p in procs)
        runs = _read(paths)
        if burst:
            figures.update(burst_figures(runs, _last_finished_ms(client), enqueued_ms))
        else:
            figures.update(latency_figures(runs))
        figures["ledger_done"] = _done_rows(client) - warm_ups
        return _finish(
            figures,
            n=n,
            cpu_s=cpu_s,
            rss_max_mb=max(p.rss_max_mb for p in procs),
            rss_sum_mb=sum(p.rss_max_mb for p in procs),
            workers=workers,
            ready=ready,
            system=KEYEXPIRY,
        )


def _done_rows(client: Client) -> int:
    from sqlalchemy import func, select

    from keyexpiry.ledger.store import T, TaskStatus

    with client.store.engine.connect() as conn:
        got = conn.execute(
            select(func.count()).where(
                T.c.status == TaskStatus.DONE.value, T.c.task_key.like(KEY_LIKE)
            )
        ).scalar_one()
    return int(got)


def _last_finished_ms(client: Client) -> float | None:
    from sqlalchemy import func, select

    from keyexpiry.ledger.store import T

    with client.store.engine.connect() as conn:
        got = conn.execute(
            select(func.max(T.c.finished_at_ms)).where(T.c.task_key.like(KEY_LIKE))
        ).scalar()
    return None if got is None else float(got)


BURST_DIVISOR = {"rq": 10}
"""Systems whose burst is smaller, said in its label and `n`: RQ's default Worker forks per job
and runs ~50 a second here (50,000 would take a quarter of an hour per part)."""


def sizes(quick: bool) -> tuple[int, int]:
    """(latency tasks, burst tasks): 5,000 and 50,000; --quick: 1,000 and 10,000."""
    return (1000, 10_000) if quick else (5000, 50_000)


def _label_n(n: int) -> str:
    return f"{n // 1000}k" if n % 1000 == 0 else str(n)


def run(
    srv: Servers,
    backend: str,
    *,
    runs: int,
    quick: bool,
    peers: bool,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every part on keyexpiry (and the installed peers, with `peers`), `runs` rounds; each
    round runs every system once, in turn (the machine's drift moves them together)."""
    systems = [KEYEXPIRY]
    if peers:
        if absent := missing():
            say(f"  peers skipped: {', '.join(absent)} not installed (`make bench-peers`)")
        systems += [s for s in (*PEERS, *VARIANTS) if s not in absent]
    latency_n, burst_n = sizes(quick)
    cores = os.cpu_count() or 1
    results: dict[str, list[dict[str, Any]]] = {}
    for i in range(runs):
        for system in systems:
            burst_of = burst_n // BURST_DIVISOR.get(system, 1)
            parts = [("latency", latency_n, 1, False)]
            for w in sorted({1, cores}):
                parts.append((f"{_label_n(burst_of)} workers={w}", burst_of, w, True))
            for part, n, workers, burst in parts:
                label = f"{system} {part}"
                t = time.monotonic()
                if system == KEYEXPIRY:
                    got = keyexpiry_once(srv, backend, n=n, workers=workers, burst=burst)
                else:
                    got = peer_once(srv, system, n=n, workers=workers, burst=burst)
                results.setdefault(label, []).append(got)
                say(f"  {label} run {i + 1}/{runs}: {_short(got)} ({time.monotonic() - t:.0f} s)")
    return {label: {"median": median_of(rs), "runs": rs} for label, rs in results.items()}


def _short(r: dict[str, Any]) -> str:
    keys = (
        "late_p50_ms",
        "late_p99_ms",
        "sent_per_s",
        "tasks_per_s",
        "drain_per_s",
        "enqueue_s",
        "fired",
        "extra_runs",
        "cpu_s_per_10k",
        "worker_rss_mb",
        "ready_workers",
    )
    return ", ".join(f"{k}={r[k]}" for k in keys if k in r)
