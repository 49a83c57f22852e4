"""Recurring schedules: occurrences by cron in time zones (both daylight-saving changes of
Europe/Berlin and America/New_York, a half-hour zone) and by interval; catch-up and overlap
policies (pure); and on real Redis and ledgers, occurrences run once each, declared twice they
stay one, changed they move, paused they catch up, removed they stop."""

from __future__ import annotations

import datetime as dt
import itertools
import random
import time
from collections.abc import Callable
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from keyexpiry import Client, ConfigError, exposed
from keyexpiry.bench.servers import wait_until
from keyexpiry.ledger.rows import Occurrence, Outcome
from keyexpiry.ledger.store import TaskStatus
from keyexpiry.listener.reconcile import Reconciler
from keyexpiry.registry import Registry
from keyexpiry.schedules import operate as recurring
from keyexpiry.schedules import rules as schedules
from keyexpiry.schedules.recurrence import Recurrence
from keyexpiry.schedules.rules import Plan, next_after_run, plan_run
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


def test_an_hour_repeated_by_a_fall_back_runs_once_for_a_fixed_time_twice_for_a_wildcard() -> None:
    zone = "Europe/Berlin"
    fixed = _walk(Recurrence(cron="0,30 1-3 * * *", tz=zone), _ms("2025-10-26T00:00", zone), 6)
    assert fixed == [
        "2025-10-26T01:00:00+02:00",
        "2025-10-26T01:30:00+02:00",
        "2025-10-26T02:00:00+02:00",
        "2025-10-26T02:30:00+02:00",
        "2025-10-26T03:00:00+01:00",  # 02:00 and 02:30 of the second pass did run: skipped
        "2025-10-26T03:30:00+01:00",
    ]
    # A minute or hour field starting with `*` (cron's MIN_STAR/HR_STAR): a wildcard job, run
    # on the clock as it shows, in both passes (`*/30 1-3`, `*/30 *`, `0 */3`, `* 1-6` alike).
    for cron in ("*/30 1-3 * * *", "*/30 * * * *"):
        every = _walk(Recurrence(cron=cron, tz=zone), _ms("2025-10-26T01:45", zone), 4)
        assert every == [
            "2025-10-26T02:00:00+02:00",
            "2025-10-26T02:30:00+02:00",
            "2025-10-26T02:00:00+01:00",
            "2025-10-26T02:30:00+01:00",
        ]


# Debian cron's rules (cron(8): "Only jobs that run at a particular time (not specified as
# @hourly, nor with '*' in the hour or minute specifier) are affected"), as cronsim's own suite
# checks them against Debian cron: cuu508/cronsim tests/test_cronsim.py, TestDstTransitions,
# Europe/Riga 2021 (spring forward 03:00 -> 04:00 on 28 March, fall back 04:00 -> 03:00 on
# 31 October). (cron, start, the occurrences after it.)
RIGA_2021 = [
    ("0 * * * *", "2021-03-28T01:30", ["2021-03-28T02:00:00+02:00", "2021-03-28T04:00:00+03:00"]),
    ("0 * * * *", "2021-10-31T01:30", ["2021-10-31T02:00:00+03:00", "2021-10-31T03:00:00+03:00",
                                       "2021-10-31T03:00:00+02:00", "2021-10-31T04:00:00+02:00"]),
    ("*/30 * * * *", "2021-03-28T02:10", ["2021-03-28T02:30:00+02:00",
                                          "2021-03-28T04:00:00+03:00",
                                          "2021-03-28T04:30:00+03:00"]),
    ("*/30 * * * *", "2021-10-31T02:10", ["2021-10-31T02:30:00+03:00",
                                          "2021-10-31T03:00:00+03:00",
                                          "2021-10-31T03:30:00+03:00",
                                          "2021-10-31T03:00:00+02:00",
                                          "2021-10-31T03:30:00+02:00",
                                          "2021-10-31T04:00:00+02:00"]),
    ("0 */2 * * *", "2021-03-28T01:30", ["2021-03-28T02:00:00+02:00", "2021-03-28T04:00:00+03:00",
                                         "2021-03-28T06:00:00+03:00"]),
    ("0 */2 * * *", "2021-10-31T01:30", ["2021-10-31T02:00:00+03:00", "2021-10-31T04:00:00+02:00",
                                         "2021-10-31T06:00:00+02:00"]),
    ("30 */2 * * *", "2021-10-31T01:30", ["2021-10-31T02:30:00+03:00",
                                          "2021-10-31T04:30:00+02:00"]),
    ("0 */3 * * *", "2021-10-31T01:30", ["2021-10-31T03:00:00+03:00", "2021-10-31T03:00:00+02:00",
                                         "2021-10-31T06:00:00+02:00"]),
    ("0 1,2,3,4,5 * * *", "2021-03-28T01:30", ["2021-03-28T02:00:00+02:00",
                                               "2021-03-28T04:00:00+03:00",
                                               "2021-03-28T05:00:00+03:00"]),
    ("0 1,2,3,4,5 * * *", "2021-10-31T01:30", ["2021-10-31T02:00:00+03:00",
                                               "2021-10-31T03:00:00+03:00",
                                               "2021-10-31T04:00:00+02:00"]),
    ("30 1,2,3,4,5 * * *", "2021-03-28T01:30", ["2021-03-28T02:30:00+02:00",
                                                "2021-03-28T04:00:00+03:00",
                                                "2021-03-28T04:30:00+03:00"]),
    ("30 1,2,3,4,5 * * *", "2021-10-31T01:30", ["2021-10-31T02:30:00+03:00",
                                                "2021-10-31T03:30:00+03:00",
                                                "2021-10-31T04:30:00+02:00"]),
    ("0 2 * * *", "2021-10-31T01:30", ["2021-10-31T02:00:00+03:00", "2021-11-01T02:00:00+02:00"]),
    ("0 3 * * *", "2021-03-27T01:30", ["2021-03-27T03:00:00+02:00", "2021-03-28T04:00:00+03:00",
                                       "2021-03-29T03:00:00+03:00"]),
    ("0 3 * * *", "2021-10-31T01:30", ["2021-10-31T03:00:00+03:00", "2021-11-01T03:00:00+02:00"]),
    ("0 4 * * *", "2021-10-30T01:30", ["2021-10-30T04:00:00+03:00", "2021-10-31T04:00:00+02:00",
                                       "2021-11-01T04:00:00+02:00"]),
    ("0 1-5 * * *", "2021-10-31T01:30", ["2021-10-31T02:00:00+03:00", "2021-10-31T03:00:00+03:00",
                                         "2021-10-31T04:00:00+02:00"]),
    ("15 3 * * *", "2021-03-27T00:00", ["2021-03-27T03:15:00+02:00", "2021-03-28T04:00:00+03:00",
                                        "2021-03-29T03:15:00+03:00"]),
    ("15 3 * * *", "2021-10-30T00:00", ["2021-10-30T03:15:00+03:00", "2021-10-31T03:15:00+03:00",
                                        "2021-11-01T03:15:00+02:00"]),
    ("* * * * *", "2021-03-28T02:58", ["2021-03-28T02:59:00+02:00", "2021-03-28T04:00:00+03:00"]),
    ("* * * * *", "2021-10-31T03:58", ["2021-10-31T03:59:00+03:00", "2021-10-31T03:00:00+02:00",
                                       "2021-10-31T03:01:00+02:00"]),
    ("* 1-6 * * *", "2021-03-28T02:58", ["2021-03-28T02:59:00+02:00",
                                         "2021-03-28T04:00:00+03:00"]),
    ("* 1-6 * * *", "2021-10-31T03:58", ["2021-10-31T03:59:00+03:00",
                                         "2021-10-31T03:00:00+02:00",
                                         "2021-10-31T03:01:00+02:00"]),
]  # fmt: skip


@pytest.mark.parametrize(("cron", "start", "expected"), RIGA_2021)
def test_daylight_saving_changes_follow_debian_cron_as_cronsims_suite_checks(
    cron: str, start: str, expected: list[str]
) -> None:
    rec = Recurrence(cron=cron, tz="Europe/Riga")
    assert _walk(rec, _ms(start, "Europe/Riga"), len(expected)) == expected


@pytest.mark.parametrize(
    ("zone", "cron", "start", "expected"),
    [
        # Wildcard jobs in the repeated hour of a fall-back: both passes (the issue's cases).
        ("America/New_York", "*/30 1 * * *", "2025-11-02T00:45", [
            "2025-11-02T01:00:00-04:00", "2025-11-02T01:30:00-04:00",
            "2025-11-02T01:00:00-05:00", "2025-11-02T01:30:00-05:00",
            "2025-11-03T01:00:00-05:00",
        ]),
        ("America/New_York", "* 1-6 * * *", "2025-11-02T01:58", [
            "2025-11-02T01:59:00-04:00", "2025-11-02T01:00:00-05:00", "2025-11-02T01:01:00-05:00",
        ]),
        ("Europe/Riga", "0 */3 * * *", "2025-10-26T01:30", [
            "2025-10-26T03:00:00+03:00", "2025-10-26T03:00:00+02:00", "2025-10-26T06:00:00+02:00",
        ]),
        # A fixed time in it: once, at the first pass.
        ("America/New_York", "30 1 * * *", "2025-11-02T00:45", [
            "2025-11-02T01:30:00-04:00", "2025-11-03T01:30:00-05:00",
        ]),
        # Lord Howe Island changes by 30 minutes (+11 -> +10:30 at 02:00 on 6 April 2025):
        # 01:30-02:00 comes twice; `30 *` is a wildcard job and runs in both.
        ("Australia/Lord_Howe", "30 * * * *", "2025-04-06T01:59", [
            "2025-04-06T01:30:00+10:30", "2025-04-06T02:30:00+10:30",
        ]),
        ("Australia/Lord_Howe", "30 * * * *", "2025-04-06T00:45", [
            "2025-04-06T01:30:00+11:00", "2025-04-06T01:30:00+10:30",
            "2025-04-06T02:30:00+10:30",
        ]),
        ("Australia/Lord_Howe", "30 1 * * *", "2025-04-06T00:45", [
            "2025-04-06T01:30:00+11:00", "2025-04-07T01:30:00+10:30",
        ]),
        # Its spring forward (02:00 -> 02:30 on 5 October): a fixed 02:15 runs at 02:30, a
        # wildcard job's 02:15 does not happen.
        ("Australia/Lord_Howe", "15 2 * * *", "2025-10-05T01:00", [
            "2025-10-05T02:30:00+11:00", "2025-10-06T02:15:00+11:00",
        ]),
        ("Australia/Lord_Howe", "15 * * * *", "2025-10-05T01:00", [
            "2025-10-05T01:15:00+10:30", "2025-10-05T03:15:00+11:00",
        ]),
    ],
)  # fmt: skip
def test_daylight_saving_changes_of_the_issue_and_a_half_hour_change(
    zone: str, cron: str, start: str, expected: list[str]
) -> None:
    assert _walk(Recurrence(cron=cron, tz=zone), _ms(start, zone), len(expected)) == expected


def test_a_change_and_its_undoing_within_a_week_are_both_seen() -> None:
    """Recife kept summer time for one week in 2000 (-03 -> -02 on 8 October, back on the
    15th): the walk from a match before it to the next after it, under 7 days, must not take
    the offset at both ends as the offset throughout (14 October 23:00 comes twice)."""
    zone = "America/Recife"
    since = int(dt.datetime(2000, 10, 8, 2, 30, tzinfo=dt.UTC).timestamp() * 1000)
    assert _walk(Recurrence(cron="0 23 * * *", tz=zone), since, 2) == [
        "2000-10-08T23:00:00-02:00",
        "2000-10-09T23:00:00-02:00",
    ]
    assert _walk(Recurrence(cron="*/30 23 14 10 *", tz=zone), since, 4) == [
        "2000-10-14T23:00:00-02:00",
        "2000-10-14T23:30:00-02:00",
        "2000-10-14T23:00:00-03:00",
        "2000-10-14T23:30:00-03:00",
    ]


def _field_matches(field: str, value: int) -> bool:
    """A minute or hour field, read independently of cronsim (numbers, ranges, lists, steps)."""
    for part in field.split(","):
        spec, _, step = part.partition("/")
        if spec == "*":
            first, last = 0, 59
        elif "-" in spec:
            first, last = map(int, spec.split("-"))
        else:
            first = last = int(spec)
        if first <= value <= last and (value - first) % int(step or 1) == 0:
            return True
    return False


def _reference(cron: str, zone: str, since: dt.datetime, hours: int) -> list[str]:
    """cron(8)'s rule minute by minute, from scratch: a wildcard job runs at each real minute
    whose local time matches; a fixed-time job once per matching local time, at its first
    pass, or at the first real minute after a gap that skips it."""
    minute, hour = cron.split()[:2]
    tz = ZoneInfo(zone)
    found: list[dt.datetime] = []
    if minute.startswith("*") or hour.startswith("*"):
        for step in range(1, hours * 60 + 1):
            local = (since + dt.timedelta(minutes=step)).astimezone(tz)
            if _field_matches(minute, local.minute) and _field_matches(hour, local.hour):
                found.append(local)
        return [f.isoformat() for f in found]
    wall = since.astimezone(tz).replace(tzinfo=None)
    for step in range(-180, hours * 60 + 180):  # local times, the repeated ones once
        local = wall + dt.timedelta(minutes=step)
        if not (_field_matches(minute, local.minute) and _field_matches(hour, local.hour)):
            continue
        when = local.replace(tzinfo=tz, fold=0)
        while when.astimezone(dt.UTC).astimezone(tz).replace(tzinfo=None) != when.replace(
            tzinfo=None
        ):
            when += dt.timedelta(minutes=1)  # skipped by a spring forward: after the gap
        if since < when <= since + dt.timedelta(hours=hours) and when not in found:
            found.append(when)
    return [f.astimezone(tz).isoformat() for f in sorted(found)]


@pytest.mark.parametrize(
    ("zone", "spring", "fall"),
    [
        ("Europe/Riga", "2025-03-30T00:00", "2025-10-26T00:00"),
        ("America/New_York", "2025-03-09T00:00", "2025-11-02T00:00"),
        ("Australia/Lord_Howe", "2025-10-04T23:00", "2025-04-05T23:00"),
        ("Antarctica/Troll", "2025-03-30T00:00", "2025-10-26T00:00"),  # changes by 2 hours
    ],
)
@pytest.mark.parametrize(
    "cron",
    ["* * * * *", "*/7 * * * *", "30 * * * *", "0 */3 * * *", "*/30 1-3 * * *", "* 2 * * *",
     "15,45 1,2,3 * * *", "30 2 * * *", "0 1-4 * * *", "*/20 0-5 * * *"],
)  # fmt: skip
def test_every_occurrence_around_both_changes_is_cron_8s_rule_minute_by_minute(
    zone: str, spring: str, fall: str, cron: str
) -> None:
    for night in (spring, fall):
        since = dt.datetime.fromisoformat(night).replace(tzinfo=ZoneInfo(zone)).astimezone(dt.UTC)
        expected = _reference(cron, zone, since, 6)
        rec = Recurrence(cron=cron, tz=zone)
        since_ms = int(since.timestamp() * 1000)
        until_ms = since_ms + 6 * HOUR
        got = []
        for t in rec.times(since_ms, since_ms):
            if t > until_ms:
                break
            got.append(_local(t, zone))
        assert got == expected, (cron, zone, night)


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


def test_a_catch_up_of_all_works_through_a_backlog_at_a_cost_per_run_not_per_missed() -> None:
    """A minutely cron paused for 7 days, catch_up="all" up to 10,000: each run of the
    backlog plans again (`plan_run`) and moves on (`next_after_run`), as the executor and the
    recorder do. Walking the missed ones afresh for each run cost 0.3 s a run (48 minutes of a
    core for the backlog, more than a minute's worth per minute with a longer one)."""
    minutely = Recurrence(cron="* * * * *", tz="Europe/Berlin")
    occurrence, now = 0, 7 * 24 * HOUR + 1
    started = time.process_time()
    ran: list[int] = []
    while occurrence <= now and len(ran) < 3000:
        plan = plan_run(minutely, occurrence, now, 0, "all", catch_up_max=10_000)
        assert plan.run
        ran.append(plan.scheduled_for_ms)
        nxt = next_after_run(minutely, plan.scheduled_for_ms, now + 5, 0, "skip", now)
        assert nxt is not None
        occurrence, now = nxt, now + 20  # 20 ms a run: the clock moves on as it is worked
        assert time.process_time() - started < 10, f"{len(ran)} runs in 10 s of CPU"
    # The last 10,000 of the 10,080 missed, in order, each once.
    assert ran[0] == (7 * 24 * 60 - 10_000 + 1) * 60_000
    assert ran == sorted(set(ran)) and len(ran) == 3000
    assert all(b - a == 60_000 for a, b in itertools.pairwise(ran))


@pytest.mark.parametrize("catch_up", ["all", "latest", "none"])
def test_a_plan_from_the_kept_walk_is_the_plan_walked_afresh(catch_up: str) -> None:
    rng = random.Random(7)
    for rec in (Recurrence(cron="*/7 * * * *", tz="Europe/Riga"), Recurrence(every_s=60)):
        occurrence, now = 1_700_000_000_000, 1_700_000_000_000 + 5 * HOUR
        for _ in range(200):
            kept = plan_run(rec, occurrence, now, 0, catch_up, catch_up_max=30)
            schedules._WALKS.clear()
            fresh = plan_run(rec, occurrence, now, 0, catch_up, catch_up_max=30)
            # The same plan, down to how many were missed (a kept walk only saves the cost).
            assert fresh == kept
            nxt = rec.after(kept.scheduled_for_ms, 0)
            assert nxt is not None
            occurrence = nxt if rng.random() < 0.8 else occurrence + rng.randint(0, HOUR)
            now += rng.randint(0, 600_000)


def test_missed_counts_every_one_missed_when_the_walk_reaches_the_due_occurrence() -> None:
    """59 missed in the minute after the due one: all counted, as before walks were kept (not
    `catch_up_max` of them), asked afresh or again from the kept walk."""
    rec = Recurrence(every_s=1)
    for catch_up in ("none", "latest", "all"):
        for _ in range(2):
            plan = plan_run(rec, 1_000_000, 1_059_000, 0, catch_up, catch_up_max=3)
            assert (plan.missed, plan.run) == (59, catch_up != "none")


def test_a_cron_with_a_seconds_field_is_refused() -> None:
    for cron in ("* * * * * *", "*/5 * * * * *", "0 0 9 * * 1-5"):
        with pytest.raises(ConfigError, match="has 6 fields, a cron expression has 5") as err:
            Recurrence(cron=cron)
        assert "every_s=" in str(err.value)


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
        report = Reconciler.of(client.rt).requeue_expired_leases()
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
