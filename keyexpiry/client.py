"""`Client`: creating, cancelling and inspecting tasks, the API business code calls.

What its calls are handed (`TaskRequest`, targets, due times) is checked in `creates.py`.

Long because `Client` is the one public API object business code holds: its creating, cancelling,
reading and pausing calls stay together (schedules come from `ScheduleCalls`).
"""

from __future__ import annotations

import builtins
import datetime as dt
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from loguru import logger
from sqlalchemy import Connection

from keyexpiry import limits
from keyexpiry.creates import (
    Batch,
    NotPlain,
    PauseTarget,
    Status,
    Target,
    TaskRequest,
    due_at_ms,
    list_limit,
    pause_until_ms,
    saying_what_was_recorded,
    scheduled,
)
from keyexpiry.errors import (
    ArgumentError,
    KeyFormatError,
    RedisUnavailableError,
    UnknownTaskError,
)
from keyexpiry.flow.pauses import Pause, announce, check_reason, parse_target
from keyexpiry.keys import braces_unescaped, clip, format_key
from keyexpiry.ledger.if_exists import Did, IfExists, Rule, Scheduled
from keyexpiry.ledger.pauses import PausesRead
from keyexpiry.ledger.rows import MalformedRows, task_status
from keyexpiry.ledger.store import Store, TaskRow, TaskStatus
from keyexpiry.ledger.transactions import Tx, after_commit, check_same_database, joined
from keyexpiry.redis.permits import held_counts
from keyexpiry.registry import Registry, TaskSpec
from keyexpiry.runtime import Runtime
from keyexpiry.schedules.operate import ScheduleCalls
from keyexpiry.settings import Settings
from keyexpiry.tags import check_tag


class Client(ScheduleCalls):
    """Business code's handle on keyexpiry: create, cancel and inspect delayed tasks.

    >>> ke = Client(Settings.from_env())
    >>> ke.create(OrderTimeout.close_unpaid, 218, ttl_s=900)
    'OrderTimeout@close_unpaid@218'
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        registry: Registry | None = None,
        store: Store | None = None,
        ensure_schema: bool = True,
        runtime: Runtime | None = None,
    ) -> None:
        self.rt = runtime or Runtime.open(settings or Settings.from_env(), registry, store=store)
        # Shorthands: business code and the CLI read these.
        self.settings, self.registry, self.store = self.rt.settings, self.rt.registry, self.rt.store
        self.redis, self.clock = self.rt.redis, self.rt.clock
        self._ledger_identity: tuple[str, ...] | None = None
        self._malformed_pauses = MalformedRows()
        if ensure_schema:
            self.store.create_schema()

    def close(self) -> None:
        """Release connections."""
        self.rt.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- keys ---------------------------------------------------------------------------------
    def spec(self, target: Target) -> TaskSpec:
        """The task method `target` names: the registered one, a declared signature
        (`keyexpiry.signature`), or, named as "Class.method" in a process without that class
        (a producer), one that encodes arguments by their own types for the listener to check
        (`Registry.by_name`)."""
        if callable(target):
            return self.registry.spec_for(target)
        class_name, sep, method = target.replace("@", ".").partition(".")
        if not sep:
            raise UnknownTaskError(f"{clip(target)}: name a task as 'Class.method'")
        try:
            return self.registry.by_name(class_name, method)
        except KeyFormatError as exc:  # a name no key can hold
            raise UnknownTaskError(str(exc)) from None

    def key_for(self, target: Target, *args: object) -> str:
        """The Redis key of `target(*args)`; checks the arguments against the signature."""
        spec = self.spec(target)
        return format_key(
            spec.class_name, spec.method, spec.encode_args(args), prefix=self.settings.key_prefix
        )

    # --- create -------------------------------------------------------------------------------
    def create(
        self,
        target: Target,
        *args: object,
        ttl_s: float | None = None,
        ttl_ms: int | None = None,
        at: dt.datetime | None = None,
        retry_schedule_s: Sequence[float] | None = None,
        tag: str | None = None,
        if_exists: Rule = "replace",
        tx: Tx | None = None,
        payload: Any = None,
    ) -> Scheduled:
        """Schedule `target(*args)` after `ttl_s` seconds, `ttl_ms` ms, or at datetime `at`.

        A task is its key: one row, one key. When the key has a row already, `if_exists` says
        what happens (`keyexpiry.ledger.if_exists`): "replace" (the default) reschedules it
        whatever its state, so exactly one run happens at or after the new due time; "keep" leaves a
        pending task's due time as it is; "earlier" / "later" move it only that way. A task that
        is not pending is scheduled anew under every rule; a run already claimed for the old due
        time (running, or claimed just before this) still happens, unrecorded, unless the
        listener had not read its claim back yet (a round trip on MySQL/MariaDB): then only the
        new run happens.

        Returns the key as a `Scheduled`: a `str` with `.outcome` ("created", "replaced",
        "moved" or "kept") and `.due_at_ms` (the task's due time afterwards). A kept task's key
        is left as it was.

        `tag`: a business key (`"order:218"`, 1 to 128 characters) to find and cancel tasks by
        (`list(tag=)`, `cancel_tag`); a reschedule without one keeps the task's tag.

        With `tx` (a SQLAlchemy `Connection` or `Session` on the ledger's database) the row is
        written in the caller's transaction and the key is set once that commits; a rollback
        leaves neither (`keyexpiry.ledger.transactions`).

        `payload`: any JSON-serialisable value (at most `payload_max_bytes`, 64 KiB by default)
        stored in the task's row, never in its key: the handler reads it as `current().payload`,
        or receives it in a parameter named `payload`, the same on every attempt. A reschedule
        without one keeps the task's payload, one with a payload replaces it; a create that
        `if_exists` keeps leaves the row, payload included, as it was.
        """
        request = TaskRequest(
            target,
            args,
            ttl_s,
            ttl_ms,
            at,
            retry_schedule_s,
            tag=tag,
            if_exists=if_exists,
            payload=payload,
        )
        return self.create_many([request], tx=tx)[0]

    def create_many(
        self, requests: Iterable[TaskRequest], *, tx: Tx | None = None
    ) -> list[Scheduled]:
        """Schedule many tasks with one ledger transaction and one Redis pipeline.

        One bad request means nothing is written: on MySQL/MariaDB the rows of the requests
        checked so far are sent while the rest are checked, in a transaction that a bad one
        rolls back. With `tx`, in the caller's transaction, as in `create`. A key requested
        twice counts once, as its last request says, in the place of its first. Returns one
        `Scheduled` per key.
        """
        now_ms = self._now_ms()
        batch = Batch(self.spec, self.settings, now_ms)
        # Read whole before the transaction: however slowly the caller makes its requests, the
        # transaction is open only while they are checked.
        requests = requests if isinstance(requests, Sequence) else list(requests)
        if tx is None and len(requests) > 1:
            rest = iter(requests)
            try:
                # Rows are sent while the requests after them are still being checked.
                with saying_what_was_recorded(lambda: list(batch.new)):
                    tasks, done = self.store.upsert_streamed(batch.plain(rest), now_ms)
            except NotPlain:
                batch.add_all(rest)  # rolled back: the general path below, with every request
            else:
                self._arm([(t.key, t.due_at_ms) for t in tasks], self._now_ms())
                return scheduled(tasks, done)
        else:
            batch.add_all(requests)
        tasks, rules, replace = list(batch.new.values()), batch.rules, IfExists.REPLACE
        order = [rules.get(t.key, replace) for t in tasks] if rules or tx is not None else []
        if tx is not None:
            with self._joined(tx) as conn:
                done = self.store.schedule_in(conn, tasks, order, now_ms)
                changed = [t.key for t, d in zip(tasks, done, strict=True) if d[0] is not Did.KEPT]
                if changed:
                    after_commit(conn, self._sync_keys, created=changed)
            return scheduled(tasks, done)
        # Row first: a row without a key is repaired by reconciliation; a key without a row
        # would never run. Armed by the time after the write, not before it: a task that fell
        # due while the ledger answered slowly is expired at once by its own lookup, rather
        # than left to a wake message and the driver (or Redis's sweep, seconds among many
        # keys) as one still in the future.
        keys = [t.key for t in tasks]
        if not rules:
            with saying_what_was_recorded(lambda: keys):
                done = self.store.upsert_pending(tasks, now_ms)
            self._arm([(t.key, t.due_at_ms) for t in tasks], self._now_ms())
        else:
            with saying_what_was_recorded(lambda: keys):
                done = self.store.schedule(tasks, order, now_ms)
            pairs = zip(tasks, done, strict=True)
            self._arm(
                [(t.key, t.due_at_ms) for t, d in pairs if d[0] is not Did.KEPT], self._now_ms()
            )
        return scheduled(tasks, done)

    # --- cancel / inspect ---------------------------------------------------------------------
    def cancel(self, target: Target, *args: object, tx: Tx | None = None) -> bool:
        """Cancel a pending task; False if it was not pending (already running, done, or absent).

        With `tx`, in the caller's transaction: the key is deleted once that commits, and a
        rollback leaves the task pending."""
        spec = self.spec(target)
        key = self.key_for(target, *args)
        # Before braces were escaped (a hash tag on a cluster), such a key had them literally.
        keys = {key, braces_unescaped(key, self.settings.key_prefix)}
        # A task created before keys were canonical may still be pending under its old spelling.
        keys.add(
            format_key(
                spec.class_name,
                spec.method,
                spec.legacy_args(args),
                prefix=self.settings.key_prefix,
            )
        )
        return bool(self.cancel_keys(sorted(keys), tx=tx))

    def cancel_keys(self, keys: Sequence[str], *, tx: Tx | None = None) -> list[str]:
        """Cancel those of `keys` that are pending; return the ones cancelled (with `tx`, in
        the caller's transaction, as in `cancel`)."""
        if tx is not None:
            with self._joined(tx) as conn:
                cancelled = self.store.cancel_in(conn, keys, self._now_ms())
                if cancelled:
                    after_commit(conn, self._sync_keys, cancelled=cancelled)
            return cancelled
        cancelled = self.store.cancel(keys, self._now_ms())
        self._delete_keys(cancelled)
        return cancelled

    def cancel_tag(self, tag: str) -> int:
        """Cancel every pending task tagged `tag` (and delete their keys); return how many.

        Each task is cancelled as `cancel` cancels one: those already running, done or gone are
        left as they are and not counted.
        """
        checked = check_tag(tag, ArgumentError)
        if checked is None:
            raise ArgumentError("cancel_tag needs a tag, got None")
        cancelled = self.store.cancel_tag(checked, self._now_ms())
        self._delete_keys(cancelled)
        return len(cancelled)

    def _delete_keys(self, keys: Sequence[str]) -> None:
        try:
            # The ledger decided; a leftover key only makes an event that claims nothing.
            for start in range(0, len(keys), 1000):
                self.redis.delete(*keys[start : start + 1000])
        except redis.RedisError:
            pass

    # --- retry --------------------------------------------------------------------------------
    def retry(self, target: Target, *args: object, at: dt.datetime | None = None) -> bool:
        """Run a dead task again (or one failed and waiting for its next attempt) now, or at
        `at`: attempts start again from zero, its earlier errors stay on the row. False if it
        is not dead or waiting (pending on its first attempt, running, done, or absent)."""
        return bool(self.retry_keys([self.key_for(target, *args)], at=at))

    def retry_keys(self, keys: Sequence[str], *, at: dt.datetime | None = None) -> list[str]:
        """`retry` by key; returns the keys requeued."""
        now_ms = self._now_ms()
        due = now_ms if at is None else due_at_ms(now_ms, at=at)
        requeued = self.store.retry(keys, due_at_ms=due, now_ms=now_ms)
        self._arm([(k, due) for k in requeued], now_ms)
        return requeued

    def retry_dead(
        self,
        *,
        class_name: str | None = None,
        since: dt.datetime | None = None,
        at: dt.datetime | None = None,
        progress: Callable[[int, int], None] | None = None,
        page_rows: int = 500,
    ) -> int:
        """Retry every dead task (of `class_name`, dead since `since`); returns how many.

        Walks the dead rows by id a page at a time (one transaction and one pipeline per page);
        `progress(done, total)` is called after each page.
        """
        since_ms = None
        if since is not None:
            since_ms = due_at_ms(0, at=since)
        total = self.store.count_dead(class_name=class_name, since_ms=since_ms)
        done = after_id = 0
        while True:
            page = self.store.dead_page(
                after_id=after_id, limit=page_rows, class_name=class_name, since_ms=since_ms
            )
            if not page:
                return done
            after_id = page[-1][0]
            done += len(self.retry_keys([k for _, k in page], at=at))
            if progress is not None:
                progress(done, max(total, done))

    def run_now(self, keys: Sequence[str]) -> list[str]:
        """Make those of `keys` that are pending due now (their key expires at once); returns
        the keys moved."""
        now_ms = self._now_ms()
        moved = self.store.due_now(list(keys), now_ms=now_ms)
        self._arm([(k, now_ms) for k in moved], now_ms)
        return moved

    def get(self, target: Target, *args: object) -> TaskRow | None:
        """The ledger row of `target(*args)`, or None."""
        return self.store.get(self.key_for(target, *args))

    def ttl_ms(self, target: Target, *args: object) -> int | None:
        """Milliseconds until the task's key expires; None if the key does not exist."""
        try:
            pttl = int(self.redis.pttl(self.key_for(target, *args)))
        except redis.RedisError as exc:
            raise RedisUnavailableError(f"Redis: {exc}") from None
        return pttl if pttl >= 0 else None

    def ttl_s(self, target: Target, *args: object) -> float | None:
        """Seconds until the task's key expires; None if the key does not exist."""
        ms = self.ttl_ms(target, *args)
        return None if ms is None else ms / 1000.0

    def list_tasks(
        self, status: Status | None = None, limit: int = 50, *, tag: str | None = None
    ) -> list[TaskRow]:
        """Ledger rows by due time: of one status (`TaskStatus` or its name, `"done"`), of one
        tag, or both; at most `limit` (1 to `limits.MAX_LIST_ROWS`)."""
        wanted = task_status(status, ArgumentError)
        count = list_limit(limit, ArgumentError)
        return self.store.list_tasks(wanted, count, tag=check_tag(tag, ArgumentError))

    def list(
        self, *, tag: str | None = None, status: Status | None = None, limit: int = 50
    ) -> builtins.list[TaskRow]:
        """Ledger rows by due time (`list_tasks` by keyword): `ke.list(tag="order:218")`."""
        return self.list_tasks(status, limit, tag=tag)

    # --- pause / resume -----------------------------------------------------------------------
    def pause(
        self,
        target: PauseTarget,
        *,
        until: dt.datetime | None = None,
        for_s: float | None = None,
        reason: str | None = None,
    ) -> Pause:
        """Hold back every task of `target` across the fleet, from now until `until` (a
        timezone-aware datetime in the future), for `for_s` seconds, or, with neither, until
        `resume`. Tasks fall due as usual and wait, pending; they run once the pause ends.

        `target`: `"Class"` (each of its methods) or `"Class.method"`, or the class or exposed
        method itself. A class this process has not registered may be named (a producer does
        not import the handlers); the name must be one a task key can hold. Pausing a target
        again replaces its end and `reason` (at most 255 characters, one line).

        The pause is a ledger row, so it outlives every listener's restart; listeners are told
        on Redis's wake channel to read it at once (if that message is lost, they read it within
        a second). Returns the pause as recorded.
        """
        name = self._pause_target(target)
        if until is not None and for_s is not None:
            raise ArgumentError("give at most one of until and for_s")
        checked_reason = check_reason(reason)
        now_ms = self._now_ms()
        until_ms = None
        if until is not None:
            until_ms = pause_until_ms(until, now_ms)
        elif for_s is not None:
            seconds = limits.number(
                for_s,
                "for_s",
                low=0,
                high=limits.MAX_HORIZON_S,
                error=ArgumentError,
                above_low=True,
            )
            until_ms = now_ms + max(1, round(seconds * 1000))
        self.store.pause(name, until_ms=until_ms, now_ms=now_ms, reason=checked_reason)
        self._announce_pauses()
        return Pause(name, until_ms, now_ms, checked_reason)

    def resume(self, target: PauseTarget) -> bool:
        """End the pause of `target` (named as in `pause`); True if it was paused, False if it
        was not (or its pause had already ended). Its held-back tasks run at once.

        Resuming `"Class"` ends the class's own pause, not those of its methods."""
        name = self._pause_target(target)
        was_paused = self.store.resume(name, now_ms=self._now_ms())
        self._announce_pauses()
        return was_paused

    def paused(self) -> builtins.list[Pause]:
        """The pauses in force now, sorted by target. A malformed pause row (written by hand
        or by another program) pauses nothing: it is left out, and logged once."""
        read = self.read_pauses()
        for bad in read.malformed:
            self._malformed_pauses.report(
                f"keyexpiry_pause {bad.target}", bad.problem, "no pause: skipped"
            )
        return read.pauses

    def read_pauses(self) -> PausesRead:
        """The pauses in force now, sorted by target, and the malformed pause rows left out
        (`PausesRead.malformed`: each one's target and what is wrong with it)."""
        return self.store.read_pauses(self._now_ms())

    def held(self) -> dict[str, dict[str, int]]:
        """What the listeners hold back now, summed over the fleet: task (`Class.method`) →
        reason (`paused`, `limit`, `rate`, `group`) → how many tasks. Each listener publishes
        its own counts in Redis; one silent for longer than a takeover counts for nothing."""
        stale_s = max(3 * self.settings.heartbeat_s, self.settings.takeover_after_s)
        try:
            return held_counts(
                self.redis, self.settings.key_prefix, self._now_ms(), stale_ms=int(stale_s * 1000)
            )
        except redis.RedisError as exc:
            raise RedisUnavailableError(f"Redis: {exc}") from None

    def _pause_target(self, target: PauseTarget) -> str:
        """The name `target` gives a pause: checked text, or a registered class or method's."""
        if isinstance(target, str):
            return parse_target(target)
        if isinstance(target, type):
            for spec in self.registry.specs():
                if spec.cls is target:
                    return spec.class_name
            raise UnknownTaskError(f"{target.__qualname__} is not a registered task class")
        if callable(target):
            spec = self.registry.spec_for(target)
            return f"{spec.class_name}.{spec.method}"
        raise ArgumentError(
            f"a pause names 'Class' or 'Class.method', a task class or an exposed method, "
            f"got {type(target).__name__}"
        )

    def _announce_pauses(self) -> None:
        try:
            announce(self.redis, self.settings.key_prefix)
        except redis.RedisError as exc:
            # The row is the truth: listeners read it at their next poll, within a second.
            logger.debug("pause recorded, but the wake message was not sent: {}", exc)

    # --- internals ----------------------------------------------------------------------------
    @contextmanager
    def _joined(self, tx: Tx) -> Iterator[Connection]:
        """The connection of the caller's transaction (or of Django's, `transactions.joined`),
        checked to be on the ledger's database."""
        with joined(tx) as conn:
            if conn.engine is not self.store.engine:
                if self._ledger_identity is None:
                    self._ledger_identity = self.store.identity()
                check_same_database(conn, self.store.engine, self._ledger_identity)
            yield conn

    def _sync_keys(self, created: set[str], cancelled: set[str]) -> None:
        """After the caller's commit: arm the keys whose rows are pending now, at their due
        time, and delete those of cancelled rows that are no longer pending. What the ledger
        holds decides, not what was written: a rolled-back SAVEPOINT may have undone it."""
        keys = sorted(created | cancelled)
        rows = self.store.get_many(keys)
        pending = {k: r.due_at_ms for k, r in rows.items() if r.status is TaskStatus.PENDING}
        gone = [k for k in cancelled if k not in pending]
        if pending:
            self._arm(sorted(pending.items()), self._now_ms())
        if gone:
            try:
                self.redis.delete(*gone)
            except redis.RedisError:
                pass  # as in `cancel_keys`: an event without a pending row claims nothing

    def _now_ms(self) -> int:
        try:
            return self.clock.now_ms()
        except redis.RedisError as exc:
            raise RedisUnavailableError(f"Redis is not reachable: {exc}") from None

    def _arm(self, items: Sequence[tuple[str, int]], now_ms: int) -> None:
        try:
            self.rt.arm(items, now_ms)
        except redis.RedisError as exc:
            raise RedisUnavailableError(
                f"task recorded in the ledger but its Redis key was not set ({exc}); "
                "reconciliation will set it, or create it again"
            ) from None
