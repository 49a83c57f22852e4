"""What the workers observe of each run (outcome, lateness, handler time), kept as cheap counts
and served to Prometheus as a collector. Below everything that runs tasks, so the runtime can
hold one for its workers and `/metrics` can serve it."""

from __future__ import annotations

import bisect
import collections
import math
import threading
from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

LATENESS_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600,
)  # fmt: skip
"""Due time to handler start: 1 ms (what keyexpiry aims at) to an hour (an outage caught up)."""
HANDLER_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800, 3600)

OUTCOMES = ("done", "retry", "dead", "timeout")


class _Histogram:
    """Bucket counts and a sum, folded in by one thread at a time."""

    __slots__ = ("counts", "total")

    def __init__(self, size: int) -> None:
        self.counts = [0] * size
        self.total = 0.0

    def add(self, bounds: tuple[float, ...], value: float) -> None:
        self.counts[bisect.bisect_left(bounds, value)] += 1
        self.total += value

    def family_values(self, bounds: tuple[float, ...]) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, n in zip((*bounds, math.inf), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == math.inf else repr(float(bound)), float(running)))
        return out


class RunMetrics(Collector):
    """What the workers observe, per task (`Class.method`): runs by outcome, lateness, duration.

    The workers only append a tuple to a deque (lock-free under the GIL): prometheus-client's
    per-observation locks, taken by every worker on every run, cost the listener a fifth more
    CPU on trivial handlers (`keyexpiry bench --scenario throughput`). The observations are
    folded into plain counts when Prometheus scrapes (or when many have piled up), and nothing
    is kept at all until `enabled` (the listener serves `--http`).
    """

    _FOLD_AT = 20_000

    def __init__(self) -> None:
        self.enabled = False
        self._observed: collections.deque[tuple[str, str | None, float]] = collections.deque()
        self._fold_lock = threading.Lock()
        self._runs: dict[tuple[str, str], int] = {}
        self._lateness: dict[str, _Histogram] = {}
        self._handler: dict[str, _Histogram] = {}

    def declare(self, tasks: Iterable[str]) -> None:
        """Start every outcome series of `tasks` at 0, so the first dead run is an increase
        a `rate()` or `increase()` alert can see (a series born at 1 is not)."""
        with self._fold_lock:
            for task in tasks:
                for outcome in OUTCOMES:
                    self._runs.setdefault((task, outcome), 0)

    def started(self, task: str, late_ms: int) -> None:
        """A handler starts `late_ms` after its task's due time."""
        if self.enabled:
            self._observed.append((task, None, max(late_ms, 0) / 1000.0))

    def ended(self, task: str, outcome: str, took_s: float) -> None:
        """A run ended: `outcome` is done, retry, dead or timeout."""
        if self.enabled:
            self._observed.append((task, outcome, took_s))
            if len(self._observed) > self._FOLD_AT:
                self.fold(wait=False)

    def fold(self, *, wait: bool = True) -> None:
        """Count the observations queued so far (one thread at a time)."""
        if not self._fold_lock.acquire(blocking=wait):
            return
        try:
            observed, runs = self._observed, self._runs
            for _ in range(len(observed)):
                task, outcome, value = observed.popleft()
                if outcome is None:
                    hist = self._lateness.get(task) or self._lateness.setdefault(
                        task, _Histogram(len(LATENESS_BUCKETS_S) + 1)
                    )
                    hist.add(LATENESS_BUCKETS_S, value)
                    continue
                runs[task, outcome] = runs.get((task, outcome), 0) + 1
                hist = self._handler.get(task) or self._handler.setdefault(
                    task, _Histogram(len(HANDLER_BUCKETS_S) + 1)
                )
                hist.add(HANDLER_BUCKETS_S, value)
        finally:
            self._fold_lock.release()

    def collect(self) -> Iterator[Metric]:
        self.fold()
        runs = CounterMetricFamily(
            "keyexpiry_runs",
            "Handler runs by how they ended: done, retry, dead, timeout.",
            labels=["task", "outcome"],
        )
        lateness = HistogramMetricFamily(
            "keyexpiry_lateness_seconds",
            "From a task's due time to its handler's start.",
            labels=["task"],
        )
        handler = HistogramMetricFamily(
            "keyexpiry_handler_seconds",
            "How long handlers ran (timed-out runs count their timeout).",
            labels=["task"],
        )
        with self._fold_lock:
            for (task, outcome), n in sorted(self._runs.items()):
                runs.add_metric([task, outcome], n)
            for family, hists, bounds in (
                (lateness, self._lateness, LATENESS_BUCKETS_S),
                (handler, self._handler, HANDLER_BUCKETS_S),
            ):
                for task, hist in sorted(hists.items()):
                    family.add_metric([task], hist.family_values(bounds), hist.total)
        yield runs
        yield lateness
        yield handler
