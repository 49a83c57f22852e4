"""`bench --scenario flow`: flow rules on a wave due within one second, on two listeners.

(a) `rate="2000/s"` on 20,000 tasks: the most handler starts in any 1-second window, and the time
from the wave's first due time to its last start (about 10 s by the rate). (b) `concurrency=4` on
runs of 50 ms: the most runs seen at once (counted by the handlers in Redis). 20,000 such runs
would take 250 s, so (b) runs 400 (about 5 s). (c) each wave again with no rule, in the same
round on the same listeners: the rule's cost is the ratio (`time_vs_unlimited`,
`cpu_vs_unlimited`).

Each round starts two listeners on a fresh ledger, runs a small warm-up wave and measures their
idle CPU, then runs every variant in turn (each unlimited wave before its rule's).
`--quick`: (a) 2,000 tasks at 1,000/s (about 2 s), (b) 160 runs (about 2 s).

A rate is kept where permits are granted, just before the claim: `max_claims_1s` counts the
claims (the ledger's started_at_ms) in a second, `max_starts_1s` the handlers' entries, which
follow their claims by a few ms (`claim_to_start_*_ms`) and so may crowd a second a little more.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import psutil
from sqlalchemy import func, select

from keyexpiry import Client
from keyexpiry.bench import flow_tasks  # also registers BenchFlow in this process
from keyexpiry.bench.harness import (
    ListenerProcess,
    Servers,
    median_of,
    percentiles,
    purge,
    settings_for,
    wait_done,
)
from keyexpiry.bench.scenarios import _create_wave, _wait_sharing
from keyexpiry.flow.rules import Rate, parse_rate
from keyexpiry.keys import parse_key
from keyexpiry.ledger.store import T

TASKS = "keyexpiry.bench.tasks,keyexpiry.bench.flow_tasks"
LISTENERS = 2
SPAN_S = 1.0
"""Every wave falls due within this second."""
WINDOW_MS = 1000


@dataclass(frozen=True)
class Variant:
    """One wave: `n` runs of `BenchFlow.<method>`, under `rule` (None: unlimited)."""

    label: str
    method: str
    n: int
    rate: Rate | None = None
    concurrency: int | None = None
    hold_s: float = 0.0
    baseline: str | None = None
    """The unlimited variant its ratios are to."""
    note: str = ""

    @property
    def ideal_s(self) -> float | None:
        """The shortest time the rule allows: from the first start to the last start (a rate:
        its burst, then one per interval) or to the last end (a concurrency limit)."""
        if self.rate is not None:
            return max(0, self.n - self.rate.burst) * self.rate.interval_s
        if self.concurrency is not None:
            return math.ceil(self.n / self.concurrency) * self.hold_s
        return None


def variants(quick: bool) -> list[Variant]:
    """The waves of one round, each unlimited one before the rule compared with it."""
    rate = flow_tasks.QUICK_RATE if quick else flow_tasks.RATE
    paced_n = 2000 if quick else 20_000
    held_n = 160 if quick else 400
    c, hold_ms = flow_tasks.CONCURRENCY, round(flow_tasks.HOLD_S * 1000)
    free = f"unlimited n={paced_n}"
    slow = f"unlimited n={held_n} hold={hold_ms}ms"
    return [
        Variant(free, "free", paced_n),
        Variant(
            f"rate={rate} n={paced_n}",
            "paced_quick" if quick else "paced",
            paced_n,
            rate=parse_rate(rate, "rate"),
            baseline=free,
        ),
        Variant(slow, "unlimited", held_n, hold_s=flow_tasks.HOLD_S),
        Variant(
            f"concurrency={c} n={held_n} hold={hold_ms}ms",
            "limited",
            held_n,
            concurrency=c,
            hold_s=flow_tasks.HOLD_S,
            baseline=slow,
            note=f"{held_n} runs, not {paced_n}: at {c} x {hold_ms} ms that many would take "
            f"{paced_n * flow_tasks.HOLD_S / c:.0f} s",
        ),
    ]


# --- figures (no server) ------------------------------------------------------------------------
class Run(NamedTuple):
    """One run as its handler noted it: `i`, the task's argument; due and start (`started_at_ms`)
    in ms on the shared clock; the handler's entry and exit in ms on this machine's clock."""

    i: int
    due_ms: float
    start_ms: float
    entry_ms: float
    exit_ms: float

    @property
    def end_ms(self) -> float:
        """The handler's exit on the shared clock."""
        return self.start_ms + (self.exit_ms - self.entry_ms)


def parse_runs(text: str, method: str) -> list[Run]:
    """The runs of `method` among the lines of a starts file (a line still being written, at
    the end, is skipped)."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 6 and parts[0] == method:
            with contextlib.suppress(ValueError):
                out.append(Run(int(parts[1]), *map(float, parts[2:])))
    return out


def clock_spread_ms(per_listener: Iterable[Sequence[Run]]) -> float:
    """How far apart the listeners' shared clocks ran: the spread of their median (machine
    clock at handler entry minus `started_at_ms`). It includes the lag from `started_at_ms` to
    the handler's entry, a few ms at most when the listeners are equally loaded."""
    medians = [
        statistics.median(r.entry_ms - r.start_ms for r in runs) for runs in per_listener if runs
    ]
    return round(max(medians) - min(medians), 1) if medians else float("nan")


def max_in_window(times: Iterable[float], width: float) -> int:
    """The most `times` in any half-open window [t, t + width)."""
    ordered = sorted(times)
    most = 0
    for i, t in enumerate(ordered):
        most = max(most, bisect.bisect_left(ordered, t + width, lo=i) - i)
    return most


def max_overlap(intervals: Iterable[tuple[float, float]]) -> int:
    """The most [start, end) intervals covering one instant (one ending as another starts
    does not overlap it)."""
    events = sorted(
        ev for start, end in intervals for ev in ((start, 1), (end, -1))
    )  # at equal times -1 sorts before +1
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def figures(
    runs: Sequence[Run], first_due_ms: float, claims: Mapping[int, float] | None = None
) -> dict[str, Any]:
    """The wave's figures from its runs: lateness, time from the first due time to the last
    start and end, starts/s (on the shared clock); the most handler entries in any second and
    the most handlers running at once (on the machine's clock, which both listeners read
    alike). With `claims` (task argument → claim time), the most claims in any second and the
    lag from claim to start."""
    out: dict[str, Any] = {
        f"late_{k}_ms": v for k, v in percentiles([r.start_ms - r.due_ms for r in runs]).items()
    }
    out["noted"] = len(runs)
    if not runs:
        return out
    starts = [r.start_ms for r in runs]
    first, last = min(starts), max(starts)
    last_end = max(r.end_ms for r in runs)
    out.update(
        due_to_last_start_s=round((last - first_due_ms) / 1000, 3),
        due_to_last_end_s=round((last_end - first_due_ms) / 1000, 3),
        first_start_to_last_start_s=round((last - first) / 1000, 3),
        first_start_to_last_end_s=round((last_end - first) / 1000, 3),
        max_starts_1s=max_in_window((r.entry_ms for r in runs), WINDOW_MS),
        max_overlap_noted=max_overlap((r.entry_ms, r.exit_ms) for r in runs),
    )
    if last_end > first:
        out["tasks_per_s"] = round(len(runs) / ((last_end - first) / 1000), 1)
    if claims is not None:
        out["max_claims_1s"] = max_in_window(claims.values(), WINDOW_MS)
        lags = [r.start_ms - claims[r.i] for r in runs if r.i in claims]
        out.update({f"claim_to_start_{k}_ms": v for k, v in percentiles(lags).items()})
    return out


def add_ratios(got: dict[str, Any], base: dict[str, Any]) -> None:
    """`got`'s time (to the last end), listener CPU and Redis CPU as ratios to `base`'s."""
    for key, name in (
        ("due_to_last_end_s", "time_vs_unlimited"),
        ("listener_cpu_s", "cpu_vs_unlimited"),
        ("redis_cpu_s", "redis_cpu_vs_unlimited"),
    ):
        if got.get(key) is not None and base.get(key):
            got[name] = round(got[key] / base[key], 3)


# --- the waves ----------------------------------------------------------------------------------
def _key_like(method: str) -> str:
    return f"BenchFlow@{method}@%"


def _max_attempts(client: Client, key_like: str) -> int:
    with client.store.engine.connect() as conn:
        got = conn.execute(select(func.max(T.c.attempts)).where(T.c.task_key.like(key_like)))
        return int(got.scalar() or 0)


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def _read_from(path: Path, offset: int) -> str:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read().decode()


def wave(
    client: Client,
    procs: list[ListenerProcess],
    redis_proc: psutil.Process,
    v: Variant,
    *,
    lead_s: float,
    span_s: float = SPAN_S,
    cap_s: float = 90,
) -> dict[str, Any]:
    """Run one wave of `v`, due over `span_s` from `lead_s` on, on the listeners `procs`; its
    figures."""
    begun_s = time.monotonic()
    key_like = _key_like(v.method)
    client.redis.delete(flow_tasks.now_key(v.method), flow_tasks.max_key(v.method))
    offsets = [p.starts_path.stat().st_size for p in procs]
    cpu0 = sum(p.cpu_s() for p in procs)
    redis0 = _cpu(redis_proc)
    first_due = client.clock.now_ms() + int(lead_s * 1000)
    create_s = _create_wave(
        client, v.n, first_due, int(span_s * 1000), task=f"BenchFlow.{v.method}"
    )
    created_after_first_due_ms = max(0, client.clock.now_ms() - first_due)
    wait_s = max(0.0, (first_due - client.clock.now_ms()) / 1000)
    waited = wait_done(client, v.n, cap_s=wait_s + span_s + cap_s, key_like=key_like)
    cpu_s = sum(p.cpu_s() for p in procs) - cpu0
    redis_cpu_s = _cpu(redis_proc) - redis0
    per_listener = [
        parse_runs(_read_from(p.starts_path, off), v.method)
        for p, off in zip(procs, offsets, strict=True)
    ]
    runs = [r for rs in per_listener for r in rs]
    with client.store.engine.connect() as conn:
        # Each run's claim time (the ledger's started_at_ms, taken by its listener just after
        # the permits were granted): the rate as the permits saw it, without the lag to start.
        claims = {
            parse_key(key).args[0]: float(ms)
            for key, ms in conn.execute(
                select(T.c.task_key, T.c.started_at_ms).where(
                    T.c.status == "done", T.c.task_key.like(key_like)
                )
            )
        }
    got: dict[str, Any] = {"rule": v.label.split(" ")[0], "n": v.n}
    got.update(figures(runs, first_due, {int(i): ms for i, ms in claims.items()}))
    fired = len(claims)
    got.update(
        fired=fired,
        all_fired=fired == v.n,
        wave_s=round(time.monotonic() - begun_s, 1),
        create_s=round(create_s, 3),
        created_after_first_due_ms=created_after_first_due_ms,
        waited_s=round(waited, 1),
        listener_cpu_s=round(cpu_s, 2),
        cpu_ms_per_task=round(cpu_s * 1000 / v.n, 3),
        redis_cpu_s=round(redis_cpu_s, 2),
        listeners=len(procs),
        listener_clock_spread_ms=clock_spread_ms(per_listener),
        max_attempts=_max_attempts(client, key_like),
    )
    if v.hold_s:
        got["hold_ms"] = round(v.hold_s * 1000)
        got["max_at_once"] = int(client.redis.get(flow_tasks.max_key(v.method)) or 0)
    if (ideal := v.ideal_s) is not None:
        got["ideal_s"] = round(ideal, 3)
        took = got.get("first_start_to_last_start_s" if v.rate else "first_start_to_last_end_s")
        if took is not None and ideal > 0:
            got["vs_ideal"] = round(took / ideal, 3)
    if v.note:
        got["note"] = v.note
    purge(client, key_like)
    return got


def one_round(
    srv: Servers, backend: str, vs: list[Variant], *, quick: bool
) -> dict[str, dict[str, Any]]:
    """Two listeners on a fresh ledger; every variant in turn; figures by label."""
    redis_url, db_url = srv.fresh(backend)
    lead_s = 1.0 if quick else 3.0
    redis_proc = psutil.Process(srv.redis.pid)
    out: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(Client(settings_for(redis_url, db_url)))
        procs = [
            stack.enter_context(ListenerProcess(redis_url=redis_url, db_url=db_url, tasks=TASKS))
            for _ in range(LISTENERS)
        ]
        for proc in procs:
            proc.wait_subscribed(client, listeners=LISTENERS)
        _wait_sharing(client, LISTENERS)
        # Connections, statements and scripts made before anything is measured.
        # (The rate's wave loads the permit scripts every rule shares.)
        for method in ("free", vs[1].method):
            warm_up = Variant("warm-up", method, 50)
            wave(client, procs, redis_proc, warm_up, lead_s=0.5, span_s=0.1)
        idle_s = 0.5 if quick else 3.0
        cpu0 = sum(p.cpu_s() for p in procs)
        time.sleep(idle_s)
        idle = (sum(p.cpu_s() for p in procs) - cpu0) / idle_s
        for v in vs:
            got = wave(client, procs, redis_proc, v, lead_s=lead_s)
            got["listener_idle_cpu_per_s"] = round(idle, 3)
            if v.baseline is not None:
                add_ratios(got, out[v.baseline])
            out[v.label] = got
    return out


def _say_one(label: str, got: dict[str, Any], i: int, runs: int) -> str:
    keys = (
        "fired",
        "due_to_last_start_s",
        "due_to_last_end_s",
        "max_starts_1s",
        "max_claims_1s",
        "max_at_once",
        "late_p50_ms",
        "late_p99_ms",
        "listener_cpu_s",
        "time_vs_unlimited",
        "cpu_vs_unlimited",
    )
    shown = ", ".join(f"{k}={got[k]}" for k in keys if k in got)
    return f"  {label} run {i + 1}/{runs}: {shown} ({got['wave_s']:.0f} s)"


def run(
    srv: Servers,
    backend: str,
    *,
    runs: int,
    quick: bool,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """`runs` rounds; each variant's median and runs."""
    vs = variants(quick)
    for v in vs:
        if v.note:
            say(f"  {v.label}: {v.note}")
    results: dict[str, list[dict[str, Any]]] = {v.label: [] for v in vs}
    for i in range(runs):
        got = one_round(srv, backend, vs, quick=quick)
        for v in vs:
            results[v.label].append(got[v.label])
            say(_say_one(v.label, got[v.label], i, runs))
    return {label: {"median": median_of(rs), "runs": rs} for label, rs in results.items()}
