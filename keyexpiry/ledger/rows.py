"""The ledger's rows as Python sees them: statuses, a task row, a task to create, an outcome to
record, and how a malformed row is reported. Reading a database row, whatever was written into
it, is `ledger/reading.py`."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from loguru import logger

from keyexpiry import limits
from keyexpiry.errors import KeyExpiryError
from keyexpiry.keys import shorten
from keyexpiry.log import SaidOnce
from keyexpiry.printable import printable


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
    """The class the key names (the key is the task's identity)."""
    method: str
    """The method the key names."""
    args: tuple[str, ...]
    """The arguments the key names (an args column that says otherwise makes `problem`)."""
    status: TaskStatus | str
    """A `TaskStatus`; a status outside it (a row written outside keyexpiry) is kept as the
    stored text, and `problem` says so: no query of keyexpiry's ever picks such a row up."""
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
    """Why the row is malformed, None for a sound one: what in it keyexpiry would never have
    written (a row written by another program, a bug, or a hand edit). A malformed row is
    shown and reported, never run: claimed, it is recorded dead naming this."""
    tag: str | None = None
    """The task's business key (`create(..., tag=)`), or None."""
    result_json: str | None = None
    """The handler's return value as stored: JSON text, or None (see `result`)."""
    payload_json: str | None = None
    """What travels with the task as stored: JSON text, or None (see `payload`)."""
    traceparent: str | None = None
    """The W3C traceparent of the span that created the task (`keyexpiry.tracing`), or None."""
    schedule_name: str | None = None
    """The schedule whose occurrence this row is (`keyexpiry.schedules`), or None."""
    unreadable: frozenset[str] = frozenset()
    """Columns whose stored value could not be read as what they hold (text in a time): the
    field holds a stand-in (`UNREADABLE_MS` for a time, 0 for attempts), `to_json` gives None,
    and `problem` quotes what was stored."""

    @property
    def result(self) -> Any:
        """The handler's return value, decoded from JSON: None when it returned None, has not
        succeeded yet, or its value could not be kept (then `last_error` says why). Text that
        is not JSON, or nests deeper than `limits.MAX_JSON_DEPTH` (a row written outside
        keyexpiry), comes back as that text."""
        if self.result_json is None:
            return None
        try:
            return limits.json_loads(self.result_json)
        except ValueError:  # not JSON, or nested too deep to decode (`problem` says so)
            return self.result_json

    @property
    def payload(self) -> Any:
        """What travels with the task (`create(..., payload=)`), decoded from JSON; None when it
        has none. Text that is not JSON, or nests deeper than `limits.MAX_JSON_DEPTH` (written
        outside keyexpiry), comes back as that text."""
        if self.payload_json is None:
            return None
        try:
            return limits.json_loads(self.payload_json)
        except ValueError:  # not JSON, or nested too deep to decode (`problem` says so)
            return self.payload_json

    def to_json(self) -> dict[str, Any]:
        """The `list --json` / `show --json` object: times as epoch seconds (float)."""

        unreadable = self.unreadable

        def sec(column: str, ms: int | None) -> float | None:
            return None if ms is None or column in unreadable else ms / 1000.0

        return {
            "key": self.key,
            "class": self.class_name,
            "method": self.method,
            "args": list(self.args),
            "status": str(self.status),
            "attempts": None if "attempts" in unreadable else self.attempts,
            "due_at": sec("due_at_ms", self.due_at_ms),
            "created_at": sec("created_at_ms", self.created_at_ms),
            "started_at": sec("started_at_ms", self.started_at_ms),
            "finished_at": sec("finished_at_ms", self.finished_at_ms),
            "claimed_by": self.claimed_by,
            "last_error": self.last_error,
            "tag": self.tag,
            "result": self.result,
            "payload": self.payload,
            "schedule": self.schedule_name,
            "problem": self.problem,
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
    payload: str | None = None
    """JSON text (`keyexpiry.payloads`); kept by a reschedule that gives none, like the tag."""
    traceparent: str | None = None
    """The creating span's W3C traceparent (`keyexpiry.tracing`), or None."""


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
    occurrence: Occurrence | None = None
    """The run was an occurrence of a schedule: when it ended for good (done, dead, skipped),
    its row becomes the schedule's next occurrence in the same transaction."""


@dataclass(frozen=True, slots=True)
class Occurrence:
    """Which occurrence of which schedule a run stood for."""

    schedule: str
    scheduled_for_ms: int
    skipped: bool = False
    """Not run: missed during downtime under `catch_up="none"`."""
    started_ms: int | None = None
    """When the run started: an occurrence due before it was a backlog, not an overlap."""
    extra: bool = False
    """A run ahead of the occurrence (`run_schedule_now`, or the task created earlier by
    hand): the occurrence it moved stays the next one."""


BIGINT_MAX = 2**63 - 1
"""The largest value a BIGINT column holds (SQLite's INTEGER too: past it, a sum turns REAL)."""
UNREADABLE_MS = BIGINT_MAX
"""What a time column that holds no time (text, a blob) reads as: after every real time, as
SQLite sorts text after numbers (so lists merged in Python keep the database's order)."""
_STATUSES: dict[object, TaskStatus] = {s.value: s for s in TaskStatus}


def task_status(
    value: object, error: type[KeyExpiryError], what: str = "status"
) -> TaskStatus | None:
    """The status `value` names: a `TaskStatus` or its name (None: any); `error`, saying
    what `what` (the argument or option) allows, for anything else."""
    if value is None or isinstance(value, TaskStatus):
        return value
    try:
        return _STATUSES[value]
    except (KeyError, TypeError):
        allowed = ", ".join(repr(s.value) for s in TaskStatus)
        raise error(f"{what} must be one of {allowed}, got {shorten(repr(value), 80)}") from None


class MalformedRows:
    """Says once per row, with its key, that a ledger row is malformed and what becomes of it,
    and counts such rows: a loop that meets the same row on every pass must not say it on
    every pass."""

    def __init__(self) -> None:
        self._said = SaidOnce()
        self._lock = threading.Lock()
        self.count = 0
        """Malformed rows reported (each once)."""

    def report(self, key: str, problem: str, fate: str, *, attempt: int = 0) -> bool:
        """Log `problem` of the row `key` and its `fate` (skipped, left alone), the first time
        only; True when it was said now."""
        with self._lock:
            if not self._said.first((key, problem)):
                return False
            self.count += 1
        logger.bind(key=printable(shorten(key, 200)), attempt=attempt).warning(
            "malformed ledger row ({}): {}", fate, problem
        )
        return True
