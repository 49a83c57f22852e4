"""Recurring schedules, as pure rules: when occurrences fall (a cron expression or a fixed
interval, in an IANA time zone, between an optional start and end), which occurrence a run
stands for after downtime (`catch_up`), and which comes next after a run (`overlap`).

Cron expressions are read by cronsim (5 fields, Debian cron's semantics, including its handling
of daylight-saving changes), with the usual `@hourly`…`@yearly` forms. A local time that a
spring-forward skips runs at the first instant after the gap (02:30 → 03:00); one that a
fall-back repeats runs once, at its first pass, unless the hour field is `*` (then the
expression is a real-time interval, "every 15 minutes", and runs in both passes, as cron does).
"""

from __future__ import annotations

import collections
import datetime as dt
import math
from dataclasses import dataclass
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from keyexpiry import limits
from keyexpiry.errors import ConfigError
from keyexpiry.keys import shorten

CATCH_UP = ("latest", "all", "none")
"""After downtime: run once for the missed period (the latest occurrence), each missed one in
order (up to `catch_up_max`), or none (the next future one)."""
OVERLAP = ("skip", "wait")
"""A run still going when the next occurrence falls due: skip that one, or run it right after."""
CATCH_UP_MAX = 100
"""Missed occurrences `catch_up="all"` runs at most by default (the latest ones)."""
MIN_EVERY_S = 1.0
NAME_MAX_CHARS = 200
_ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_SCAN_MAX = 100_000
"""Occurrences walked at most to find the ones missed (a minutely schedule down for 69 days)."""


def _utc(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC)


def _ms(when: dt.datetime) -> int:
    return math.floor(when.timestamp() * 1000)


def check_cron(expression: object, field: str = "cron") -> str:
    """`expression` if cronsim reads it (aliases accepted); ConfigError in one line otherwise."""
    if not isinstance(expression, str):
        raise ConfigError(f"{field} must be a cron expression, got {shorten(repr(expression), 80)}")
    text = " ".join(expression.split())
    try:
        CronSim(_ALIASES.get(text, text), dt.datetime(2025, 1, 1, tzinfo=dt.UTC))
    except (CronSimError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"{field} {shorten(repr(expression), 80)} is not a cron expression: {exc}"
        ) from None
    return text


def check_zone(name: object, field: str = "tz") -> str:
    """`name` if it is an IANA time zone this machine knows; ConfigError otherwise."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{field} must be an IANA time zone name, got {shorten(repr(name), 80)}")
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ConfigError(
            f"{field} {shorten(repr(name), 80)} is no IANA time zone (e.g. 'Europe/Berlin', 'UTC')"
        ) from None
    return name


def check_choice(value: object, choices: tuple[str, ...], field: str) -> str:
    if value not in choices:
        raise ConfigError(
            f"{field} must be one of {', '.join(choices)}, got {shorten(repr(value), 80)}"
        )
    return str(value)


@dataclass(frozen=True, slots=True)
class Recurrence:
    """When occurrences fall: `cron` in `tz`, or every `every_s` seconds from `start_ms` (the
    declaration's time when none), never before `start_ms` nor after `end_ms`."""

    cron: str | None = None
    every_s: float | None = None
    tz: str = "UTC"
    start_ms: int | None = None
    end_ms: int | None = None

    def __post_init__(self) -> None:
        if (self.cron is None) == (self.every_s is None):
            raise ConfigError("a schedule needs either cron= or every_s= (one of them)")
        if self.cron is not None:
            object.__setattr__(self, "cron", check_cron(self.cron))
        if self.every_s is not None:
            limits.number(
                self.every_s, "every_s", low=MIN_EVERY_S, high=limits.MAX_DELAY_S, error=ConfigError
            )
            # Whole milliseconds, as stored: a declaration read back compares equal.
            object.__setattr__(self, "every_s", round(self.every_s * 1000) / 1000)
        check_zone(self.tz)
        if self.start_ms is not None and self.end_ms is not None and self.end_ms <= self.start_ms:
            raise ConfigError("a schedule's end must come after its start")

    def describe(self) -> str:
        """`0 9 * * 1-5 Europe/Berlin` or `every 900 s`, for listings."""
        if self.cron is not None:
            return f"{self.cron} ({self.tz})"
        assert self.every_s is not None
        return f"every {self.every_s:g} s"

    def after(self, t_ms: int, anchor_ms: int) -> int | None:
        """The first occurrence strictly after `t_ms`; None when the schedule has ended.
        `anchor_ms` is where an interval counts from when the schedule has no start."""
        if self.start_ms is not None and t_ms < self.start_ms:
            t_ms = self.start_ms - 1
        found = (
            self._cron_after(t_ms) if self.cron is not None else self._every_after(t_ms, anchor_ms)
        )
        if found is None or (self.end_ms is not None and found > self.end_ms):
            return None
        return found

    def _every_after(self, t_ms: int, anchor_ms: int) -> int:
        assert self.every_s is not None
        every_ms = max(1, round(self.every_s * 1000))
        base = self.start_ms if self.start_ms is not None else anchor_ms
        if t_ms < base:
            return base
        return base + ((t_ms - base) // every_ms + 1) * every_ms

    def _cron_after(self, t_ms: int) -> int | None:
        assert self.cron is not None
        zone = ZoneInfo(self.tz)
        expression = _ALIASES.get(self.cron, self.cron)
        every_hour = expression.split()[1] == "*"
        # cronsim steps in whole minutes from the given time: start from the minute of t_ms.
        start = _utc(t_ms).astimezone(zone).replace(second=0, microsecond=0)
        for when in CronSim(expression, start):
            if _ms(when) <= t_ms:
                continue
            if when.fold and not every_hour and _matches_first_pass(expression, when):
                continue  # the repeated hour of a fall-back: ran at its first pass
            return _ms(when)
        return None


def _matches_first_pass(expression: str, when: dt.datetime) -> bool:
    """Whether the wall time of `when` (in a fall-back's second pass) matched at the first."""
    first = when.replace(fold=0)
    probe = CronSim(expression, first - dt.timedelta(minutes=1))
    return next(probe).replace(tzinfo=None) == first.replace(tzinfo=None)


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do with a due occurrence: run it (standing for `scheduled_for_ms`), or skip it;
    `missed` occurrences fell due after it before now (downtime, a pause, a long retry)."""

    run: bool
    scheduled_for_ms: int
    missed: int
    """How many were found missed: all of them, or (after long downtime) at least these."""


def plan_run(
    rec: Recurrence,
    occurrence_ms: int,
    now_ms: int,
    anchor_ms: int,
    catch_up: str,
    catch_up_max: int = CATCH_UP_MAX,
) -> Plan:
    """Which occurrence a run due at `occurrence_ms` and starting at `now_ms` stands for:
    with no occurrence missed, that one; else per `catch_up` (latest: the last missed one; all:
    this one, unless more than `catch_up_max` were missed, then the oldest of the last ones;
    none: skip, the schedule moves on to the next future occurrence)."""
    keep = max(1, catch_up_max) if catch_up == "all" else 1
    recent, missed, complete = _recent(rec, occurrence_ms, now_ms, anchor_ms, keep)
    if not recent:
        return Plan(True, occurrence_ms, 0)
    if catch_up == "none":
        return Plan(False, recent[-1], missed)
    if catch_up == "latest":
        return Plan(True, recent[-1], missed)
    everything = [occurrence_ms, *recent] if complete else recent
    return Plan(True, everything[-keep:][0], missed)


def _recent(
    rec: Recurrence, after_ms: int, now_ms: int, anchor_ms: int, keep: int
) -> tuple[list[int], int, bool]:
    """The last `keep` occurrences in (`after_ms`, `now_ms`], how many were found, and whether
    that is all of them. Walked from a window before `now_ms` that grows (4 times, from a minute)
    until it holds `keep` or reaches `after_ms`: a schedule down for months costs a few
    windows' walk, never every occurrence since (a minutely cron down for a year: 525,600)."""
    span_ms = 60_000
    while True:
        start = max(after_ms, now_ms - span_ms)
        found: collections.deque[int] = collections.deque(maxlen=keep)
        count, t = 0, start
        for _ in range(_SCAN_MAX):
            nxt = rec.after(t, anchor_ms)
            if nxt is None or nxt > now_ms:
                break
            found.append(nxt)
            count += 1
            t = nxt
        if len(found) >= keep or start == after_ms:
            # From a window that began after `after_ms`, more were missed before it.
            return list(found), count, start == after_ms
        span_ms *= 4


def next_after_run(
    rec: Recurrence,
    scheduled_for_ms: int,
    now_ms: int,
    anchor_ms: int,
    overlap: str,
    started_ms: int | None = None,
) -> int | None:
    """The occurrence to create when the run standing for `scheduled_for_ms`, started at
    `started_ms`, has ended at `now_ms`: the next one. If that fell due while the run went on,
    per `overlap` (skip: the next future one; wait: that one, at once); if it was due before
    the run even started (a backlog `catch_up="all"` works through), that one, whose own
    start applies the catch-up policy. None when the schedule has ended."""
    nxt = rec.after(scheduled_for_ms, anchor_ms)
    if nxt is None or nxt > now_ms or overlap == "wait":
        return nxt
    if started_ms is not None and nxt <= started_ms:
        return nxt
    return rec.after(now_ms, anchor_ms)


def check_name(name: object) -> str:
    """A schedule's name: printable text without spaces, up to NAME_MAX_CHARS."""
    if (
        not isinstance(name, str)
        or not name
        or len(name) > NAME_MAX_CHARS
        or not name.isprintable()
        or any(c.isspace() for c in name)
    ):
        raise ConfigError(
            f"a schedule's name must be 1 to {NAME_MAX_CHARS} printable characters without "
            f"spaces, got {shorten(repr(name), 80)}"
        )
    return name


@dataclass(frozen=True, slots=True)
class Cadence:
    """A schedule's timing and policies, as declared (`@exposed(cron=…)`, `Client.schedule`)."""

    recurrence: Recurrence
    catch_up: str = "latest"
    catch_up_max: int = CATCH_UP_MAX
    overlap: str = "skip"

    def __post_init__(self) -> None:
        check_choice(self.catch_up, CATCH_UP, "catch_up")
        check_choice(self.overlap, OVERLAP, "overlap")
        if isinstance(self.catch_up_max, bool) or not isinstance(self.catch_up_max, int):
            raise ConfigError(f"catch_up_max must be a whole number, got {self.catch_up_max!r}")
        if not 1 <= self.catch_up_max <= 10_000:
            raise ConfigError(f"catch_up_max must be from 1 to 10000, got {self.catch_up_max}")


def _when_ms(value: dt.datetime | None, field: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, dt.datetime) or value.tzinfo is None:
        raise ConfigError(f"{field} must be a timezone-aware datetime, got {value!r}")
    return _ms(value)


def cadence(
    *,
    cron: str | None = None,
    every_s: float | None = None,
    tz: str = "UTC",
    start: dt.datetime | None = None,
    end: dt.datetime | None = None,
    catch_up: str = "latest",
    catch_up_max: int = CATCH_UP_MAX,
    overlap: str = "skip",
) -> Cadence:
    """A checked `Cadence` from the keyword arguments `@exposed` and `Client.schedule` take;
    ConfigError in one line for anything wrong."""
    return Cadence(
        Recurrence(
            cron=cron,
            every_s=None if every_s is None else float(every_s),
            tz=tz,
            start_ms=_when_ms(start, "start"),
            end_ms=_when_ms(end, "end"),
        ),
        catch_up,
        catch_up_max,
        overlap,
    )
