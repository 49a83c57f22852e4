"""`bench --scenario django`: enqueue-to-start through `keyexpiry.django.TasksBackend` beside
the native API, in the same run, the same listener process and the same Client.

Each run: a flushed Redis and an empty ledger on the run's backend, made by `migrate`; one
listener, `python -m django keyexpiry listen` on `keyexpiry.bench.django_settings`, which runs
both handlers of `keyexpiry.bench.django_tasks` (a Django `@task` function and a native task
class); this process, set up on the same settings module, is the producer, and the native side
uses the Client the backend uses (`keyexpiry.django.client()`), so what differs is the backend
alone. Two parts, each pacing `n` slots at `RATE_PER_S` with sleeps, every slot enqueueing one
task of each kind (which goes first alternates):

- immediate: `record.enqueue(...)` beside `create(..., ttl_ms=0)`; each carries the host time
  taken just before its call; enqueue-to-start = handler start minus that.
- deferred: `record.using(run_after=…).enqueue(...)` beside `create(..., at=…)`, slot i due at
  the part's start + `LEAD_MS` + i / `RATE_PER_S` (whole ms, the same instant for both kinds);
  lateness = handler start minus that instant.

Per kind and part: p50/p90/p99/max (ms), tasks fired, and the enqueue call's own cost: the median
wall time of one call (µs, the producer's host clock) and its CPU time per call (µs, this
thread's). The backend's rows carry `p50_vs_native`, `p99_vs_native`, `enqueue_vs_native` and
`enqueue_cpu_vs_native`: backend / native in the same run; the medians over runs are taken of
those per-run ratios (not ratios of the medians).
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from keyexpiry.bench.harness import ListenerProcess, Servers, median_of, percentiles

RATE_PER_S = 500
LEAD_MS = 2000
SETTINGS_MODULE = "keyexpiry.bench.django_settings"
BACKEND = "django"
NATIVE = "native"
KINDS = (BACKEND, NATIVE)
PARTS = ("immediate", "deferred")
WARMUP = -1
"""The index of warm-up runs (left out of every figure)."""


def sizes(quick: bool) -> int:
    """Tasks per kind and part: 2,000; --quick: 500."""
    return 500 if quick else 2000


@dataclass(frozen=True)
class Start:
    """One handler start as the handler noted it: `variant` is "<part>-<kind>"."""

    variant: str
    i: int
    ref_ms: float
    start_ms: float


def parse(text: str) -> list[Start]:
    """The complete `variant i ref_ms start_ms` lines (a torn last line is skipped)."""
    starts = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4:
            variant, i, ref, start = parts
            starts.append(Start(variant, int(i), float(ref), float(start)))
    return starts


def variant(part: str, kind: str) -> str:
    """The label a handler notes: `immediate-django`, `deferred-native`, …"""
    return f"{part}-{kind}"


@dataclass
class Calls:
    """The producer's cost of one kind's enqueue calls (perf_counter and thread CPU, seconds)."""

    wall_s: list[float] = field(default_factory=list)
    cpu_s: float = 0.0

    def figures(self) -> dict[str, Any]:
        """`enqueue_us` (median wall µs of one call) and `enqueue_cpu_us` (CPU µs per call)."""
        if not self.wall_s:
            return {"enqueue_us": float("nan"), "enqueue_cpu_us": float("nan")}
        return {
            "enqueue_us": round(percentiles(self.wall_s)["p50"] * 1e6, 1),
            "enqueue_cpu_us": round(self.cpu_s * 1e6 / len(self.wall_s), 1),
        }


def latency(starts: Iterable[Start], name: str, n: int) -> dict[str, Any]:
    """Percentiles (ms) of start minus ref of `name`'s first run of each index, fired, extra
    runs, and whether all `n` ran."""
    first: dict[int, Start] = {}
    extra = 0
    for s in starts:
        if s.variant != name or s.i == WARMUP:
            continue
        if s.i in first:
            extra += 1
            if s.start_ms < first[s.i].start_ms:
                first[s.i] = s
        else:
            first[s.i] = s
    late = [s.start_ms - s.ref_ms for s in first.values()]
    out: dict[str, Any] = {f"late_{k}_ms": round(v, 2) for k, v in percentiles(late).items()}
    out.update(fired=len(first), extra_runs=extra, n=n, all_fired=len(first) == n)
    return out


def _ratio(a: float, b: float) -> float:
    return round(a / b, 2) if b > 0 else float("nan")


def with_ratios(backend: dict[str, Any], native: dict[str, Any]) -> dict[str, Any]:
    """`backend`'s figures with backend / native for p50, p99, the enqueue call (wall, CPU)."""
    return {
        **backend,
        "p50_vs_native": _ratio(backend["late_p50_ms"], native["late_p50_ms"]),
        "p99_vs_native": _ratio(backend["late_p99_ms"], native["late_p99_ms"]),
        "enqueue_vs_native": _ratio(backend["enqueue_us"], native["enqueue_us"]),
        "enqueue_cpu_vs_native": _ratio(backend["enqueue_cpu_us"], native["enqueue_cpu_us"]),
    }


def part_figures(
    starts: list[Start], part: str, n: int, calls: dict[str, Calls]
) -> dict[str, dict[str, Any]]:
    """One part's figures by label (`immediate django`, `immediate native`), the backend's
    with its ratios to the native API's."""
    got = {
        kind: {**latency(starts, variant(part, kind), n), **calls[kind].figures()} for kind in KINDS
    }
    return {
        f"{part} {BACKEND}": with_ratios(got[BACKEND], got[NATIVE]),
        f"{part} {NATIVE}": got[NATIVE],
    }


@dataclass
class DjangoListener(ListenerProcess):
    """`python -m django keyexpiry listen` on the benchmark's settings module, measured as a
    `keyexpiry listen` is (it runs the native task class too: `KEYEXPIRY["TASKS"]`)."""

    def argv(self) -> list[str]:
        """`python -m django keyexpiry listen --concurrency N`."""
        return ["-m", "django", "keyexpiry", "listen", "--concurrency", str(self.concurrency)]

    def env(self) -> dict[str, str]:
        """The settings module, its Redis and ledger, where to note starts; no `KEYEXPIRY_*`
        (settings.py's `KEYEXPIRY` says what this listener runs with)."""
        from keyexpiry.bench.django_settings import DB_URL_ENV, REDIS_URL_ENV

        return {
            "DJANGO_SETTINGS_MODULE": SETTINGS_MODULE,
            REDIS_URL_ENV: self.redis_url,
            DB_URL_ENV: self.db_url,
            "KEYEXPIRY_BENCH_STARTS": str(self.starts_path),
            **self.extra_env,
        }


def _point_django_at(redis_url: str, db_url: str) -> None:
    """Django (set up on the first call) on this run's Redis and ledger, migrated."""
    os.environ["KEYEXPIRY_BENCH_DJANGO_REDIS_URL"] = redis_url
    os.environ["KEYEXPIRY_BENCH_DJANGO_DB_URL"] = db_url
    import django
    from django.conf import settings

    if not settings.configured:
        os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS_MODULE
        django.setup()
    else:
        from django.db import connections

        from keyexpiry.bench.django_settings import database_entry
        from keyexpiry.django.clients import reset

        # A fresh ledger database each run, in one process: Django reads DATABASES once, so
        # its connections forget the last run's (as tests/django/conftest.py does per test).
        connections.close_all()
        settings.DATABASES = {"default": database_entry(db_url)}
        settings.KEYEXPIRY = {**settings.KEYEXPIRY, "REDIS_URL": redis_url}
        connections.__dict__.pop("settings", None)
        try:
            del connections["default"]
        except AttributeError:
            pass  # not opened in this thread
        reset()
    from django.core.management import call_command

    call_command("migrate", "keyexpiry", verbosity=0, skip_checks=True)


def _read(listener: ListenerProcess) -> list[Start]:
    path = listener.starts_path
    return parse(path.read_text()) if path.exists() else []


def _wait_starts(listener: ListenerProcess, count: int, cap_s: float) -> float:
    """Until the listener noted `count` starts or `cap_s` passed; seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < cap_s and len(_read(listener)) < count:
        if listener.proc is not None and listener.proc.poll() is not None:
            raise RuntimeError(f"the Django listener exited ({listener.proc.returncode})")
        time.sleep(0.1)
    return time.monotonic() - start


def _at(ms: int) -> dt.datetime:
    """Epoch ms as an aware datetime, exactly (no float rounding)."""
    return dt.datetime.fromtimestamp(ms // 1000, dt.UTC) + dt.timedelta(milliseconds=ms % 1000)


Send = Callable[[int], None]


def _paced(n: int, senders: dict[str, Send], calls: dict[str, Calls]) -> None:
    """`n` slots at RATE_PER_S, sleeping to each; each slot calls every sender once (the
    first alternating), timing each call."""
    order = list(senders)
    start = time.perf_counter()
    for i in range(n):
        delay_s = start + i / RATE_PER_S - time.perf_counter()
        if delay_s > 0:
            time.sleep(delay_s)
        for kind in order if i % 2 == 0 else order[::-1]:
            wall, cpu = time.perf_counter(), time.thread_time()
            senders[kind](i)
            calls[kind].cpu_s += time.thread_time() - cpu
            calls[kind].wall_s.append(time.perf_counter() - wall)


def _senders(part: str, base_ms: int) -> dict[str, Send]:
    """Enqueue index i of `part`, backend and native (deferred: due at base + i / rate)."""
    from keyexpiry.bench.django_tasks import NATIVE as TARGET
    from keyexpiry.bench.django_tasks import record
    from keyexpiry.django.clients import client

    ke = client()
    django_v, native_v = variant(part, BACKEND), variant(part, NATIVE)
    if part == "immediate":
        return {
            BACKEND: lambda i: record.enqueue(django_v, i, time.time() * 1000),
            NATIVE: lambda i: ke.create(TARGET, native_v, i, time.time() * 1000, ttl_ms=0),
        }

    def due_ms(i: int) -> int:
        return base_ms + round(i * 1000 / RATE_PER_S)

    return {
        BACKEND: lambda i: record.using(run_after=_at(due_ms(i))).enqueue(django_v, i, due_ms(i)),
        NATIVE: lambda i: ke.create(TARGET, native_v, i, due_ms(i), at=_at(due_ms(i))),
    }


def _warm_up(listener: ListenerProcess) -> int:
    """One immediate task of each kind until both ran (imports, pools, first claims); returns
    the starts noted so far."""
    senders = _senders("immediate", 0)
    sent = 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for send in senders.values():
            send(WARMUP)
            sent += 1
        time.sleep(0.2)
        if {variant("immediate", k) for k in KINDS} <= {s.variant for s in _read(listener)}:
            _wait_starts(listener, sent, 30)
            return len(_read(listener))
    raise RuntimeError("no warm-up task ran through the Django listener")


@contextmanager
def _listener(redis_url: str, db_url: str) -> Iterator[DjangoListener]:
    from keyexpiry.django.clients import client

    with DjangoListener(redis_url=redis_url, db_url=db_url) as listener:
        listener.wait_subscribed(client(), timeout_s=60)
        yield listener


def once(srv: Servers, backend: str, n: int) -> dict[str, dict[str, Any]]:
    """One run of both parts on a fresh Redis and ledger; figures by label."""
    redis_url, db_url = srv.fresh(backend)
    _point_django_at(redis_url, db_url)
    out: dict[str, dict[str, Any]] = {}
    with _listener(redis_url, db_url) as listener:
        noted = _warm_up(listener)
        listener.mark_ready()
        for part in PARTS:
            calls = {kind: Calls() for kind in KINDS}
            base_ms = round(time.time() * 1000) + LEAD_MS
            _paced(n, _senders(part, base_ms), calls)
            noted += 2 * n
            waited_s = _wait_starts(listener, noted, cap_s=60 + n / 50)
            figures = part_figures(_read(listener), part, n, calls)
            for got in figures.values():
                got["waited_s"] = round(waited_s, 1)
            out.update(figures)
        cpu_s = listener.cpu_since_start()
    for got in out.values():
        got["listener_cpu_s"] = round(cpu_s, 2)  # both kinds' runs: one process
        got["listener_rss_mb"] = round(listener.rss_max_mb, 1)
    return out


def run(
    srv: Servers, backend: str, *, runs: int, quick: bool, say: Callable[[str], None] = print
) -> dict[str, Any]:
    """`runs` runs on ledger `backend`; each label's medians and runs."""
    n = sizes(quick)
    results: dict[str, list[dict[str, Any]]] = {}
    for i in range(runs):
        t = time.monotonic()
        got = once(srv, backend, n)
        for label, figures in got.items():
            results.setdefault(label, []).append(figures)
        say(f"  run {i + 1}/{runs} ({time.monotonic() - t:.0f} s):")
        for label, figures in got.items():
            say(f"    {label}: {_short(figures)}")
    medians = {label: {"median": median_of(rs), "runs": rs} for label, rs in results.items()}
    say(summary(medians, runs))
    return medians


def _short(r: dict[str, Any]) -> str:
    keys = (
        "late_p50_ms",
        "late_p99_ms",
        "late_max_ms",
        "fired",
        "extra_runs",
        "enqueue_us",
        "enqueue_cpu_us",
        "p50_vs_native",
        "p99_vs_native",
        "enqueue_cpu_vs_native",
    )
    return ", ".join(f"{k}={r[k]}" for k in keys if k in r)


def summary(medians: dict[str, dict[str, Any]], runs: int) -> str:
    """The backend / native ratios, one line per part (medians over runs of the per-run
    ratios)."""
    lines = [f"  backend / native, medians of {runs} run(s):"]
    for part in PARTS:
        m = medians.get(f"{part} {BACKEND}", {}).get("median", {})
        if m:
            lines.append(
                f"    {part}: p50 {m['p50_vs_native']:.2f}x, p99 {m['p99_vs_native']:.2f}x, "
                f"enqueue call {m['enqueue_vs_native']:.2f}x wall, "
                f"{m['enqueue_cpu_vs_native']:.2f}x CPU"
            )
    return "\n".join(lines)
