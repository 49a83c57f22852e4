"""When a recurring schedule's occurrences fall (`Recurrence`): a cron expression or a fixed
interval, in an IANA time zone, between an optional start and end. Which occurrence a run stands
for, and which comes next, are `keyexpiry.schedules.rules`.

Cron expressions have 5 fields (no seconds field: a 6-field one is refused), with the usual
`@hourly`…`@yearly` forms, and follow Debian cron on daylight-saving changes (cron(8)): a
"wildcard" job, whose minute or hour field starts with `*` (`*/15 * * * *`, `0 */3 * * *`,
`* 1-6 * * *`), runs on the local clock as it is: in both passes of a repeated hour, not in a
skipped one. A fixed-time job (`30 2 * * *`) runs once in a repeated hour, at its first pass,
and a time that a spring-forward skips runs at the first instant after the gap (02:30 → 03:00).
"""

from __future__ import annotations

import copy
import datetime as dt
import functools
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from keyexpiry import limits
from keyexpiry.errors import ConfigError
from keyexpiry.keys import shorten

MIN_EVERY_S = 1.0
_ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
MIN_TIME_MS = 0
MAX_TIME_MS = 221_845_392_000_000
"""Times a schedule holds (its start, end, occurrences) fall in 1970 to 9000: walking on from
one of year 9999 would leave the calendar (OverflowError)."""


def _utc(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC)


def epoch_ms(when: dt.datetime) -> int:
    """`when` in epoch ms, floored."""
    return math.floor(when.timestamp() * 1000)


def check_cron(expression: object, field: str = "cron") -> str:
    """`expression` if it is a 5-field cron expression cronsim reads (aliases accepted);
    ConfigError in one line otherwise."""
    if not isinstance(expression, str):
        raise ConfigError(f"{field} must be a cron expression, got {shorten(repr(expression), 80)}")
    text = " ".join(expression.split())
    fields = len(_ALIASES.get(text, text).split())
    if fields != 5:
        # cronsim would take a leading seconds field; cron(8) has none, nor does our DST rule.
        raise ConfigError(
            f"{field} {shorten(repr(expression), 80)} is not a cron expression: it has "
            f"{fields} fields, a cron expression has 5 (minute hour day month weekday; "
            "no seconds field: every_s= runs more often than once a minute)"
        )
    try:
        _parsed_cron(_ALIASES.get(text, text))
    except (CronSimError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"{field} {shorten(repr(expression), 80)} is not a cron expression: {exc}"
        ) from None
    return text


ZONE_NAME_MAX_CHARS = 64
"""As long as the schedule table's `tz` column holds; the longest IANA name has 32."""
_ZONE_NAME = re.compile(r"[A-Za-z0-9_+-]+(?:/[A-Za-z0-9_+-]+)*")


def check_zone(name: object, field: str = "tz") -> str:
    """`name` if it is an IANA time zone this machine knows; ConfigError otherwise."""
    if (
        not isinstance(name, str)
        or len(name) > ZONE_NAME_MAX_CHARS
        or not _ZONE_NAME.fullmatch(name)
    ):
        raise ConfigError(
            f"{field} must be an IANA time zone name (e.g. 'Europe/Berlin', 'UTC'), got "
            f"{shorten(repr(name), 80)}"
        )
    try:
        _zone(name)
    # A directory of the zone database ('Europe') or a name the file system refuses is an
    # OSError, not ZoneInfoNotFoundError.
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ConfigError(
            f"{field} {shorten(repr(name), 80)} is no IANA time zone (e.g. 'Europe/Berlin', 'UTC')"
        ) from None
    return name


@functools.lru_cache(maxsize=512)
def _zone(name: str) -> ZoneInfo:
    return ZoneInfo(name)


@functools.lru_cache(maxsize=512)
def _parsed_cron(expression: str) -> CronSim:
    """A CronSim parsed once per expression, copied for each walk (`_walk_from`): parsing costs
    four times a step."""
    return CronSim(expression, dt.datetime(2025, 1, 1))


def _walk_from(expression: str, start: dt.datetime) -> CronSim:
    """Matches of `expression` after `start` in its own frame: wall time if naive, a fixed
    offset's time if aware (cronsim's own DST handling is bypassed: `_cron_times` does it)."""
    sim = copy.copy(_parsed_cron(expression))
    sim.dt = start.replace(microsecond=0)
    sim.fixup_tz = None
    return sim


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
        for field, ms in (("start", self.start_ms), ("end", self.end_ms)):
            if ms is not None and (
                isinstance(ms, bool)
                or not isinstance(ms, int)
                or not MIN_TIME_MS <= ms <= MAX_TIME_MS
            ):
                raise ConfigError(f"a schedule's {field} must fall in 1970 to 9000, got {ms!r}")
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
        return next(self.times(t_ms, anchor_ms), None)

    def times(self, t_ms: int, anchor_ms: int) -> Iterator[int]:
        """The occurrences strictly after `t_ms`, in order, up to the schedule's end: one walk,
        cheaper per occurrence than `after` called again for each."""
        if self.start_ms is not None and t_ms < self.start_ms:
            t_ms = self.start_ms - 1
        found = (
            _cron_times(self.cron, _zone(self.tz), t_ms)
            if self.cron is not None
            else self._every_times(t_ms, anchor_ms)
        )
        for when in found:
            if self.end_ms is not None and when > self.end_ms:
                return
            yield when

    def _every_times(self, t_ms: int, anchor_ms: int) -> Iterator[int]:
        assert self.every_s is not None
        every_ms = max(1, round(self.every_s * 1000))
        base = self.start_ms if self.start_ms is not None else anchor_ms
        when = base if t_ms < base else base + ((t_ms - base) // every_ms + 1) * every_ms
        while True:
            yield when
            when += every_ms


def _cron_times(expression: str, zone: ZoneInfo, t_ms: int) -> Iterator[int]:
    expression = _ALIASES.get(expression, expression)
    minute, hour = expression.split()[:2]
    if minute.startswith("*") or hour.startswith("*"):
        return _wildcard_times(expression, zone, t_ms)
    return _fixed_times(expression, zone, t_ms)


def _fixed_times(expression: str, zone: ZoneInfo, t_ms: int) -> Iterator[int]:
    """A fixed-time job: each matching wall time once, at its first pass (fold 0); one that a
    spring-forward skips, at the first instant after the gap (several: once)."""
    # In wall time, from the minute of t_ms; a time before t_ms (t_ms in a repeated hour's
    # second pass, the match at the first) is passed over.
    wall = _utc(t_ms).astimezone(zone).replace(tzinfo=None, second=0, microsecond=0)
    last = t_ms
    for match in _walk_from(expression, wall):
        when = match.replace(tzinfo=zone, fold=0)
        while _imaginary(when):
            when += dt.timedelta(minutes=1)
        ms = epoch_ms(when)
        if ms > last:
            last = ms
            yield ms


def _wildcard_times(expression: str, zone: ZoneInfo, t_ms: int) -> Iterator[int]:
    """A wildcard job: every instant whose local time matches, as the clock shows it (both
    passes of a repeated hour, none of a skipped one). Walked in the zone's offset of the
    moment, restarted where the offset changes: the matches of one offset are exact, and a
    change of 30 minutes is not stepped over (cronsim's own walk jumps a single-valued minute
    field in UTC, past a repeated :30 on Lord Howe Island)."""
    since = _utc(t_ms)
    restarted = False
    while True:
        offset = since.astimezone(zone).utcoffset()
        assert offset is not None
        fixed = dt.timezone(offset)
        # The first walk from the minute of t_ms; a walk after a change from its instant on.
        begin = (
            since.astimezone(fixed).replace(second=0, microsecond=0)
            if not restarted
            else since.astimezone(fixed) - dt.timedelta(seconds=1)
        )
        restarted = True
        for match in _walk_from(expression, begin):
            change = _offset_change(zone, offset, since, match)
            if change is not None:
                since = change
                break
            ms = epoch_ms(match)
            if ms > t_ms:
                yield ms
            since = match
        else:
            return


_CHANGES_APART = dt.timedelta(days=6)
"""Less than the time between two changes of a zone's offset since 1970 (the closest in tzdata
are 6.9 days apart: a week of summer time in Brazil in 2000, Gaza's Ramadan in 2040)."""


def _offset_change(
    zone: ZoneInfo, offset: dt.timedelta, after: dt.datetime, upto: dt.datetime
) -> dt.datetime | None:
    """The first instant in (`after`, `upto`] at which `zone`'s offset is no longer
    `offset`; None when it holds throughout."""
    if upto - after <= _CHANGES_APART:
        if upto.astimezone(zone).utcoffset() == offset:
            return None
        lo, hi = after, upto
    else:
        lo = after
        while True:
            hi = min(lo + _CHANGES_APART, upto)
            if hi.astimezone(zone).utcoffset() != offset:
                break
            if hi == upto:
                return None
            lo = hi
    # Offsets change on whole seconds: bisect to one.
    lo_s, hi_s = math.floor(lo.timestamp()), math.ceil(hi.timestamp())
    while hi_s - lo_s > 1:
        mid = (lo_s + hi_s) // 2
        if dt.datetime.fromtimestamp(mid, zone).utcoffset() == offset:
            lo_s = mid
        else:
            hi_s = mid
    return dt.datetime.fromtimestamp(hi_s, dt.UTC)


def _imaginary(when: dt.datetime) -> bool:
    """Whether aware local `when` is skipped by a spring-forward (it does not round-trip)."""
    return when.astimezone(dt.UTC).astimezone(when.tzinfo).replace(tzinfo=None) != when.replace(
        tzinfo=None
    )
