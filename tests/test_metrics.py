"""RunMetrics: what the workers queue becomes Prometheus counters and histograms (pure logic);
and the recurring schedules' gauges, read from real ledgers while a listener runs them."""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
from collections.abc import Callable, Iterator
from zoneinfo import ZoneInfo

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from keyexpiry import Client, Settings
from keyexpiry.bench.servers import wait_until
from keyexpiry.ledger.recurring import ScheduleRow
from keyexpiry.ops.metrics import LedgerCollector, schedule_figures
from keyexpiry.run_metrics import RunMetrics
from keyexpiry.schedules.recurrence import Recurrence
from tests import flow_tasks
from tests.ke import Running
from tests.schedule_tasks import Report

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(metrics: Collector) -> Samples:
    registry = CollectorRegistry()
    registry.register(metrics)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_nothing_is_kept_until_enabled() -> None:
    m = RunMetrics()
    m.started("A.b", 5)
    m.ended("A.b", "done", 0.01)
    assert not any(name.startswith("keyexpiry_runs") for name, _ in scrape(m))


def test_observations_become_counts_and_cumulative_buckets() -> None:
    m = RunMetrics()
    m.enabled = True
    m.declare(["A.b"])
    for late_ms in (0, 2, 2, 40, 7_200_000):  # the last one is beyond the 1 h bucket
        m.started("A.b", late_ms)
    m.ended("A.b", "done", 0.002)
    m.ended("A.b", "dead", 0.5)
    got = scrape(m)
    task = (("task", "A.b"),)
    assert got[("keyexpiry_runs_total", (("outcome", "done"), *task))] == 1
    assert got[("keyexpiry_runs_total", (("outcome", "dead"), *task))] == 1
    assert got[("keyexpiry_runs_total", (("outcome", "timeout"), *task))] == 0  # declared
    bucket = "keyexpiry_lateness_seconds_bucket"
    assert got[(bucket, (("le", "0.001"), *task))] == 1
    assert got[(bucket, (("le", "0.0025"), *task))] == 3
    assert got[(bucket, (("le", "0.05"), *task))] == 4
    assert got[(bucket, (("le", "3600.0"), *task))] == 4
    assert got[(bucket, (("le", "+Inf"), *task))] == 5
    assert got[("keyexpiry_lateness_seconds_count", task)] == 5
    assert abs(got[("keyexpiry_lateness_seconds_sum", task)] - 7200.044) < 1e-6
    assert got[("keyexpiry_handler_seconds_count", task)] == 2


def test_concurrent_workers_lose_no_observation() -> None:
    m = RunMetrics()
    m.enabled = True
    m._FOLD_AT = 500  # fold often, from the workers themselves

    def work() -> None:
        for _ in range(5000):
            m.started("A.b", 1)
            m.ended("A.b", "done", 0.001)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = scrape(m)
    assert got[("keyexpiry_runs_total", (("outcome", "done"), ("task", "A.b")))] == 40_000
    assert got[("keyexpiry_lateness_seconds_count", (("task", "A.b"),))] == 40_000


def _sched(rec: Recurrence, **fields: object) -> ScheduleRow:
    row = ScheduleRow(
        name="s", task_key="A@m", class_name="A", method="m", args=(), recurrence=rec,
        anchor_ms=0, catch_up="latest", catch_up_max=100, overlap="skip", retry_schedule_s=None,
        source="api",
    )  # fmt: skip
    return dataclasses.replace(row, **fields)


def _berlin_ms(text: str) -> int:
    return int(
        dt.datetime.fromisoformat(text).replace(tzinfo=ZoneInfo("Europe/Berlin")).timestamp() * 1000
    )


def test_a_schedules_interval_is_the_gap_after_its_next_occurrence() -> None:
    weekdays = Recurrence(cron="0 9 * * 1-5", tz="Europe/Berlin")
    friday = _berlin_ms("2025-03-07T09:00")
    got = schedule_figures(_sched(weekdays, occurrence_ms=friday, last_success_ms=friday - 1))
    assert (got.next_s, got.interval_s) == (friday / 1000, 3 * 86400)  # to Monday
    # Across spring-forward (30 March 2025) a day is 23 hours.
    saturday = _berlin_ms("2025-03-29T09:00")
    daily = schedule_figures(
        _sched(Recurrence(cron="0 9 * * *", tz="Europe/Berlin"), occurrence_ms=saturday)
    )
    assert daily.interval_s == 23 * 3600 and daily.last_success_s is None
    # The last occurrence before the end: the gap that led to it.
    ending = Recurrence(every_s=60, start_ms=0, end_ms=120_000)
    last = schedule_figures(_sched(ending, occurrence_ms=120_000, last_scheduled_for_ms=60_000))
    assert (last.next_s, last.interval_s) == (120, 60)
    # Paused or ended: no next occurrence, no interval (so no alert about it).
    paused = schedule_figures(_sched(ending, occurrence_ms=60_000, paused=True, last_success_ms=5))
    assert (paused.paused, paused.next_s, paused.interval_s, paused.last_success_s) == (
        True, None, None, 0.005,
    )  # fmt: skip
    ended = schedule_figures(_sched(ending, occurrence_ms=None))
    assert (ended.next_s, ended.interval_s) == (None, None)


@pytest.fixture
def sampling(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Report.build notes its runs in the test's Redis."""
    monkeypatch.setenv(flow_tasks.SAMPLE_REDIS_ENV, redis_url)
    flow_tasks.reset()
    yield
    flow_tasks.reset()


def _of(samples: Samples, metric: str, schedule: str) -> float | None:
    return samples.get((f"keyexpiry_schedule_{metric}", (("schedule", schedule),)))


@pytest.mark.usefixtures("sampling")
def test_schedule_gauges_are_read_from_the_ledger(
    settings: Settings, client: Client, start_listener: Callable[[Settings], Running]
) -> None:
    collector = LedgerCollector(client.store, client.clock.now_ms, min_interval_s=0)
    assert not any(name.startswith("keyexpiry_schedule") for name, _ in scrape(collector))
    start_listener(settings)
    client.schedule("reports:eu", Report.build, "eu", every_s=1)
    daily = client.schedule("reports:daily", Report.build, "daily", cron="0 9 * * *")
    client.schedule("reports:paused", Report.build, "paused", cron="@hourly")
    assert client.pause_schedule("reports:paused")
    end = dt.datetime(2001, 1, 1, tzinfo=dt.UTC)
    client.schedule("reports:ended", Report.build, "ended", every_s=60, end=end)

    def succeeded() -> bool:
        found = client.get_schedule("reports:eu")
        return found is not None and found.last_success_ms is not None

    wait_until(succeeded, 15, message="a run of reports:eu ends done")
    before_s = client.clock.now_ms() / 1000
    m = scrape(collector)
    eu = client.get_schedule("reports:eu")
    assert eu is not None and eu.last_success_ms is not None
    # Read between the two reads of the row, which runs every second meanwhile.
    last_success = _of(m, "last_success_timestamp_seconds", "reports:eu")
    assert last_success is not None and before_s - 5 < last_success <= eu.last_success_ms / 1000
    assert _of(m, "interval_seconds", "reports:eu") == 1
    next_s = _of(m, "next_timestamp_seconds", "reports:eu")
    assert next_s is not None and before_s - 2 < next_s <= before_s + 2
    assert _of(m, "paused", "reports:eu") == 0
    # Never run: no last success; the next 09:00 UTC and the day after it.
    assert daily.occurrence_ms is not None
    assert _of(m, "last_success_timestamp_seconds", "reports:daily") is None
    assert _of(m, "next_timestamp_seconds", "reports:daily") == daily.occurrence_ms / 1000
    assert _of(m, "interval_seconds", "reports:daily") == 86400
    # Paused, ended: a series saying so, none for a next occurrence or an interval.
    for name, paused in (("reports:paused", 1), ("reports:ended", 0)):
        assert _of(m, "paused", name) == paused
        for metric in ("next_timestamp_seconds", "interval_seconds"):
            assert _of(m, metric, name) is None
    assert m[("keyexpiry_ledger_up", ())] == 1
