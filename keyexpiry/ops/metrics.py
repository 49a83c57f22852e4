"""Prometheus metrics: what the listener's own threads observe (runs, lateness, handler time),
what its parts already count (read at scrape time), and what the ledger holds (read with cheap
indexed queries, cached, one at a time on a thread of their own, never on the listener's hot
path; a scrape waits for them a bounded time).
Long because it is one exporter: every metric family the listener exposes, each a few lines,
beside the list of their names the docs and tests check.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from keyexpiry.clock import monotonic_s
from keyexpiry.ledger.recurring import MALFORMED_SCHEDULES
from keyexpiry.ops.observed import ObservedListener
from keyexpiry.runner.gate import Gate

if TYPE_CHECKING:
    from keyexpiry.ledger.recurring import ScheduleRow
    from keyexpiry.ledger.store import Store

PENDING_WINDOWS_S = (("overdue", 0), ("1m", 60), ("1h", 3600), ("1d", 86400))
"""Pending tasks by when they fall due: already due, within a minute, an hour, a day, later."""

NAMES = (
    "keyexpiry_runs_total",
    "keyexpiry_lateness_seconds",
    "keyexpiry_handler_seconds",
    "keyexpiry_claims_total",
    "keyexpiry_events_total",
    "keyexpiry_events_ignored_total",
    "keyexpiry_reconcile_rearmed_total",
    "keyexpiry_reconcile_requeued_total",
    "keyexpiry_overdue_repeats_total",
    "keyexpiry_malformed_rows_total",
    "keyexpiry_reconciliations_total",
    "keyexpiry_reconnects_total",
    "keyexpiry_redis_keys_lost_total",
    "keyexpiry_keys_not_armed_total",
    "keyexpiry_thread_errors_total",
    "keyexpiry_inflight",
    "keyexpiry_runs_waiting",
    "keyexpiry_workers_active",
    "keyexpiry_subscribed",
    "keyexpiry_events_arriving",
    "keyexpiry_ready",
    "keyexpiry_listener_info",
    "keyexpiry_listener_start_time_seconds",
    "keyexpiry_tasks",
    "keyexpiry_pending",
    "keyexpiry_overdue",
    "keyexpiry_listeners",
    "keyexpiry_share_buckets",
    "keyexpiry_share_peers",
    "keyexpiry_share_caught_up_total",
    "keyexpiry_ledger_up",
    "keyexpiry_ledger_query_seconds",
    "keyexpiry_schedule_last_success_timestamp_seconds",
    "keyexpiry_schedule_next_timestamp_seconds",
    "keyexpiry_schedule_interval_seconds",
    "keyexpiry_schedule_paused",
)
"""Every metric name `/metrics` serves (deploy/'s alert rules and dashboard use only these)."""


T = TypeVar("T")


@dataclass(frozen=True)
class Answer(Generic[T]):
    """What `LatestAnswer.get()` knows."""

    value: T | None
    """The last query's result; None when it failed (or none has finished)."""
    error: str | None
    """Why the last query failed (its first line); None when it answered."""
    running_s: float | None
    """How long the query under way has been running; None when none is."""


class LatestAnswer(Generic[T]):
    """A query many request threads want, on a database that may hang: it runs one at a time,
    on a thread of its own, and its result is reused for `max_age_s`. A caller waits for the
    query under way at most until `wait_s` after it started, then takes the last result: a
    hung database holds one thread, never one per request, and no request waits longer."""

    def __init__(
        self, query: Callable[[], T], *, name: str, max_age_s: float, wait_s: float
    ) -> None:
        self._query = query
        self._name = name
        self._max_age_s = max_age_s
        self.wait_s = wait_s
        self._lock = threading.Lock()  # never held while the query runs
        self._value: T | None = None
        self._error: str | None = None
        self._answered_s = -math.inf
        self._started_s: float | None = None
        self._done = threading.Event()

    def get(self) -> Answer[T]:
        """The last result, after starting a query when it is older than `max_age_s` and
        waiting for the one under way (at most until `wait_s` after it started)."""
        with self._lock:
            now = monotonic_s()
            if self._started_s is None and now - self._answered_s >= self._max_age_s:
                self._start(now)
            started, done = self._started_s, self._done
        if started is not None:
            done.wait(max(0.0, started + self.wait_s - monotonic_s()))
        with self._lock:
            running = None if self._started_s is None else monotonic_s() - self._started_s
            return Answer(self._value, self._error, running)

    def _start(self, now: float) -> None:
        self._started_s, self._done = now, threading.Event()
        try:
            threading.Thread(target=self._run, name=self._name, daemon=True).start()
        except RuntimeError as exc:  # no thread to be had: say so, try again next time
            self._finish(None, f"cannot start a thread for the query: {exc}")

    def _run(self) -> None:
        try:
            value, error = self._query(), None
        except Exception as exc:
            value, error = None, (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        with self._lock:
            self._finish(value, error)

    def _finish(self, value: T | None, error: str | None) -> None:
        self._value, self._error = value, error
        self._answered_s, self._started_s = monotonic_s(), None
        self._done.set()


@dataclass(frozen=True)
class ScheduleFigures:
    """One recurring schedule as `/metrics` shows it; times in Unix seconds."""

    name: str
    paused: bool
    last_success_s: float | None
    """When a run of it last ended done; None: never."""
    next_s: float | None
    """When its next occurrence is due; None while paused, and once it has ended."""
    interval_s: float | None
    """The gap between its next occurrence and the one after (a cron's gaps vary: Friday to
    Monday is 3 days for a weekday schedule); None when `next_s` is."""


def schedule_figures(s: ScheduleRow) -> ScheduleFigures:
    """`s` as `/metrics` shows it."""
    last_success_s = None if s.last_success_ms is None else s.last_success_ms / 1000
    nxt = None if s.paused else s.occurrence_ms
    interval_ms = None
    if nxt is not None:
        after = s.recurrence.after(nxt, s.anchor_ms)
        if after is not None:
            interval_ms = after - nxt
        elif s.last_scheduled_for_ms is not None and s.last_scheduled_for_ms < nxt:
            # Its last occurrence: the gap that led to it, so a failing last run still alerts.
            interval_ms = nxt - s.last_scheduled_for_ms
    return ScheduleFigures(
        s.name,
        s.paused,
        last_success_s,
        None if nxt is None else nxt / 1000,
        None if interval_ms is None else interval_ms / 1000,
    )


@dataclass
class LedgerFigures:
    """What the ledger holds now (one scrape's worth)."""

    by_status: dict[str, int]
    pending_by_window: dict[str, int]
    overdue: int
    live_listeners: int
    query_s: float
    schedules: list[ScheduleFigures]


class LedgerCollector(Collector):
    """Task counts from the ledger's (status, due_at_ms, …) index, and each recurring
    schedule's last success, next occurrence and interval (the schedule table, a row per
    schedule, read whole), at most every `min_interval_s`.

    Only pending, running and dead are counted: done and cancelled rows are the bulk of a large
    ledger and counting them would walk millions of index entries per scrape. The counts are
    read by `LatestAnswer`: a scrape waits for them at most `wait_s`, then serves the last ones,
    and none once a read has gone unanswered for `stale_after_s`.
    """

    def __init__(
        self,
        store: Store,
        now_ms: Callable[[], int],
        *,
        live_window_s: float = 5.0,
        min_interval_s: float = 5.0,
        wait_s: float = 1.0,
        stale_after_s: float = 30.0,
    ) -> None:
        self._store = store
        self._live_window_ms = int(live_window_s * 1000)
        self._now_ms = now_ms
        self._stale_after_s = stale_after_s
        self._latest = LatestAnswer(
            self._read, name="http-ledger-counts", max_age_s=min_interval_s, wait_s=wait_s
        )
        self.up = True

    def figures(self) -> LedgerFigures | None:
        """The latest figures, refreshed when older than `min_interval_s`; None when the last
        read failed or a read has gone unanswered for `stale_after_s`."""
        answer = self._latest.get()
        hung = answer.running_s is not None and answer.running_s >= self._stale_after_s
        self.up = answer.value is not None and not hung
        return answer.value if self.up else None

    def _read(self) -> LedgerFigures:
        started = time.perf_counter()
        now_ms = self._now_ms()
        by_status = self._store.active_counts()
        edges = [now_ms + s * 1000 for _, s in PENDING_WINDOWS_S]
        cumulative = self._store.pending_due_before([now_ms - 1000, *edges])
        live = self._store.count_live(now_ms - self._live_window_ms)
        overdue, below = cumulative[0], cumulative[1:]
        windows: dict[str, int] = {}
        prev = 0
        for (name, _), n in zip(PENDING_WINDOWS_S, below, strict=True):
            windows[name] = n - prev
            prev = n
        windows["later"] = by_status.get("pending", 0) - prev
        # The whole schedule table in one SELECT: a row per schedule, a handful in practice.
        schedules = [schedule_figures(s) for s in self._store.list_schedules()]
        return LedgerFigures(
            by_status, windows, overdue, live, time.perf_counter() - started, schedules
        )

    def collect(self) -> Iterator[Metric]:
        figures = self.figures()
        yield _gauge(
            "keyexpiry_ledger_up",
            "1 when the ledger answered the last read.",
            figures is not None,
        )
        if figures is None:
            return
        tasks = GaugeMetricFamily(
            "keyexpiry_tasks", "Ledger rows by status (pending, running, dead).", labels=["status"]
        )
        for status in ("pending", "running", "dead"):
            tasks.add_metric([status], figures.by_status.get(status, 0))
        yield tasks
        pending = GaugeMetricFamily(
            "keyexpiry_pending",
            "Pending tasks by when they fall due (overdue, 1m, 1h, 1d, later).",
            labels=["window"],
        )
        for window, n in figures.pending_by_window.items():
            pending.add_metric([window], n)
        yield pending
        yield _gauge(
            "keyexpiry_overdue",
            "Pending tasks more than a second past their due time.",
            figures.overdue,
        )
        yield _gauge(
            "keyexpiry_listeners",
            "Listeners whose heartbeat is fresh (the whole fleet).",
            figures.live_listeners,
        )
        yield _gauge(
            "keyexpiry_ledger_query_seconds",
            "Time the last ledger read for these figures took.",
            figures.query_s,
        )
        yield from _schedules(figures.schedules)


def _schedules(schedules: list[ScheduleFigures]) -> Iterator[Metric]:
    """The recurring schedules' figures, a series per schedule (none where there is no value:
    no last success yet; no next occurrence or interval while paused or once ended)."""
    families = {
        "last_success": GaugeMetricFamily(
            "keyexpiry_schedule_last_success_timestamp_seconds",
            "When a run of the schedule last ended done (Unix time); absent until one has.",
            labels=["schedule"],
        ),
        "next": GaugeMetricFamily(
            "keyexpiry_schedule_next_timestamp_seconds",
            "When the schedule's next occurrence is due (Unix time); absent while paused or "
            "once ended.",
            labels=["schedule"],
        ),
        "interval": GaugeMetricFamily(
            "keyexpiry_schedule_interval_seconds",
            "Seconds from the schedule's next occurrence to the one after; absent while paused "
            "or once ended.",
            labels=["schedule"],
        ),
        "paused": GaugeMetricFamily(
            "keyexpiry_schedule_paused",
            "1 while the schedule is paused, else 0.",
            labels=["schedule"],
        ),
    }
    for s in schedules:
        if s.last_success_s is not None:
            families["last_success"].add_metric([s.name], s.last_success_s)
        if s.next_s is not None:
            families["next"].add_metric([s.name], s.next_s)
        if s.interval_s is not None:
            families["interval"].add_metric([s.name], s.interval_s)
        families["paused"].add_metric([s.name], s.paused)
    yield from families.values()


def _flow(gate: Gate) -> Iterator[Metric]:
    """Flow control's figures: what was held back, what waits now, what is paused."""
    held_back = CounterMetricFamily(
        "keyexpiry_held_back",
        "Due tasks held back instead of claimed, each counted once when it starts waiting: "
        "limit (the method's concurrency), rate, group (one_at_a_time), paused.",
        labels=["task", "reason"],
    )
    for (task, reason), n in sorted(gate.held_back_total.items()):
        held_back.add_metric([task, reason], n)
    yield held_back
    held = GaugeMetricFamily(
        "keyexpiry_held_tasks",
        "Due tasks this listener holds back now (pending in the ledger), by reason.",
        labels=["task", "reason"],
    )
    for task, reasons in sorted(gate.held().items()):
        for reason, n in sorted(reasons.items()):
            held.add_metric([task, reason], n)
    yield held
    paused = GaugeMetricFamily(
        "keyexpiry_paused",
        "Pauses in force (a class or Class.method), as this listener last read them.",
        labels=["target"],
    )
    for pause in gate.paused():
        paused.add_metric([pause.target], 1)
    yield paused


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc)
    family.add_metric([], value)
    return family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    family.add_metric([], value)
    return family


class ListenerCollector(Collector):
    """What the listener's parts count already, read when Prometheus scrapes."""

    def __init__(self, listener: ObservedListener, ready: Callable[[], bool]) -> None:
        self._listener = listener
        self._ready = ready
        self._started_s = time.time()

    def collect(self) -> Iterator[Metric]:
        lst = self._listener
        stats = lst.dispatcher.stats

        claims = CounterMetricFamily(
            "keyexpiry_claims",
            "Claim attempts: won (this listener runs it), lost (another listener had it, or "
            "it was no longer pending).",
            labels=["result"],
        )
        claims.add_metric(["won"], stats.claimed)
        claims.add_metric(["lost"], stats.not_claimed + stats.claims_lost)
        yield claims
        events = CounterMetricFamily(
            "keyexpiry_events", "Keyspace events heard, by kind.", labels=["kind"]
        )
        events.add_metric(["expired"], lst.events)
        events.add_metric(["evicted"], lst.evicted)
        events.add_metric(["canary"], lst.canaries_seen)
        events.add_metric(["sentinel"], lst.router.sentinels)
        yield events
        ignored = CounterMetricFamily(
            "keyexpiry_events_ignored",
            "Events not acted on: foreign (another application's key), refused (looked like a "
            "task but is not a runnable one), other_listener (a task key in a live peer's "
            "share), no_row (a task key with no ledger row: forged, or its row deleted), "
            "intake_full (dropped in a flood; due tasks are read from the ledger instead), "
            "wake_dropped (wake messages past driver_max_rows; the window is read instead).",
            labels=["reason"],
        )
        ignored.add_metric(["foreign"], lst.foreign)
        ignored.add_metric(["refused"], lst.ignored)
        ignored.add_metric(["other_listener"], lst.router.others_share)
        ignored.add_metric(["no_row"], stats.no_row)
        ignored.add_metric(["intake_full"], stats.intake_full)
        ignored.add_metric(["wake_dropped"], lst.wakes_dropped)
        yield ignored
        yield from _flow(lst.dispatcher.gate)
        share = lst.fleet.partition
        yield _gauge(
            "keyexpiry_share_buckets",
            "Key buckets this listener claims, summed over its task classes (1024 per class "
            "when it shares with no one).",
            share.owned_buckets(),
        )
        yield _gauge(
            "keyexpiry_share_peers",
            "Other live listeners sharing task classes with this one.",
            share.peers,
        )
        yield _counter(
            "keyexpiry_share_caught_up",
            "Overdue tasks claimed from the ledger after taking over buckets nobody owned.",
            lst.fleet.caught_up,
        )
        rec = lst.reconciler
        yield _counter(
            "keyexpiry_reconcile_rearmed",
            "Task keys re-armed in Redis from the ledger.",
            rec.rearmed_total,
        )
        yield _counter(
            "keyexpiry_reconcile_requeued",
            "Tasks requeued from the ledger: overdue ones run directly, expired leases.",
            rec.requeued_total,
        )
        yield _counter(
            "keyexpiry_overdue_repeats",
            "Overdue tasks repaired again at a due time already reported (logged once each): "
            "rows no listener runs, such as an unregistered class or a method not exposed.",
            rec.overdue_repeats_total,
        )
        yield _counter(
            "keyexpiry_malformed_rows",
            "Ledger rows keyexpiry would not have written, met by this listener (each logged "
            "once, with its key): shown marked, skipped or run as due now (docs/GUARANTEES.md); "
            "pause rows pause nothing.",
            rec.malformed.count + lst.dispatcher.gate.malformed.count + MALFORMED_SCHEDULES.count,
        )
        yield _counter(
            "keyexpiry_reconciliations", "Full reconciliation passes.", lst.reconciles_done
        )
        yield _counter(
            "keyexpiry_redis_keys_lost",
            "Times this listener found Redis's marker key gone or replaced (FLUSHALL, FLUSHDB, "
            "a restart without persistence); each started a reconciliation.",
            lst.markers_lost,
        )
        arming = lst.dispatcher.arming
        yield _counter(
            "keyexpiry_keys_not_armed",
            "Batches of retry, next-occurrence or re-armed keys (their rows committed) that "
            "Redis refused or did not answer, or that found the arming queue full; the overdue "
            "check re-arms those rows.",
            arming.failed + arming.dropped,
        )
        yield _counter(
            "keyexpiry_reconnects", "Subscriptions dropped or rebuilt since start.", lst.gaps
        )
        yield _counter(
            "keyexpiry_thread_errors",
            "Unexpected exceptions the listener's threads survived.",
            lst.thread_errors.count,
        )
        inflight = lst.dispatcher.inflight
        yield _gauge(
            "keyexpiry_inflight",
            "Claimed runs not yet finished (queued or running).",
            inflight.count,
        )
        yield _gauge(
            "keyexpiry_runs_waiting",
            "Claimed runs waiting for a worker.",
            len(inflight.runq),
        )
        yield _gauge(
            "keyexpiry_workers_active",
            "Worker threads running a run or woken for one (of `concurrency`; idle ones are "
            "woken as the waiting runs need them), the claimer running a lone run itself "
            "counted as one.",
            inflight.runq.active() + inflight.inline,
        )
        yield _gauge(
            "keyexpiry_subscribed", "1 while subscribed to expired events.", lst.subscribed.is_set()
        )
        yield _gauge(
            "keyexpiry_events_arriving",
            "0 while the canary's expired event does not come back.",
            lst.events_arriving,
        )
        yield _gauge("keyexpiry_ready", "1 when /readyz answers 200.", self._ready())
        info = GaugeMetricFamily(
            "keyexpiry_listener_info", "This listener's identity.", labels=["listener", "host"]
        )
        info.add_metric([lst.owner, socket.gethostname()], 1)
        yield info
        yield _gauge(
            "keyexpiry_listener_start_time_seconds",
            "When this listener started (Unix time).",
            self._started_s,
        )
