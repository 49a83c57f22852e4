"""Recurring schedules: occurrences by cron in time zones (both daylight-saving changes of
Europe/Berlin and America/New_York, a half-hour zone) and by interval; catch-up and overlap
policies (pure); and on real Redis and ledgers, occurrences run once each, declared twice they
stay one, changed they move, paused they catch up, removed they stop."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from keyexpiry import Client, ConfigError, exposed, recurring
from keyexpiry.bench.servers import wait_until
from keyexpiry.ledger.rows import Occurrence, Outcome
from keyexpiry.ledger.store import TaskStatus
from keyexpiry.listener.reconcile import Reconciler
from keyexpiry.registry import Registry
from keyexpiry.schedules import Plan, Recurrence, next_after_run, plan_run
from tests import schedule_tasks
from tests.ke import Running, make_settings
from tests.schedule_tasks import Report

StartListener = Callable[..., Running]


def _ms(text: str, zone: str) -> int:
    return int(dt.datetime.fromisoformat(text).replace(tzinfo=ZoneInfo(zone)).timestamp() * 1000)


def _local(ms: int, zone: str) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, ZoneInfo(zone)).isoformat()


def _walk(rec: Recurrence, since_ms: int, count: int) -> list[str]:
    out, t = [], since_ms
    for _ in range(count):
        nxt = rec.after(t, since_ms)
        assert nxt is not None
        out.append(_local(nxt, rec.tz))
        t = nxt
    return out


# --- when occurrences fall ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("zone", "spring", "fall"),
    [
        ("Europe/Berlin", "2025-03-29T12:00", "2025-10-25T12:00"),
        ("America/New_York", "2025-03-08T12:00", "2025-11-01T12:00"),
    ],
)
def test_a_daily_time_in_a_skipped_hour_runs_after_it_and_in_a_repeated_hour_once(
    zone: str, spring: str, fall: str
) -> None:
    rec = Recurrence(cron="30 2 * * *", tz=zone)
    # Spring forward: 02:30 does not exist that night; it runs at 03:00, the first instant after.
    got = _walk(rec, _ms(spring, zone), 2)
    assert got[0].startswith(f"{spring[:8]}{int(spring[8:10]) + 1:02d}T03:00:00")
    assert "T02:30:00" in got[1]
    # Fall back: 02:30 happens twice that night (New York: 01:30 twice, 02:30 once); once here.
    got = _walk(rec, _ms(fall, zone), 3)
    days = [g[:10] for g in got]
    assert len(set(days)) == 3, got


def test_an_hour_repeated_by_a_fall_back_runs_each_time_once_for_a_fixed_hour() -> None:
    zone = "Europe/Berlin"
    fixed = _walk(Recurrence(cron="*/30 1-3 * * *", tz=zone), _ms("2025-10-26T00:00", zone), 6)
    assert fixed == [
        "2025-10-26T01:00:00+02:00",
        "2025-10-26T01:30:00+02:00",
        "2025-10-26T02:00:00+02:00",
        "2025-10-26T02:30:00+02:00",
        "2025-10-26T03:00:00+01:00",  # 02:00 and 02:30 of the second pass did run: skipped
        "2025-10-26T03:30:00+01:00",
    ]
    # Hour `*`: a real-time interval ("every 30 minutes") ticks through both passes, as cron.
    every = _walk(Recurrence(cron="*/30 * * * *", tz=zone), _ms("2025-10-26T01:45", zone), 4)
    assert every == [
        "2025-10-26T02:00:00+02:00",
        "2025-10-26T02:30:00+02:00",
        "2025-10-26T02:00:00+01:00",
        "2025-10-26T02:30:00+01:00",
    ]


def test_a_half_hour_zone_and_the_named_forms() -> None:
    kolkata = _walk(Recurrence(cron="@daily", tz="Asia/Kolkata"), _ms("2025-06-01T12:00", "UTC"), 2)
    assert kolkata == ["2025-06-02T00:00:00+05:30", "2025-06-03T00:00:00+05:30"]
    adelaide = Recurrence(cron="0 9 * * 1-5", tz="Australia/Adelaide")  # +09:30 / +10:30
    assert _walk(adelaide, _ms("2025-10-03T12:00", "Australia/Adelaide"), 2) == [
        "2025-10-06T09:00:00+10:30",  # after its spring forward (5 October)
        "2025-10-07T09:00:00+10:30",
    ]


def test_an_interval_counts_from_its_start_and_ends_at_its_end() -> None:
    rec = Recurrence(every_s=900, start_ms=1_000_000, end_ms=1_000_000 + 3 * 900_000)
    assert rec.after(0, anchor_ms=0) == 1_000_000
    assert rec.after(1_000_000, anchor_ms=0) == 1_900_000
    assert rec.after(1_000_000 + 3 * 900_000, anchor_ms=0) is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cron": "61 * * * *"}, "is not a cron expression"),
        ({"cron": "0 9 * *"}, "is not a cron expression"),
        ({"cron": "0 9 * * *", "tz": "Mars/Olympus"}, "is no IANA time zone"),
        ({}, "needs either cron= or every_s="),
        ({"cron": "@daily", "every_s": 5}, "needs either cron= or every_s="),
        ({"every_s": 0.1}, "every_s must be from 1"),
    ],
)
def test_a_bad_recurrence_is_refused_in_one_line(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        Recurrence(**kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


def test_a_scheduled_method_with_arguments_or_a_bad_policy_is_refused_at_import() -> None:
    class Nightly:
        @exposed(cron="0 3 * * *")
        def run(self, region: str) -> None: ...

    with pytest.raises(ConfigError, match="for a method without arguments"):
        Registry().register(Nightly)
    with pytest.raises(ConfigError, match="catch_up must be one of latest, all, none"):
        exposed(cron="0 3 * * *", catch_up="some")


HOUR = 3_600_000


def test_catch_up_after_downtime_runs_latest_all_or_none() -> None:
    rec = Recurrence(every_s=3600)
    due, now = 10 * HOUR, 13 * HOUR + 5  # down across 11:00, 12:00 and 13:00
    assert _chose(plan_run(rec, due, now, 0, "latest")) == (True, 13 * HOUR)
    assert plan_run(rec, due, now, 0, "all") == Plan(True, 10 * HOUR, 3)
    assert _chose(plan_run(rec, due, now, 0, "all", catch_up_max=2)) == (True, 12 * HOUR)
    assert _chose(plan_run(rec, due, now, 0, "none")) == (False, 13 * HOUR)
    assert plan_run(rec, due, due + 5, 0, "none") == Plan(True, due, 0)  # just late: runs


def test_catch_up_after_months_down_walks_a_window_not_every_occurrence() -> None:
    minutely = Recurrence(cron="* * * * *")
    due, now = 0, 200 * 24 * HOUR + 30_000  # 288,000 minutes missed
    assert _chose(plan_run(minutely, due, now, 0, "latest")) == (True, 200 * 24 * HOUR)
    plan = plan_run(minutely, due, now, 0, "all", catch_up_max=3)
    assert plan.scheduled_for_ms == 200 * 24 * HOUR - 2 * 60_000  # the last three, in order
    assert next_after_run(minutely, plan.scheduled_for_ms, now + 10, 0, "skip", now) == (
        200 * 24 * HOUR - 60_000
    )
    # Kept in whole milliseconds, as stored: declared again, the same definition.
    assert Recurrence(every_s=90.1234) == Recurrence(every_s=90.123)


def _chose(plan: Plan) -> tuple[bool, int]:
    return plan.run, plan.scheduled_for_ms


def test_a_run_that_overlaps_its_next_occurrence_skips_it_or_waits() -> None:
    rec = Recurrence(every_s=3600)
    assert next_after_run(rec, 10 * HOUR, 10 * HOUR + 60_000, 0, "skip") == 11 * HOUR
    assert next_after_run(rec, 10 * HOUR, 12 * HOUR + 60_000, 0, "skip") == 13 * HOUR
    assert next_after_run(rec, 10 * HOUR, 12 * HOUR + 60_000, 0, "wait") == 11 * HOUR
    # Due before the run started (catch_up="all" working through a backlog): not an overlap.
    late_start = 12 * HOUR + 30_000
    assert next_after_run(rec, 10 * HOUR, 12 * HOUR + 60_000, 0, "skip", late_start) == 11 * HOUR


# --- on real servers ----------------------------------------------------------------------------
def _runs_of(key: str) -> list[tuple[int, int]]:
    return [(s, st) for k, s, st in schedule_tasks.runs() if k == key]


@pytest.mark.usefixtures("sampling")
def test_an_interval_schedule_runs_each_occurrence_once(
    redis_url: str, db_url: str, tmp_path: Path, start_listener: StartListener
) -> None:
    settings = make_settings(redis_url, db_url, tmp_path)
    start_listener(settings)
    start_listener(settings)
    with Client(settings) as client:
        sched = client.schedule("reports:eu", Report.build, "eu", every_s=1)
        key = sched.task_key
        wait_until(lambda: len(_runs_of(key)) >= 3, 15, message="three occurrences")
        runs = _runs_of(key)
        scheduled = [s for s, _ in runs]
        assert len(set(scheduled)) == len(scheduled), runs  # none twice
        first = sched.occurrence_ms
        assert first is not None
        assert scheduled[:3] == [first, first + 1000, first + 2000]
        assert all(0 <= started - s < 1000 for s, started in runs)
        got = client.get_schedule("reports:eu")
        assert got is not None and got.last_status == "done" and got.last_success_ms
        row = client.store.get(key)
        assert row is not None and row.schedule_name == "reports:eu"
        # Declared again the same: nothing changes; changed: the pending occurrence moves.
        again = client.schedule("reports:eu", Report.build, "eu", every_s=1)
        assert again.anchor_ms == sched.anchor_ms
        assert client.unschedule("reports:eu")
        wait_until(
            lambda: (r := client.store.get(key)) is not None and r.status is not TaskStatus.RUNNING,
            5,
        )
        after = len(_runs_of(key))
        assert client.get_schedule("reports:eu") is None
        row = client.store.get(key)
        assert row is not None and row.status in (TaskStatus.CANCELLED, TaskStatus.DONE)
    assert len(_runs_of(key)) == after


@pytest.mark.usefixtures("sampling")
def test_a_paused_schedule_catches_up_once_on_resume(
    redis_url: str, sqlite_url: str, tmp_path: Path, start_listener: StartListener
) -> None:
    settings = make_settings(redis_url, sqlite_url, tmp_path)
    start_listener(settings)
    with Client(settings) as client:
        sched = client.schedule("reports:us", Report.build, "us", every_s=1)
        key = sched.task_key
        wait_until(lambda: len(_runs_of(key)) >= 1, 10)
        assert client.pause_schedule("reports:us")
        paused_at = len(_runs_of(key))
        wait_until(lambda: client.clock.now_ms() > (sched.occurrence_ms or 0) + 3500, 10)
        assert len(_runs_of(key)) <= paused_at + 1  # one may have been running
        before = len(_runs_of(key))
        assert client.resume_schedule("reports:us")
        wait_until(lambda: len(_runs_of(key)) >= before + 1, 10)
        # catch_up="latest": the missed seconds ran once, standing for the latest of them.
        caught_up = _runs_of(key)[before]
        assert caught_up[1] - caught_up[0] < 1000
        assert client.unschedule("reports:us")


@pytest.mark.usefixtures("sampling")
def test_a_schedule_in_code_is_declared_once_by_two_listeners_and_runs_once_a_second(
    redis_url: str, db_url: str, tmp_path: Path, start_listener: StartListener
) -> None:
    settings = make_settings(redis_url, db_url, tmp_path)
    start_listener(settings, schedule_tasks.TICKS)
    start_listener(settings, schedule_tasks.TICKS)
    with Client(settings, registry=schedule_tasks.TICKS) as client:
        wait_until(lambda: len(_runs_of("Tick@beat")) >= 3, 15)
        (sched,) = client.schedules()
        assert (sched.name, sched.source) == ("Tick.beat", "code")
        scheduled = [s for s, _ in _runs_of("Tick@beat")]
        assert len(set(scheduled)) == len(scheduled)


@pytest.mark.usefixtures("sampling")
def test_run_now_is_an_extra_run_and_the_regular_occurrence_stays(
    redis_url: str, db_url: str, tmp_path: Path, start_listener: StartListener
) -> None:
    settings = make_settings(redis_url, db_url, tmp_path)
    start_listener(settings)
    with Client(settings) as client:
        sched = client.schedule("reports:apac", Report.build, "apac", every_s=3600)
        regular = sched.occurrence_ms
        assert client.run_schedule_now("reports:apac")
        wait_until(lambda: len(_runs_of(sched.task_key)) == 1, 10)
        wait_until(
            lambda: (
                (s := client.get_schedule("reports:apac")) is not None and s.last_status == "done"
            ),
            10,
        )
        after = client.get_schedule("reports:apac")
        assert after is not None and after.occurrence_ms == regular
        row = client.store.get(sched.task_key)
        assert row is not None and (row.status, row.due_at_ms) == (TaskStatus.PENDING, regular)
        assert client.unschedule("reports:apac")


def test_an_occurrence_cancelled_by_hand_is_put_back(
    redis_url: str, db_url: str, tmp_path: Path
) -> None:
    settings = make_settings(redis_url, db_url, tmp_path)
    with Client(settings) as client:
        sched = client.schedule("reports:latam", Report.build, "latam", every_s=3600)
        assert client.store.schedules_without_occurrence() == []
        assert client.cancel_keys([sched.task_key]) == [sched.task_key]
        (missing,) = client.store.schedules_without_occurrence()
        assert missing.name == "reports:latam"
        assert recurring.restore_missing(client.rt) == 1
        row = client.store.get(sched.task_key)
        assert row is not None and (row.status, row.due_at_ms) == (
            TaskStatus.PENDING,
            sched.occurrence_ms,
        )
        assert client.redis.exists(sched.task_key)
        assert client.pause_schedule("reports:latam")
        assert client.store.schedules_without_occurrence() == []  # paused: nothing missing
        assert client.unschedule("reports:latam")


def test_an_occurrence_that_dies_with_its_listener_moves_its_schedule_on(
    redis_url: str, db_url: str, tmp_path: Path
) -> None:
    """Out of attempts when its listener's lease ran out: dead, and the schedule's next
    occurrence created in the same transaction (not put back, run twice, by the check)."""
    settings = make_settings(redis_url, db_url, tmp_path)
    with Client(settings) as client:
        sched = client.schedule("chores", Report.build, "chores", every_s=1, retry_schedule_s=[])
        assert sched.occurrence_ms is not None
        key = sched.task_key
        wait_until(lambda: client.clock.now_ms() >= (sched.occurrence_ms or 0), 5)
        now_ms = client.clock.now_ms()
        (claimed,) = client.store.claim(
            [key], now_ms=now_ms, lease_until_ms=now_ms, token="ghost:1"
        )
        assert claimed.schedule_name == "chores"
        wait_until(lambda: client.clock.now_ms() > now_ms, 5)
        report = Reconciler(client.rt).requeue_expired_leases()
        assert report.dead == 1
        row = client.store.get(key)
        after = client.get_schedule("chores")
        assert after is not None and after.last_status == "dead"
        assert after.last_scheduled_for_ms == sched.occurrence_ms
        assert row is not None and row.status is TaskStatus.PENDING
        assert row.due_at_ms == after.occurrence_ms
        assert row.due_at_ms > sched.occurrence_ms and row.attempts == 0
        assert client.redis.exists(key)
        assert client.store.schedules_without_occurrence() == []
        assert client.unschedule("chores")


def test_a_pause_while_an_occurrence_runs_moves_the_schedule_on_when_it_ends(
    redis_url: str, db_url: str, tmp_path: Path
) -> None:
    """Paused mid-run, the run keeps its schedule: its end moves the schedule on (no row while
    paused), and the resume creates the next occurrence, not the one that ran."""
    settings = make_settings(redis_url, db_url, tmp_path)
    with Client(settings) as client:
        sched = client.schedule("chores:b", Report.build, "b", every_s=1)
        occurrence = sched.occurrence_ms
        assert occurrence is not None
        wait_until(lambda: client.clock.now_ms() >= occurrence, 5)
        now_ms = client.clock.now_ms()
        (row,) = client.store.claim(
            [sched.task_key], now_ms=now_ms, lease_until_ms=now_ms + 60_000, token="t:1"
        )
        assert client.pause_schedule("chores:b")
        assert client.store.get(sched.task_key).schedule_name == "chores:b"  # type: ignore[union-attr]
        done = Outcome(
            row.id, row.key, "t:1", TaskStatus.DONE, now_ms + 5, row.due_at_ms, None,
            occurrence=Occurrence("chores:b", occurrence, started_ms=now_ms),
        )  # fmt: skip
        rearm: list[tuple[str, int]] = []
        assert client.store.record([done], now_ms + 10, rearm) == 1
        assert rearm == []  # paused: no next row yet
        paused = client.get_schedule("chores:b")
        assert paused is not None and paused.occurrence_ms == occurrence + 1000
        assert client.resume_schedule("chores:b")
        after = client.store.get(sched.task_key)
        assert after is not None and (after.status, after.due_at_ms) == (
            TaskStatus.PENDING,
            occurrence + 1000,
        )
        assert client.unschedule("chores:b")
