"""Declaring and operating recurring schedules on a runtime: `Client.schedule()` and its
siblings (`ScheduleCalls`, which `Client` inherits), what a listener does for the
`@exposed(cron=…)` methods it registers, and putting back an occurrence row that went missing.
The rules are `keyexpiry.schedules.rules`; the rows, `keyexpiry.ledger.recurring`."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Sequence

import redis
from loguru import logger
from redis import Redis

from keyexpiry import limits
from keyexpiry.clock import iso_ms
from keyexpiry.creates import Target
from keyexpiry.errors import ConfigError, RedisUnavailableError, StoreError
from keyexpiry.keys import format_key
from keyexpiry.ledger.recurring import Declared, ScheduleRow
from keyexpiry.ledger.store import Store
from keyexpiry.registry import TaskSpec
from keyexpiry.runtime import Runtime
from keyexpiry.schedules.rules import CATCH_UP_MAX, Cadence, cadence, check_name


def declare(
    rt: Runtime,
    name: str,
    spec: TaskSpec,
    args: Sequence[object],
    cad: Cadence,
    *,
    retry_schedule_s: Sequence[float] | None = None,
    source: str = "api",
) -> Declared:
    """Create or update schedule `name` (see `RecurringQueries.declare_schedule`) and arm its
    occurrence's key. ConfigError when another schedule already runs the same task."""
    check_name(name)
    encoded = spec.encode_args(args)
    key = format_key(spec.class_name, spec.method, encoded, prefix=rt.settings.key_prefix)
    now_ms = rt.clock.now_ms()
    end_ms = cad.recurrence.end_ms
    if end_ms is not None and end_ms <= now_ms:
        # Kept (it lists as ended), but said: most likely a mistake.
        logger.warning("schedule {!r}: its end is in the past; it will not run", name)
    wanted = ScheduleRow(
        name=name,
        task_key=key,
        class_name=spec.class_name,
        method=spec.method,
        args=encoded,
        recurrence=cad.recurrence,
        anchor_ms=now_ms,
        catch_up=cad.catch_up,
        catch_up_max=cad.catch_up_max,
        overlap=cad.overlap,
        retry_schedule_s=limits.delays(retry_schedule_s, "retry_schedule_s", ConfigError),
        source=source,
    )
    try:
        declared = rt.store.declare_schedule(wanted, now_ms)
    except StoreError as exc:
        if "uq_keyexpiry_schedule_task_key" in str(exc) or "UNIQUE" in str(exc).upper():
            raise ConfigError(
                f"schedule {name!r}: another schedule already runs {spec.label}"
                f"({', '.join(encoded)}); a task has one schedule"
            ) from None
        raise
    if declared.arm is not None:
        _arm(rt, [declared.arm])
    return declared


def declare_exposed(rt: Runtime) -> int:
    """Declare the schedules of the `@exposed(cron=…)` methods of `rt`'s registry (a listener
    starting); returns how many were created or changed."""
    changed = 0
    for spec in rt.registry.specs():
        cad = spec.options.schedule
        if cad is None:
            continue
        declared = declare(rt, spec.label, spec, (), cad, source="code")
        if declared.did != "kept":
            changed += 1
            next_ms = declared.schedule.occurrence_ms
            logger.info(
                "schedule {} {}: {}, next at {}",
                spec.label,
                declared.did,
                cad.recurrence.describe(),
                "none" if next_ms is None else iso_ms(next_ms),
            )
    return changed


def restore_missing(rt: Runtime) -> int:
    """Put back the occurrence row of every schedule that lost it (cancelled or deleted by
    hand, a declaration cut short); returns how many. Cheap when none did: one query."""
    restored = 0
    for sched in rt.store.schedules_without_occurrence():
        arm = rt.store.restore_occurrence(sched.name, rt.clock.now_ms())
        if arm is not None:
            _arm(rt, [arm])
            restored += 1
            logger.bind(key=sched.task_key, attempt=0).warning(
                "schedule {}: its occurrence row was missing (cancelled or deleted by hand?): "
                "put back; pause or remove a schedule to stop it",
                sched.name,
            )
    return restored


def _arm(rt: Runtime, items: list[tuple[str, int]]) -> None:
    try:
        rt.arm(items, rt.clock.now_ms())
    except redis.RedisError as exc:
        raise RedisUnavailableError(
            f"schedule recorded in the ledger but its occurrence's key was not set ({exc}); "
            "reconciliation will set it"
        ) from None


def live_classes(rt: Runtime) -> frozenset[str] | None:
    """The task classes the live listeners register, as their heartbeats (within
    `takeover_after_s`) announce them; None when one does not say (a keyexpiry before classes
    were announced) or the listener table (or Redis's clock) cannot be read: then nothing is
    told unregistered."""
    try:
        now_ms = rt.clock.now_ms()
        members = rt.store.live_members(now_ms - round(rt.settings.takeover_after_s * 1000))
    except (StoreError, redis.RedisError, OSError):
        return None  # a listing still lists, unflagged; `doctor` still reports Redis down
    announced = list(members.values())
    if any(classes is None for classes in announced):
        return None
    return frozenset().union(*(c for c in announced if c is not None))


def unregistered(schedules: Sequence[ScheduleRow], classes: frozenset[str] | None) -> set[str]:
    """The names of the `schedules` whose class none of the live listeners (`live_classes`)
    registers: they run nowhere until one does (a typo in `Client.schedule("…", "Class.meth")`,
    a class removed from the code, no listener running)."""
    if classes is None:
        return set()
    return {s.name for s in schedules if s.class_name not in classes}


def unregistered_note(s: ScheduleRow, classes: frozenset[str] | None) -> str:
    """One line for a schedule `unregistered` names."""
    who = "no listener is running" if not classes else f"no live listener registers {s.class_name}"
    return f"schedule {s.name}: {who}; its runs wait until one does"


class ScheduleCalls:
    """`Client`'s calls on recurring schedules (README "Recurring schedules"), kept with the
    operations they call; `Client` provides what they use."""

    rt: Runtime
    store: Store
    redis: Redis

    def spec(self, target: Target) -> TaskSpec:
        raise NotImplementedError  # `Client.spec`

    def _now_ms(self) -> int:
        raise NotImplementedError  # `Client._now_ms`

    def _arm(self, items: Sequence[tuple[str, int]], now_ms: int) -> None:
        raise NotImplementedError  # `Client._arm`

    def schedule(
        self,
        name: str,
        target: Target,
        *args: object,
        cron: str | None = None,
        every_s: float | None = None,
        tz: str = "UTC",
        start: dt.datetime | None = None,
        end: dt.datetime | None = None,
        catch_up: str = "latest",
        catch_up_max: int = CATCH_UP_MAX,
        overlap: str = "skip",
        retry_schedule_s: Sequence[float] | None = None,
    ) -> ScheduleRow:
        """Run `target(*args)` on a recurrence, as schedule `name` (README "Recurring
        schedules"): `cron` (5 fields or `@daily`…, in IANA zone `tz`) or `every_s`; optional
        `start`/`end` (aware datetimes); `catch_up` after downtime ("latest", "all" up to
        `catch_up_max`, "none"); `overlap` when a run is still going as the next falls due
        ("skip", "wait"). Declaring it again with the same definition changes nothing; with
        another, its pending occurrence is replaced. Returns the schedule as stored."""
        cad = cadence(
            cron=cron, every_s=every_s, tz=tz, start=start, end=end, catch_up=catch_up,
            catch_up_max=catch_up_max, overlap=overlap,
        )  # fmt: skip
        return declare(
            self.rt, name, self.spec(target), args, cad, retry_schedule_s=retry_schedule_s
        ).schedule

    def schedules(self) -> list[ScheduleRow]:
        """Every schedule, by name: definition, next occurrence, last run."""
        return self.store.list_schedules()

    def get_schedule(self, name: str) -> ScheduleRow | None:
        """Schedule `name`, or None."""
        return self.store.get_schedule(name)

    def unschedule(self, name: str) -> bool:
        """Remove schedule `name` and cancel its pending occurrence (one running finishes);
        False when there was none."""
        key = self.store.remove_schedule(name, self._now_ms())
        if key is None:
            return False
        with contextlib.suppress(redis.RedisError):
            self.redis.delete(key)  # an event without a pending row claims nothing
        return True

    def pause_schedule(self, name: str) -> bool:
        """Stop schedule `name` from running (its pending occurrence cancelled) until
        `resume_schedule`; what it missed then follows its `catch_up`. False: no such one."""
        found, _ = self.store.pause_schedule(name, True, self._now_ms())
        return found

    def resume_schedule(self, name: str) -> bool:
        """Resume a paused schedule; False: no such one."""
        found, arm = self.store.pause_schedule(name, False, self._now_ms())
        if arm is not None:
            self._arm([arm], self._now_ms())
        return found

    def run_schedule_now(self, name: str) -> bool:
        """Run schedule `name`'s pending occurrence now, as an extra run (the regular one after
        it still comes); False when it has none pending (running, paused, ended) or no such
        schedule: `get_schedule` tells which."""
        _, key = self.store.run_schedule_now(name, self._now_ms())
        if key is None:
            return False
        self._arm([(key, self._now_ms())], self._now_ms())
        return True
