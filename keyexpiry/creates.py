"""What a create is given, read before anything is written: `TaskRequest` and the targets it
names, due times (`due_at_ms`), a list's limit, and the batch a `create_many` call becomes.

Kept apart from `client.py` so that `Client` reads as its calls: the checking of what they are
handed lives here, with no connection in sight."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from keyexpiry import limits
from keyexpiry.errors import ArgumentError, KeyExpiryError, StoreError
from keyexpiry.keys import format_key, shorten
from keyexpiry.ledger.if_exists import Did, IfExists, Rule, Scheduled
from keyexpiry.ledger.rows import NewTask, TaskStatus
from keyexpiry.payloads import encode_payload
from keyexpiry.registry import TaskSpec
from keyexpiry.settings import Settings
from keyexpiry.tags import check_tag
from keyexpiry.tracing import current_traceparent

Status = TaskStatus | Literal["pending", "running", "done", "dead", "cancelled"]
"""A status as callers write it: `TaskStatus.DONE` or `"done"`."""


def list_limit(value: object, error: type[KeyExpiryError]) -> int:
    """How many rows a list may return: a whole number from 1 to `limits.MAX_LIST_ROWS`."""
    limits.number(value, "limit", low=1, high=limits.MAX_LIST_ROWS, error=error)
    if not isinstance(value, int):
        raise error(f"limit must be a whole number, got {shorten(repr(value), 80)}")
    return value


Target = str | Callable[..., Any]
"""A task method: the exposed function itself (`OrderTimeout.close_unpaid`) or `"Class.method"`."""

PauseTarget = str | Callable[..., Any] | type
"""What a pause names: `"Class"` or `"Class.method"`, a registered task class (`OrderTimeout`) or
one of its exposed methods (`OrderTimeout.close_unpaid`)."""


@dataclass(frozen=True, slots=True)
class TaskRequest:
    """One task for `Client.create_many`: target, arguments and exactly one of the due fields."""

    target: Target
    args: Sequence[object] = ()
    ttl_s: float | None = None
    ttl_ms: int | None = None
    at: dt.datetime | None = None
    retry_schedule_s: Sequence[float] | None = None
    tag: str | None = None
    if_exists: Rule = "replace"
    """What to do when the task's key has a row already (`keyexpiry.ledger.if_exists`)."""
    payload: Any = None
    """A JSON-serialisable value that travels with the task in its row (see `Client.create`)."""


class NotPlain(Exception):
    """Raised when a bulk create written as it is read meets a request the plain upsert cannot
    write: a rule other than "replace", or a key requested before."""


class Batch:
    """The tasks of one `create_many` call, made as its requests are read: each key once, in
    the place of its first request, as its last request says."""

    def __init__(self, spec: Callable[[Target], TaskSpec], settings: Settings, now_ms: int) -> None:
        # `spec`: how the client resolves a target (`Client.spec`).
        self._spec, self._now_ms = spec, now_ms
        self._payload_max_bytes = settings.payload_max_bytes
        # The caller's span, once for the batch (None without OpenTelemetry, at no cost).
        self._traceparent = current_traceparent()
        self.new: dict[str, NewTask] = {}
        self.rules: dict[str, IfExists] = {}
        """Only the keys whose (last) request is not "replace": a bulk create of the default
        rule pays nothing per task for the rules."""
        # A bulk create names a few task methods many times over: each is resolved once.
        self._specs: dict[object, TaskSpec] = {}
        self._prefix = settings.key_prefix

    def add(self, req: TaskRequest) -> NewTask:
        """Check `req` (ArgumentError, UnknownTaskError) and make its task."""
        try:
            spec = self._specs.get(req.target) or self._specs.setdefault(
                req.target, self._spec(req.target)
            )
        except TypeError:  # a target that cannot be a dict key (an unhashable callable)
            spec = self._spec(req.target)
        encoded = spec.encode_args(req.args)
        key = format_key(spec.class_name, spec.method, encoded, prefix=self._prefix)
        schedule = limits.delays(req.retry_schedule_s, "retry_schedule_s", ArgumentError)
        due = due_at_ms(self._now_ms, ttl_s=req.ttl_s, ttl_ms=req.ttl_ms, at=req.at)
        rule = IfExists.of(req.if_exists)
        if rule is not IfExists.REPLACE:
            self.rules[key] = rule
        elif self.rules:
            self.rules.pop(key, None)
        tag = check_tag(req.tag, ArgumentError)
        payload = (
            None if req.payload is None else encode_payload(req.payload, self._payload_max_bytes)
        )
        task = self.new[key] = NewTask(
            key, spec.class_name, spec.method, encoded, due, schedule, tag, payload,
            self._traceparent,
        )  # fmt: skip
        return task

    def add_all(self, requests: Iterable[TaskRequest]) -> None:
        """`add` each of `requests`."""
        for req in requests:
            self.add(req)

    def plain(self, requests: Iterator[TaskRequest]) -> Iterator[NewTask]:
        """The task of each of `requests` as it is read, while each is of the rule "replace"
        and a key not requested before; then NotPlain (that request added, the rest unread)."""
        for req in requests:
            count = len(self.new)
            task = self.add(req)
            if self.rules or len(self.new) == count:
                raise NotPlain
            yield task


def scheduled(tasks: Sequence[NewTask], done: Sequence[tuple[Did, int]]) -> list[Scheduled]:
    """The keys of `tasks` with what was done to each, as `create_many` returns them."""
    return [Scheduled(t.key, did, due) for t, (did, due) in zip(tasks, done, strict=True)]


def due_at_ms(
    now_ms: int,
    *,
    ttl_s: float | None = None,
    ttl_ms: int | None = None,
    at: dt.datetime | None = None,
) -> int:
    """The due time in epoch ms from exactly one of a TTL in s, a TTL in ms, or a datetime.

    Due times reach at most `limits.MAX_HORIZON_S` (100 years) ahead; an `at` in the past is due
    now, back to 1970-01-01 UTC.
    """
    if (
        ttl_ms is None
        and at is None
        and type(ttl_s) in (int, float)
        and 0 <= ttl_s <= limits.MAX_HORIZON_S  # type: ignore[operator]
    ):
        # The common case, checked as `limits.number` would check it (NaN fails the range).
        return now_ms + round(ttl_s * 1000)  # type: ignore[operator]
    given = [x for x in (ttl_s, ttl_ms, at) if x is not None]
    if len(given) != 1:
        raise ArgumentError("give exactly one of ttl_s, ttl_ms or at")
    horizon_ms = now_ms + limits.MAX_HORIZON_S * 1000
    if at is not None:
        if not isinstance(at, dt.datetime):
            raise ArgumentError(f"at must be a datetime, got {type(at).__name__}")
        if at.tzinfo is None:
            raise ArgumentError("at must be timezone-aware (e.g. datetime.now(timezone.utc))")
        try:
            due = round(at.timestamp() * 1000)
        except (OverflowError, ValueError, OSError):
            due = -1
        if not limits.MIN_DUE_MS <= due <= horizon_ms:
            raise ArgumentError(
                f"at {at.isoformat()} is out of range: from 1970-01-01 UTC to "
                f"{limits.MAX_HORIZON_S // (365 * limits.DAY_S)} years from now"
            )
        return due
    if ttl_ms is not None:
        limits.number(ttl_ms, "ttl_ms", low=0, high=horizon_ms - now_ms, error=ArgumentError)
        if ttl_ms != int(ttl_ms):
            raise ArgumentError(f"ttl_ms must be a whole number of milliseconds, got {ttl_ms!r}")
        return now_ms + int(ttl_ms)
    ttl = limits.number(ttl_s, "ttl_s", low=0, high=limits.MAX_HORIZON_S, error=ArgumentError)
    return now_ms + round(ttl * 1000)


def pause_until_ms(until: dt.datetime, now_ms: int) -> int:
    """When a pause given `until` ends, in epoch ms: a timezone-aware datetime after `now_ms`,
    at most `limits.MAX_HORIZON_S` ahead (ArgumentError otherwise)."""
    if not isinstance(until, dt.datetime):
        raise ArgumentError(f"until must be a datetime, got {type(until).__name__}")
    if until.tzinfo is None:
        raise ArgumentError("until must be timezone-aware (e.g. datetime.now(timezone.utc))")
    try:
        ms = due_at_ms(now_ms, at=until)
    except ArgumentError:  # out of range: beyond the horizon, or before 1970 (in the past)
        if until > dt.datetime.fromtimestamp(now_ms / 1000, dt.UTC):
            years = limits.MAX_HORIZON_S // (365 * limits.DAY_S)
            raise ArgumentError(
                f"until {until.isoformat()} is more than {years} years away"
            ) from None
        ms = limits.MIN_DUE_MS
    if ms <= now_ms:
        raise ArgumentError(f"until {until.isoformat()} is not in the future")
    return ms


@contextlib.contextmanager
def saying_what_was_recorded(keys: Callable[[], Sequence[str]]) -> Iterator[None]:
    """A create's StoreError, saying what became of its tasks: not recorded (nothing written),
    or perhaps recorded (the ledger's answer was lost: creating them again is safe, the same
    keys are the same rows, and a recorded one runs even without its Redis key, armed by a
    listener's overdue check). `keys`: the tasks' keys, read when the error is raised."""
    try:
        yield
    except StoreError as exc:
        named = list(keys())
        what = f"task {named[0]}" if len(named) == 1 else f"{len(named)} tasks"
        if exc.maybe_applied:
            state = (
                "may have been recorded (the ledger's answer was lost); creating it again is "
                "safe (same key, same row)"
            )
        else:
            state = "not recorded (nothing was written); create it again once the ledger answers"
        error = StoreError(f"{what}: {state}: {exc}")
        error.disconnected, error.lock_timeout = exc.disconnected, exc.lock_timeout
        error.maybe_applied = exc.maybe_applied
        raise error from exc
