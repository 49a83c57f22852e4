"""The ledger's rows as Python sees them: statuses, a task row, a task to create, an outcome to
record; and the one function that reads a database row, whatever was written into it."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from loguru import logger

from keyexpiry import limits
from keyexpiry.errors import StoreError
from keyexpiry.keys import shorten


class TaskStatus(StrEnum):
    """Where a task is in its life."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    DEAD = "dead"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class TaskRow:
    """One ledger row, times in epoch milliseconds on the shared (Redis) clock."""

    id: int
    key: str
    class_name: str
    method: str
    args: tuple[str, ...]
    status: TaskStatus
    attempts: int
    retry_schedule_s: tuple[float, ...] | None
    due_at_ms: int
    created_at_ms: int
    updated_at_ms: int
    started_at_ms: int | None
    finished_at_ms: int | None
    claimed_by: str | None
    lease_until_ms: int | None
    last_error: str | None
    problem: str | None = None
    """Why the row cannot run as stored (set only for rows written outside keyexpiry)."""
    tag: str | None = None
    """The task's business key (`create(..., tag=)`), or None."""
    result_json: str | None = None
    """The handler's return value as stored: JSON text, or None (see `result`)."""

    @property
    def result(self) -> Any:
        """The handler's return value, decoded from JSON: None when it returned None, has not
        succeeded yet, or its value could not be kept (then `last_error` says why). Text that
        is not JSON (a row written outside keyexpiry) comes back as that text."""
        if self.result_json is None:
            return None
        try:
            return json.loads(self.result_json)
        except ValueError:
            return self.result_json

    def to_json(self) -> dict[str, Any]:
        """The `list --json` / `show --json` object: times as epoch seconds (float)."""

        def sec(ms: int | None) -> float | None:
            return None if ms is None else ms / 1000.0

        return {
            "key": self.key,
            "class": self.class_name,
            "method": self.method,
            "args": list(self.args),
            "status": str(self.status),
            "attempts": self.attempts,
            "due_at": sec(self.due_at_ms),
            "created_at": sec(self.created_at_ms),
            "started_at": sec(self.started_at_ms),
            "finished_at": sec(self.finished_at_ms),
            "claimed_by": self.claimed_by,
            "last_error": self.last_error,
            "tag": self.tag,
            "result": self.result,
        }


@dataclass(frozen=True, slots=True)
class NewTask:
    """A row to insert or reschedule (the key is the identity)."""

    key: str
    class_name: str
    method: str
    args: tuple[str, ...]
    due_at_ms: int
    retry_schedule_s: tuple[float, ...] | None = None
    tag: str | None = None
    """Kept by a reschedule that gives none (`keyexpiry.tags`)."""


# Made once: `json.dumps` given options builds an encoder on every call.
_ARGS_ENCODER = json.JSONEncoder(ensure_ascii=False)


# What JSON (without ASCII escapes) writes as it is inside a string: all but `"`, `\` and the
# control characters.
_JSON_PLAIN = re.compile(r'[^"\\\x00-\x1f]*\Z')


def args_json(args: tuple[str, ...]) -> str:
    """The `args` column of a new row: a JSON list (UTF-8 text, not \\u escapes)."""
    if all(_JSON_PLAIN.match(a) for a in args):
        # What the encoder writes for such strings, without its per-call set-up (a bulk create's
        # arguments are ids and names).
        return '["' + '", "'.join(args) + '"]' if args else "[]"
    return _ARGS_ENCODER.encode(args)


def schedule_json(schedule: tuple[float, ...] | None) -> str | None:
    """The `retry_schedule_s` column of a new row (NULL: the method's and settings' schedule)."""
    return None if schedule is None else json.dumps(list(schedule))


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one claimed run ended, to be recorded in a batch."""

    task_id: int
    key: str
    token: str
    status: TaskStatus
    finished_at_ms: int | None
    due_at_ms: int
    last_error: str | None
    result: str | None = None
    """A successful run's return value as JSON text (`keyexpiry.results`)."""
    recorded: bool = False
    """Already written by the run itself (a transactional handler's own transaction): the
    recorder only counts it."""


def _args(text: str) -> tuple[tuple[str, ...], str | None]:
    """A row's arguments, or () and why they cannot be read (a row written by hand)."""
    try:
        args = json.loads(text)
    except ValueError:
        return (), "its args column is not JSON"
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        return (), "its args column is not a JSON list of strings"
    return tuple(args), None


def _schedule(r: Any) -> tuple[float, ...] | None:
    """A row's retry schedule; one written with values keyexpiry would refuse (NaN, negative,
    years) falls back to the method's and the settings' schedule, with a warning."""
    if r.retry_schedule_s is None:
        return None
    try:
        return limits.delays(json.loads(r.retry_schedule_s), "retry_schedule_s", StoreError)
    except (ValueError, StoreError) as exc:
        logger.bind(key=shorten(r.task_key, 80), attempt=r.attempts).warning(
            "ledger row {} has an unusable retry schedule ({}); using the default", r.id, exc
        )
        return None


def row_from_db(r: Any) -> TaskRow:
    """A TaskRow from a result row; a row written outside keyexpiry never makes this raise
    (what cannot run is kept in `problem`)."""
    return _task_row(
        r,
        status=TaskStatus(r.status),
        updated_at_ms=r.updated_at_ms,
        started_at_ms=r.started_at_ms,
        finished_at_ms=r.finished_at_ms,
        claimed_by=r.claimed_by,
        lease_until_ms=r.lease_until_ms,
        result_json=r.result,
    )


CLAIM_SETS = frozenset(
    {"status", "updated_at_ms", "started_at_ms", "finished_at_ms", "claimed_by", "lease_until_ms"}
)
"""The columns a claim writes with values its caller knows (not `attempts`, which it adds to):
read back right after the claim, they need not be selected (each column of a result costs the
pure-Python driver a field descriptor to parse, on every query)."""
CLAIM_SKIPS = frozenset({"result"})
"""Columns a claim does not read back at all: a run never needs the value a past run returned
(a row becomes pending again only by a create, which clears it)."""


def claimed_row_from_db(r: Any, *, token: str, now_ms: int, lease_until_ms: int) -> TaskRow:
    """A TaskRow from a row the claim under `token` at `now_ms` has just set running, read
    without the columns in `CLAIM_SETS`: they hold what that claim wrote. A token names one
    claim, so every row held under it was taken with the same times."""
    return _task_row(
        r,
        status=TaskStatus.RUNNING,
        updated_at_ms=now_ms,
        started_at_ms=now_ms,
        finished_at_ms=None,
        claimed_by=token,
        lease_until_ms=lease_until_ms,
        result_json=None,
    )


def _task_row(
    r: Any,
    *,
    status: TaskStatus,
    updated_at_ms: int,
    started_at_ms: int | None,
    finished_at_ms: int | None,
    claimed_by: str | None,
    lease_until_ms: int | None,
    result_json: str | None = None,
) -> TaskRow:
    args, problem = _args(r.args)
    return TaskRow(
        id=r.id,
        key=r.task_key,
        class_name=r.class_name,
        method=r.method,
        args=args,
        status=status,
        attempts=r.attempts,
        retry_schedule_s=_schedule(r),
        due_at_ms=r.due_at_ms,
        created_at_ms=r.created_at_ms,
        updated_at_ms=updated_at_ms,
        started_at_ms=started_at_ms,
        finished_at_ms=finished_at_ms,
        claimed_by=claimed_by,
        lease_until_ms=lease_until_ms,
        last_error=r.last_error,
        problem=problem,
        tag=r.tag,
        result_json=result_json,
    )
