"""Declaring and operating recurring schedules on a runtime: what `Client.schedule()` and its
siblings do, and what a listener does for the `@exposed(cron=…)` methods it registers and to put
back an occurrence row that went missing. The rules are `keyexpiry.schedules`; the rows,
`keyexpiry.ledger.recurring`."""

from __future__ import annotations

from collections.abc import Sequence

import redis
from loguru import logger

from keyexpiry import limits
from keyexpiry.clock import iso_ms
from keyexpiry.errors import ConfigError, RedisUnavailableError, StoreError
from keyexpiry.keys import format_key
from keyexpiry.ledger.recurring import Declared, ScheduleRow
from keyexpiry.registry import TaskSpec
from keyexpiry.runtime import Runtime
from keyexpiry.schedules.rules import Cadence, check_name


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
