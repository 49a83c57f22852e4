"""Recurring schedules, as pure rules: which occurrence a run stands for after downtime
(`catch_up`), which comes next after a run (`overlap`), and a schedule's whole definition
(`Cadence`: its recurrence, name and those two). When occurrences fall (cron or interval, in a
zone, daylight-saving changes) is `keyexpiry.schedules.recurrence`.
"""

from __future__ import annotations

import bisect
import collections
import datetime as dt
import itertools
import threading
from dataclasses import dataclass

from keyexpiry.errors import ConfigError
from keyexpiry.keys import shorten
from keyexpiry.schedules.recurrence import Recurrence, check_choice, epoch_ms

CATCH_UP = ("latest", "all", "none")
"""After downtime: run once for the missed period (the latest occurrence), each missed one in
order (up to `catch_up_max`), or none (the next future one)."""
OVERLAP = ("skip", "wait")
"""A run still going when the next occurrence falls due: skip that one, or run it right after."""
CATCH_UP_MAX = 100
"""Missed occurrences `catch_up="all"` runs at most by default (the latest ones)."""
NAME_MAX_CHARS = 200
_SCAN_MAX = 100_000
"""Occurrences walked at most to find the ones missed (a minutely schedule down for 69 days)."""


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
    that is all of them. Each run of a backlog `catch_up="all"` works through asks again with
    `after_ms` and `now_ms` a little later: answered from the walk kept from the last ask,
    extended by the occurrences since, so a run costs the same with 10,000 missed as with one
    (walked afresh each time, the catch-up's cost grew with the square of its backlog)."""
    with _WALKS_LOCK:
        kept = _WALKS.pop((rec, anchor_ms, keep), None)
        answer = None
        if kept is not None and kept.extend(rec, now_ms, anchor_ms, keep):
            walk, answer = kept, kept.answer(after_ms)
        if answer is None:
            walk = _Walk.fresh(rec, after_ms, now_ms, anchor_ms, keep)
            # As its windows tell it: all of them when walked from `after_ms`, else the last
            # `keep` of at least `total`.
            answer = list(walk.times), walk.total, walk.from_ms == after_ms
        _WALKS[(rec, anchor_ms, keep)] = walk
        while len(_WALKS) > _WALKS_KEPT:
            del _WALKS[next(iter(_WALKS))]
        return answer


@dataclass(slots=True)
class _Walk:
    """The last `keep` (or fewer) of the `total` occurrences in (`from_ms`, `upto_ms`]."""

    from_ms: int
    upto_ms: int
    times: list[int]
    total: int

    @classmethod
    def fresh(cls, rec: Recurrence, after_ms: int, now_ms: int, anchor_ms: int, keep: int) -> _Walk:
        """Walked from a window before `now_ms` that grows (4 times, from a minute) until it
        holds `keep` or reaches `after_ms`: a schedule down for months costs a few windows'
        walk, never every occurrence since (a minutely cron down for a year: 525,600)."""
        span_ms = 60_000
        while True:
            start = max(after_ms, now_ms - span_ms)
            found: collections.deque[int] = collections.deque(maxlen=keep)
            count = 0
            for nxt in itertools.islice(rec.times(start, anchor_ms), _SCAN_MAX):
                if nxt > now_ms:
                    break
                found.append(nxt)
                count += 1
            if len(found) >= keep or start == after_ms:
                return cls(start, now_ms, list(found), count)
            span_ms *= 4

    def extend(self, rec: Recurrence, now_ms: int, anchor_ms: int, keep: int) -> bool:
        """Brought up to `now_ms`; False when that is not worth it (or time went back)."""
        if now_ms < self.upto_ms or self.upto_ms < self.from_ms:
            return False  # time went back, or asked before its start: walked afresh
        added = 0
        for nxt in rec.times(self.upto_ms, anchor_ms):
            if nxt > now_ms:
                break
            added += 1
            if added > keep + _EXTEND_MAX:
                return False  # long unasked: a fresh walk's windows cost less
            self.times.append(nxt)
        self.total += added
        self.upto_ms = now_ms
        del self.times[: max(0, len(self.times) - keep)]
        return True

    def answer(self, after_ms: int) -> tuple[list[int], int, bool] | None:
        """`_recent`'s answer for `after_ms`, None when this walk cannot tell it."""
        if after_ms == self.from_ms:
            # Walked from `after_ms` itself: every one counted was missed (the count in full,
            # as a fresh walk tells it, not only the `keep` held).
            return list(self.times), self.total, True
        if after_ms < self.from_ms:
            # Missed before the walk's start too: how many a fresh walk tells by its windows
            # (`Plan.missed` stays what it was); a backlog's later runs ask from within.
            return None
        first = bisect.bisect_right(self.times, after_ms)
        if first == 0 and self.total > len(self.times):
            # Some of the dropped ones may lie after `after_ms`: counted by a fresh walk.
            return None
        recent = self.times[first:]
        return recent, len(recent), True


_WALKS: dict[tuple[Recurrence, int, int], _Walk] = {}
_WALKS_LOCK = threading.Lock()
_WALKS_KEPT = 32
_EXTEND_MAX = 1000


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
    return epoch_ms(value)


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
