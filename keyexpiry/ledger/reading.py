"""Reading a stored row, whatever was written into it: a task row (`row_from_db`, and
`claimed_row_from_db` for a claim's read-back), each column checked; what cannot be read as
keyexpiry writes it becomes a stand-in, and the row is marked with its `problem` (never an
exception: one bad row must not stop a listener's loop or a list). The row types are
`ledger/rows.py`."""

from __future__ import annotations

import json
import math
from decimal import Decimal
from typing import Any

from loguru import logger

from keyexpiry import limits
from keyexpiry.errors import KeyFormatError, StoreError
from keyexpiry.keys import SEPARATOR, clip, escape_arg, parse_key, shorten
from keyexpiry.ledger.rows import BIGINT_MAX, UNREADABLE_MS, TaskRow, TaskStatus

_BIGINT = (-BIGINT_MAX - 1, BIGINT_MAX)
_STATUSES: dict[object, TaskStatus] = {s.value: s for s in TaskStatus}


def stored_ms(value: object) -> int | None:
    """A time (or count) column's stored value as an int, or None when it holds no number in
    BIGINT's range: SQLite keeps whatever was written (text, a blob, an infinite real).
    A real is cut to a whole number (keyexpiry never writes one; nothing breaks on it)."""
    if type(value) is int:
        return value if _BIGINT[0] <= value <= _BIGINT[1] else None
    if isinstance(value, float | Decimal):
        if not math.isfinite(value):
            return None
        whole = int(value)
        return whole if _BIGINT[0] <= whole <= _BIGINT[1] else None
    return None


class _Reading:
    """One stored row being read: what could not be read as keyexpiry writes it."""

    __slots__ = ("problems", "unreadable")

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.unreadable: set[str] = set()

    def ms(self, value: object, column: str) -> int:
        """A NOT NULL time (or count) column; a stand-in when unreadable."""
        if type(value) is int:  # the common case, at once
            return value
        got = stored_ms(value)
        if got is None:
            self.problems.append(f"its {column} column holds {_shown(value)}, not a number")
            self.unreadable.add(column)
            return 0 if column == "attempts" else UNREADABLE_MS
        return got

    def maybe_ms(self, value: object, column: str) -> int | None:
        """A nullable time column; None when unreadable."""
        if value is None or type(value) is int:
            return value
        got = stored_ms(value)
        if got is None:
            self.problems.append(f"its {column} column holds {_shown(value)}, not a number")
            self.unreadable.add(column)
        return got

    def text(self, value: object, column: str) -> str:
        """A NOT NULL text column (SQLite also keeps numbers and blobs in one)."""
        if type(value) is str:
            return value
        self.problems.append(f"its {column} column holds {_shown(value)}, not text")
        return _as_text(value)

    def maybe_text(self, value: object, column: str) -> str | None:
        """A nullable text column."""
        if value is None or type(value) is str:
            return value
        self.problems.append(f"its {column} column holds {_shown(value)}, not text")
        return _as_text(value)


def _as_text(value: object) -> str:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "backslashreplace")
    return "" if value is None else str(value)


def _shown(value: object) -> str:
    """A stored value quoted in a problem: its type and at most 60 characters, escaped."""
    if value is None:
        return "NULL"
    return f"{type(value).__name__} {clip(_as_text(value), 60)}"


def _args(text: str) -> tuple[tuple[str, ...] | None, str | None]:
    """A row's arguments, or None and why they cannot be read (a row written by hand)."""
    if limits.json_too_deep(text):
        return None, f"its args column holds JSON nested deeper than {limits.MAX_JSON_DEPTH} levels"
    try:
        args = json.loads(text)
    except ValueError:
        return None, "its args column is not JSON"
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        return None, "its args column is not a JSON list of strings"
    return tuple(args), None


def _key_args(
    key: str, prefix: str, column: tuple[str, ...] | None
) -> tuple[tuple[str, ...] | None, str | None]:
    """The arguments the task `key` names (None when it names none readably), and the problem
    when the args column (`column`, None when unreadable) says otherwise. The key is the
    identity: it is what Redis announces, what a claim finds the row by and what
    `one_at_a_time` groups by; a handler run with the column's values would be another task."""
    if column is not None:
        try:
            tail = "".join(SEPARATOR + escape_arg(a) for a in column)
        except KeyFormatError:  # text no key can hold (a lone surrogate)
            tail = None
        # The row as keyexpiry writes it, told at once: `{prefix}Class@method` holds one `@`,
        # an escaped argument none.
        if tail is not None and key.endswith(tail) and key.count(SEPARATOR) == len(column) + 1:
            return column, None
    try:
        named = parse_key(key, prefix=prefix).args
    except KeyFormatError:
        return column, None  # no task key to compare with: `_identity` or the claim says so
    if column is None or named == column:
        return named, None
    return named, (
        f"its args column says {shorten(repr(list(column)), 80)} but its key names "
        f"{shorten(repr(list(named)), 80)} (the key is the task's identity)"
    )


def _schedule(r: Any, key: str, attempts: int) -> tuple[float, ...] | None:
    """A row's retry schedule; one written with values keyexpiry would refuse (NaN, negative,
    years) falls back to the method's and the settings' schedule, with a warning."""
    if r.retry_schedule_s is None:
        return None
    try:
        return limits.delays(limits.json_loads(r.retry_schedule_s), "retry_schedule_s", StoreError)
    except (ValueError, TypeError, StoreError) as exc:
        logger.bind(key=shorten(key, 80), attempt=attempts).warning(
            "ledger row {} has an unusable retry schedule ({}); using the default", r.id, exc
        )
        return None


def _identity(key: str, class_name: str, method: str, prefix: str) -> tuple[str, str, str | None]:
    """The class and method of the task `key` names under the key `prefix`, and the problem
    when the columns that repeat them say otherwise. The key is what Redis announces and what
    the claim resolves the handler from: it is the identity, the columns only repeat it (a row
    whose columns differ is shown with the key's names, and refused when claimed: which one
    its writer meant, nothing says).

    The key's class is its first segment after the prefix (which holds no `@`), exactly: a
    column naming a suffix of it (`voice` for `Invoice`) or the prefix with it (`app_Invoice`)
    is not the key's class."""
    head, _, rest = key.partition(SEPARATOR)
    key_method = rest.partition(SEPARATOR)[0]
    if key_method == method and class_name and head == prefix + class_name:
        return class_name, method, None
    # A key outside the prefix (a row of another prefix, a hand edit) is shown whole.
    key_class = head[len(prefix) :] if head.startswith(prefix) else head
    problem = (
        f"its class_name/method columns say {clip(f'{class_name}.{method}', 60)} but its key "
        f"names {clip(f'{key_class}.{key_method}', 60)} (the key is the task's identity)"
    )
    if key_method == method and class_name and head.endswith(class_name):
        # Most likely not a bad row but a reader without the writers' prefix (a shell without
        # the listener's KEYEXPIRY_KEY_PREFIX): say so.
        wrote = head[: len(head) - len(class_name)]
        problem += f"; written with key prefix {clip(wrote, 40)!r}? is KEYEXPIRY_KEY_PREFIX set?"
    return key_class, key_method, problem


def row_from_db(r: Any, prefix: str) -> TaskRow:
    """A TaskRow from a result row of a ledger whose keys start with `prefix`, whatever was
    written into it: a row written outside keyexpiry never makes this raise. What keyexpiry
    would not have written is said in `problem` (the row is malformed), with stand-ins for
    what could not be read at all."""
    # Each value is checked inline first (rows are read by the thousand, all sound); a
    # `_Reading` is made only for one of another type.
    reading: _Reading | None = None
    status_text = r.status
    status: TaskStatus | str | None = _STATUSES.get(status_text)
    if status is None:
        reading = _Reading()
        status = reading.text(status_text, "status")
        reading.problems.insert(
            0,
            f"its status {clip(status, 40)} is none of {', '.join(s.value for s in TaskStatus)} "
            "(a case variant of one is that one to a case-insensitive collation, and unseen on "
            "SQLite)",
        )
    updated_at_ms, started_at_ms = r.updated_at_ms, r.started_at_ms
    finished_at_ms, claimed_by = r.finished_at_ms, r.claimed_by
    lease_until_ms, result_json = r.lease_until_ms, r.result
    if type(updated_at_ms) is not int:
        reading = reading or _Reading()
        updated_at_ms = reading.ms(updated_at_ms, "updated_at_ms")
    if started_at_ms is not None and type(started_at_ms) is not int:
        reading = reading or _Reading()
        started_at_ms = reading.maybe_ms(started_at_ms, "started_at_ms")
    if finished_at_ms is not None and type(finished_at_ms) is not int:
        reading = reading or _Reading()
        finished_at_ms = reading.maybe_ms(finished_at_ms, "finished_at_ms")
    if claimed_by is not None and type(claimed_by) is not str:
        reading = reading or _Reading()
        claimed_by = reading.maybe_text(claimed_by, "claimed_by")
    if lease_until_ms is not None and type(lease_until_ms) is not int:
        reading = reading or _Reading()
        lease_until_ms = reading.maybe_ms(lease_until_ms, "lease_until_ms")
    if result_json is not None and type(result_json) is not str:
        reading = reading or _Reading()
        result_json = reading.maybe_text(result_json, "result")
    return _task_row(
        r,
        reading,
        prefix,
        status=status,
        updated_at_ms=updated_at_ms,
        started_at_ms=started_at_ms,
        finished_at_ms=finished_at_ms,
        claimed_by=claimed_by,
        lease_until_ms=lease_until_ms,
        result_json=result_json,
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


def claimed_row_from_db(
    r: Any, prefix: str, *, token: str, now_ms: int, lease_until_ms: int
) -> TaskRow:
    """A TaskRow from a row (keys under `prefix`) the claim under `token` at `now_ms` has just
    set running, read without the columns in `CLAIM_SETS`: they hold what that claim wrote. A
    token names one claim, so every row held under it was taken with the same times."""
    return _task_row(
        r,
        None,
        prefix,
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
    reading: _Reading | None,
    prefix: str,
    *,
    status: TaskStatus | str,
    updated_at_ms: int,
    started_at_ms: int | None,
    finished_at_ms: int | None,
    claimed_by: str | None,
    lease_until_ms: int | None,
    result_json: str | None = None,
) -> TaskRow:
    # Each value is checked inline first (the claim reads thousands of rows a second, all
    # sound); only one of another type goes through a `_Reading`, made for it: a sound row
    # makes none.
    key, class_name, method, args_text = r.task_key, r.class_name, r.method, r.args
    if type(key) is not str:
        reading = reading or _Reading()
        key = reading.text(key, "task_key")
    if type(class_name) is not str:
        reading = reading or _Reading()
        class_name = reading.text(class_name, "class_name")
    if type(method) is not str:
        reading = reading or _Reading()
        method = reading.text(method, "method")
    if type(args_text) is not str:
        reading = reading or _Reading()
        args_text = reading.text(args_text, "args")
    attempts, due_at_ms, created_at_ms = r.attempts, r.due_at_ms, r.created_at_ms
    if type(attempts) is not int:
        reading = reading or _Reading()
        attempts = reading.ms(attempts, "attempts")
    if type(due_at_ms) is not int:
        reading = reading or _Reading()
        due_at_ms = reading.ms(due_at_ms, "due_at_ms")
    if type(created_at_ms) is not int:
        reading = reading or _Reading()
        created_at_ms = reading.ms(created_at_ms, "created_at_ms")
    last_error, tag = r.last_error, r.tag
    # Absent from a ledger not yet upgraded (a CLI reading it before a listener added it).
    payload = getattr(r, "payload", None)
    if payload is not None and type(payload) is not str:
        reading = reading or _Reading()
        payload = reading.maybe_text(payload, "payload")
    traceparent = getattr(r, "traceparent", None)
    if traceparent is not None and type(traceparent) is not str:
        traceparent = None  # only a hint: a value that is no text is no trace to continue
    schedule_name = getattr(r, "schedule_name", None)
    if schedule_name is not None and type(schedule_name) is not str:
        schedule_name = None  # a schedule is found by its name: no text, no schedule
    if last_error is not None and type(last_error) is not str:
        reading = reading or _Reading()
        last_error = reading.maybe_text(last_error, "last_error")
    if tag is not None and type(tag) is not str:
        reading = reading or _Reading()
        tag = reading.maybe_text(tag, "tag")
    column_args, args_problem = _args(args_text)
    if args_problem is not None:
        reading = reading or _Reading()
        reading.problems.append(args_problem)
    class_name, method, mismatch = _identity(key, class_name, method, prefix)
    if mismatch is not None:
        reading = reading or _Reading()
        reading.problems.append(mismatch)
    key_args, args_mismatch = _key_args(key, prefix, column_args)
    if args_mismatch is not None:
        reading = reading or _Reading()
        reading.problems.append(args_mismatch)
    if payload is not None and limits.json_too_deep(payload):
        reading = reading or _Reading()
        reading.problems.append(
            f"its payload column holds JSON nested deeper than {limits.MAX_JSON_DEPTH} levels"
        )
    problem: str | None = None
    unreadable: frozenset[str] = frozenset()
    if reading is not None:
        problem = "; ".join(reading.problems) if reading.problems else None
        unreadable = frozenset(reading.unreadable)
    return TaskRow(
        id=r.id,
        key=key,
        class_name=class_name,
        method=method,
        args=key_args or (),
        status=status,
        attempts=attempts,
        retry_schedule_s=_schedule(r, key, attempts),
        due_at_ms=due_at_ms,
        created_at_ms=created_at_ms,
        updated_at_ms=updated_at_ms,
        started_at_ms=started_at_ms,
        finished_at_ms=finished_at_ms,
        claimed_by=claimed_by,
        lease_until_ms=lease_until_ms,
        last_error=last_error,
        problem=problem,
        tag=tag,
        result_json=result_json,
        payload_json=payload,
        traceparent=traceparent,
        schedule_name=schedule_name,
        unreadable=unreadable,
    )
