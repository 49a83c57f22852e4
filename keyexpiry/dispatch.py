"""Claim, run, record, retry: everything between "this key expired" and a recorded outcome.

Three kinds of thread keep the subscription free of database and handler latency:
- the claimer drains submitted keys and claims them in batches (one transaction per batch);
- a bounded pool of workers runs handlers, with a watchdog that fails runs past their timeout;
- the recorder writes outcomes in batches and re-arms keys for retries.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import redis
from loguru import logger

from keyexpiry import limits, retries, threads
from keyexpiry.clock import monotonic_s
from keyexpiry.context import TaskContext, set_current
from keyexpiry.errors import (
    ArgumentError,
    DoNotRetry,
    KeyExpiryError,
    Retry,
    StoreError,
    UnknownTaskError,
)
from keyexpiry.keys import excerpt, parse_key
from keyexpiry.registry import TaskSpec
from keyexpiry.runtime import Runtime
from keyexpiry.store import Outcome, TaskRow, TaskStatus

if TYPE_CHECKING:
    from loguru import Logger

_ERROR_MAX_CHARS = 8000
# Claims may run ahead of the workers by about this much queued work, so the claimer's round trip
# is paid per batch, not per worker slot; the queue stays short enough that a claim's lease
# rarely needs extending before its handler starts.
_QUEUE_TARGET_S = 0.25


@dataclass(eq=False)
class _Run:
    row: TaskRow
    token: str
    spec: TaskSpec
    timeout_s: float
    lease_until_ms: int
    started_s: float | None = None
    abandoned: bool = False


@dataclass
class DispatchStats:
    """Counters since start, for status output, tests and the benchmark."""

    submitted: int = 0
    claimed: int = 0
    done: int = 0
    retried: int = 0
    dead: int = 0
    timed_out: int = 0
    not_claimed: int = 0
    already_queued: int = 0
    """Submissions dropped because the key was still waiting for its claim."""
    leases_extended: int = 0
    claims_lost: int = 0
    ignored: int = 0
    store_errors: int = 0
    by_key: collections.Counter[str] = field(default_factory=collections.Counter)


class Dispatcher:
    """Runs submitted task keys once per claim on a bounded worker pool."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.store, self.redis, self.clock = rt.store, rt.redis, rt.clock
        self.registry, self.settings, self.owner = rt.registry, rt.settings, rt.owner
        self.stats = DispatchStats()
        self._incoming: queue.SimpleQueue[str] = queue.SimpleQueue()
        # Keys in _incoming or _backlog: a key seen twice before its claim (its event and a
        # reconciliation after a reconnect) is claimed once, not once per sighting.
        self._queued: set[str] = set()
        self._queued_lock = threading.Lock()
        self._runq: queue.SimpleQueue[_Run | None] = queue.SimpleQueue()
        self._outcomes: list[Outcome] = []
        self._cond = threading.Condition()
        self._inflight = 0  # claimed and not yet finished (queued or running)
        self._running: dict[int, _Run] = {}
        self._recording = 0
        self._backlog: collections.deque[str] = collections.deque()
        self._claiming = False
        self._stop_claiming = threading.Event()
        self._stopped = threading.Event()
        self._seq = itertools.count(1)
        self._threads: list[threading.Thread] = []
        self._warned_unknown: set[str] = set()
        self._run_s_avg: float | None = None  # moving average of handler run time
        self.thread_errors = threads.ThreadErrors()
        """Unexpected exceptions the dispatcher's threads survived."""

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the claimer, the recorder, the watchdog and the worker pool."""
        for name, target in (
            ("claimer", self._claim_loop),
            ("recorder", self._record_loop),
            ("watchdog", self._watchdog_loop),
        ):
            self._spawn(name, target)
        for _ in range(self.settings.concurrency):
            self._spawn("worker", self._worker_loop)

    def submit(self, keys: Iterable[str]) -> None:
        """Queue task keys whose expiry (or overdue state) was seen; never blocks."""
        keys = list(keys)  # may be lazy: never read it under the lock
        with self._queued_lock:
            for key in keys:
                self.stats.submitted += 1
                if key in self._queued:
                    self.stats.already_queued += 1
                    continue
                self._queued.add(key)
                self._incoming.put(key)

    def stop(self, timeout_s: float) -> None:
        """Stop claiming, let running handlers finish for up to `timeout_s`, release the rest."""
        self._stop_claiming.set()
        deadline = monotonic_s() + timeout_s
        while self._claiming and monotonic_s() < deadline:
            time.sleep(0.01)
        unstarted: list[_Run] = []
        while True:
            try:
                item = self._runq.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                unstarted.append(item)
        self._release(unstarted)
        for _ in range(self.settings.concurrency):
            self._runq.put(None)
        with self._cond:
            while self._running and monotonic_s() < deadline:
                self._cond.wait(0.05)
            if self._running:
                logger.warning(
                    "{} handler(s) still running at shutdown; their leases will expire and "
                    "reconciliation will run them again",
                    len(self._running),
                )
        flush_deadline = max(deadline, monotonic_s() + 5.0)
        self._flush_outcomes(deadline=flush_deadline)
        with self._cond:
            # The recorder may have taken the last batch just before us: wait for its write.
            while self._recording and monotonic_s() < flush_deadline:
                self._cond.wait(0.05)
        self._stopped.set()
        with self._cond:
            self._cond.notify_all()

    def backlog(self) -> int:
        """Keys submitted and not yet claimed (or found not claimable)."""
        return self._incoming.qsize() + len(self._backlog)

    def idle(self) -> bool:
        """Nothing queued, claimed, running or waiting to be recorded."""
        with self._cond:
            return (
                self._incoming.empty()
                and not self._backlog
                and not self._claiming
                and self._inflight == 0
                and not self._outcomes
                and self._recording == 0
            )

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until `idle()`; False on timeout. A sync point for tests and the demo."""
        deadline = monotonic_s() + timeout_s
        while monotonic_s() < deadline:
            if self.idle():
                return True
            time.sleep(0.005)
        return self.idle()

    # --- claimer ------------------------------------------------------------------------------
    def _claim_loop(self) -> None:
        backoff_s = self.settings.reconnect_initial_s
        while not self._stop_claiming.is_set():
            if not self._backlog:
                try:
                    self._backlog.append(self._incoming.get(timeout=0.1))
                except queue.Empty:
                    continue
            with self._cond:
                self._claiming = True
                while self._inflight >= self._claim_limit():
                    if self._stop_claiming.is_set():
                        break
                    self._cond.wait(0.1)
                room = min(self._claim_limit() - self._inflight, self.settings.claim_batch)
            if self._stop_claiming.is_set():
                self._claiming = False
                break
            self._drain_incoming()
            batch: list[str] = []
            with self._queued_lock:
                # Off the queue before the claim: a sighting during the claim (the task moved
                # and fell due again) queues the key anew.
                while self._backlog and len(batch) < room:
                    batch.append(key := self._backlog.popleft())
                    self._queued.discard(key)
            try:
                self._claim_batch(batch)
                backoff_s = self.settings.reconnect_initial_s
            except Exception as exc:
                # Whatever the failure, the claimer lives on and the keys stay queued: a dead
                # claimer would leave them marked queued, and every later sighting ignored.
                self.stats.store_errors += 1
                self._requeue(batch)
                if isinstance(exc, StoreError | redis.RedisError):
                    logger.error(
                        "claiming {} task(s) failed: {}; retrying in {:.1f} s",
                        len(batch),
                        exc,
                        backoff_s,
                    )
                else:
                    self.thread_errors.add("claimer")
                    logger.exception(
                        "claiming {} task(s) failed; retrying in {:.1f} s", len(batch), backoff_s
                    )
                self._stop_claiming.wait(backoff_s)
                backoff_s = min(backoff_s * 2, self.settings.reconnect_max_s)
            finally:
                self._claiming = False

    def _claim_limit(self) -> int:
        """How many claimed runs may be in flight: the workers plus a short queue ahead of them.

        The queue is sized from the measured run time so it holds about `_QUEUE_TARGET_S` of work:
        hundreds for trivial handlers, none beyond the pool for slow ones.
        """
        workers = self.settings.concurrency
        avg = self._run_s_avg
        if avg is None:
            return workers * 2
        ahead = int(workers * _QUEUE_TARGET_S / max(avg, 1e-4))
        return workers + min(ahead, self.settings.claim_batch)

    def _requeue(self, keys: list[str]) -> None:
        """Put keys whose claim failed back at the head of the queue (unless queued again)."""
        with self._queued_lock:
            again = [k for k in keys if k not in self._queued]
            self._queued.update(again)
            self._backlog.extendleft(reversed(again))

    def _drain_incoming(self) -> None:
        limit = self.settings.claim_batch * 4
        while len(self._backlog) < limit:
            try:
                self._backlog.append(self._incoming.get_nowait())
            except queue.Empty:
                return

    def _claim_batch(self, keys: list[str]) -> None:
        specs: dict[str, TaskSpec] = {}
        for key in keys:
            spec = self._spec_for_key(key)
            if spec is not None:
                specs[key] = spec
        if not specs:
            return
        now_ms = self.clock.now_ms()
        timeout_s = max(self._timeout_s(s) for s in specs.values())
        lease_until_ms = now_ms + int((timeout_s + self.settings.lease_grace_s) * 1000)
        token = f"{self.owner}:{next(self._seq)}"
        locked: set[str] = set()
        try:
            rows = self.store.claim(
                list(specs), now_ms=now_ms, lease_until_ms=lease_until_ms, token=token
            )
        except StoreError as exc:
            if not exc.lock_timeout:
                raise
            rows, locked = self._claim_around_locks(list(specs), exc, now_ms, lease_until_ms, token)
        self.stats.claimed += len(rows)
        with self._cond:
            self._inflight += len(rows)
        for row in rows:
            spec = specs[row.key]
            self._runq.put(_Run(row, token, spec, self._timeout_s(spec), lease_until_ms))
        claimed = {r.key for r in rows}
        # A locked row is left to the overdue check: re-armed now, it would come straight back
        # and wait on the lock again.
        unclaimed = [k for k in specs if k not in claimed and k not in locked]
        if unclaimed:
            self.stats.not_claimed += len(unclaimed)
            self._check_unclaimed(unclaimed)

    def _claim_around_locks(
        self, keys: list[str], exc: StoreError, now_ms: int, lease_until_ms: int, token: str
    ) -> tuple[list[TaskRow], set[str]]:
        """Another transaction held one of these rows past the lock wait timeout: claim the keys
        one by one so only the locked rows are left behind, pending. Retrying those at once would
        keep the claimer waiting on the lock; the overdue check offers them again later.
        Returns the rows claimed and the keys found locked.
        """
        self.stats.store_errors += 1
        if len(keys) == 1:
            _log_locked(keys[0], exc)
            return [], set(keys)
        logger.warning(
            "claiming {} task(s) waited too long on a row lock ({}); claiming them one by one",
            len(keys),
            exc,
        )
        rows: dict[int, TaskRow] = {}  # each claim returns every row held under the token
        locked: set[str] = set()
        for i, key in enumerate(keys):
            try:
                claimed = self.store.claim(
                    [key], now_ms=now_ms, lease_until_ms=lease_until_ms, token=token
                )
                rows.update((r.id, r) for r in claimed)
            except StoreError as err:
                if not err.lock_timeout:
                    # The rows claimed so far must still run; the rest waits in the backlog.
                    logger.error("claiming {} task(s) failed: {}", len(keys) - i, err)
                    self._requeue(keys[i:])
                    break
                _log_locked(key, err)
                locked.add(key)
        return list(rows.values()), locked

    def _spec_for_key(self, key: str) -> TaskSpec | None:
        try:
            parsed = parse_key(key, prefix=self.settings.key_prefix)
            return self.registry.resolve(parsed.class_name, parsed.method)
        except UnknownTaskError as exc:
            self.stats.ignored += 1
            self._note_unknown(key, exc)
            return None
        except KeyExpiryError as exc:
            self.stats.ignored += 1
            logger.bind(key=excerpt(key), attempt=0).warning("ignored key: {}", exc)
            return None

    def _note_unknown(self, key: str, exc: UnknownTaskError) -> None:
        """Say once per unknown class (or method), not once per key of another app's
        `user@bob`, what becomes of such a key: a real task waits for a listener that has its
        class; a key with no ledger row was never a task."""
        if str(exc) in self._warned_unknown:
            return
        self._warned_unknown.add(str(exc))
        log = logger.bind(key=key, attempt=0)
        try:
            row = self.store.get(key)
        except StoreError:
            row = None
        if row is None:
            log.info("{}; no ledger row either: ignored", exc)
        elif row.status is TaskStatus.PENDING:
            log.warning("{}; left pending for a listener that has it", exc)
        else:
            log.info("{}; the task is {}: nothing to do", exc, row.status)

    def _check_unclaimed(self, keys: list[str]) -> None:
        """Explain keys that were not claimed, and re-arm a pending task whose key is gone."""
        rows = self.store.get_many(keys)
        rearm: list[TaskRow] = []
        for key in keys:
            row = rows.get(key)
            log = logger.bind(key=key, attempt=row.attempts if row else 0)
            if row is None:
                log.info("no ledger row for this key; ignored")
            elif row.status is TaskStatus.PENDING:
                # A stale event (task rescheduled), this host's clock a hair behind Redis's, or
                # a row that fell due since the claim: if its key is gone, nothing else would
                # announce it (a due time already past expires at once).
                rearm.append(row)
            else:
                log.debug("not claimed: task is {}", row.status)
        if rearm:
            existing = self.redis.pipeline(transaction=False)
            for row in rearm:
                existing.exists(row.key)
            present = existing.execute()
            missing = [r for r, p in zip(rearm, present, strict=True) if not p]
            self.rt.arm([(r.key, r.due_at_ms) for r in missing], self.clock.now_ms())

    def _timeout_s(self, spec: TaskSpec) -> float:
        return retries.timeout_s(spec.options, self.settings)

    # --- workers ------------------------------------------------------------------------------
    def _worker_loop(self) -> None:
        while True:
            run = self._runq.get()
            if run is None:
                return
            try:
                if self._execute(run):
                    return  # timed out: the watchdog started a replacement; this thread retires
            except Exception as exc:
                self._run_broke(run, exc)

    def _run_broke(self, run: _Run, exc: Exception) -> None:
        """Something other than the handler raised around a run (a bug, or a value that slipped
        past every check): count it, record the run as failed if that still works, else leave
        it to its lease. The worker lives on either way."""
        self.thread_errors.add("worker")
        log = logger.bind(key=run.row.key, attempt=run.row.attempts)
        log.opt(exception=exc).error("unexpected error around this run; the worker carries on")
        with self._cond:
            if run.abandoned:
                return  # the watchdog already failed it
            if run.started_s is not None and run.row.id not in self._running:
                return  # its outcome is already queued: the error came after it
            self._running.pop(run.row.id, None)
            self._inflight -= 1
            self._cond.notify_all()
        try:
            outcome = self._failure(run, f"{type(exc).__name__} around the handler: {exc}")
        except Exception:
            log.error("could not record the failure; the run is retried when its lease ends")
            return
        with self._cond:
            self._outcomes.append(outcome)
            self._cond.notify_all()

    def _execute(self, run: _Run) -> bool:
        row = run.row
        log = logger.bind(key=row.key, attempt=row.attempts)
        started_ms = self.clock.now_ms()
        if not self._lease_covers(run, started_ms, log):
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()
            return False
        with self._cond:
            run.started_s = monotonic_s()
            self._running[row.id] = run
        outcome: Outcome
        try:
            if row.problem is not None:
                raise ArgumentError(f"ledger row {row.id}: {row.problem}")
            args = run.spec.decode_args(row.args)
        except KeyExpiryError as exc:
            outcome = self._outcome(run, TaskStatus.DEAD, f"not runnable: {exc}")
            log.error("not runnable: {}", exc)
        else:
            set_current(
                TaskContext(row.key, row.attempts, row.due_at_ms, self.store.engine, started_ms)
            )
            try:
                # Every line the handler logs carries its key and attempt too.
                with logger.contextualize(key=row.key, attempt=row.attempts):
                    run.spec.bind()(*args)
            except DoNotRetry as exc:
                outcome = self._outcome(run, TaskStatus.DEAD, f"DoNotRetry: {exc}")
                log.warning("failed, not retrying: {}", exc)
            except Retry as exc:
                outcome = self._failure(run, f"Retry: {exc}", delay_s=exc.delay_s)
            except Exception as exc:
                text = "".join(traceback.format_exception(exc))[-_ERROR_MAX_CHARS:]
                outcome = self._failure(run, text)
                log.opt(exception=exc).warning("handler raised {}: {}", type(exc).__name__, exc)
            else:
                outcome = self._outcome(run, TaskStatus.DONE, None)
            finally:
                set_current(None)
        with self._cond:
            if run.abandoned:
                log.warning("abandoned run returned after its timeout; its result is discarded")
                return True
            self._running.pop(row.id, None)
            self._inflight -= 1
            self._outcomes.append(outcome)
            took_s = monotonic_s() - run.started_s
            avg = self._run_s_avg
            self._run_s_avg = took_s if avg is None else avg + 0.05 * (took_s - avg)
            self._cond.notify_all()
        if outcome.status is TaskStatus.DONE and outcome.finished_at_ms is not None:
            log.info(
                "done in {} ms, started {} ms after due",
                outcome.finished_at_ms - (row.started_at_ms or outcome.finished_at_ms),
                (row.started_at_ms or 0) - row.due_at_ms,
            )
        return False

    def _lease_covers(self, run: _Run, now_ms: int, log: Logger) -> bool:
        """Make sure the claim's lease outlasts this run; False if the claim was lost meanwhile.

        A run that waited in the queue may start with less lease left than its timeout; without
        an extension another listener could take it over mid-run and run it a second time.
        """
        grace_ms = int(self.settings.lease_grace_s * 1000)
        needed_ms = now_ms + int(run.timeout_s * 1000) + grace_ms // 2
        if run.lease_until_ms >= needed_ms:
            return True
        until_ms = now_ms + int(run.timeout_s * 1000) + grace_ms
        try:
            kept = self.store.extend_lease(run.row.id, run.token, until_ms, now_ms)
        except StoreError as exc:
            # Unknown whether the lease still holds: give the run back to reconciliation rather
            # than risk a second copy running.
            log.warning("could not extend a late-starting claim's lease: {}; not running", exc)
            self.stats.claims_lost += 1
            return False
        if not kept:
            log.warning("claim lost while queued (its lease ran out); not running it here")
            self.stats.claims_lost += 1
            return False
        run.lease_until_ms = until_ms
        self.stats.leases_extended += 1
        return True

    def _outcome(self, run: _Run, status: TaskStatus, error: str | None) -> Outcome:
        now_ms = self.clock.now_ms()
        return Outcome(
            task_id=run.row.id,
            key=run.row.key,
            token=run.token,
            status=status,
            finished_at_ms=now_ms,
            due_at_ms=run.row.due_at_ms,
            last_error=error,
        )

    def _failure(self, run: _Run, error: str, *, delay_s: float | None = None) -> Outcome:
        row = run.row
        schedule = retries.schedule_s(row.retry_schedule_s, run.spec.options, self.settings)
        retries_used = row.attempts - 1
        log = logger.bind(key=row.key, attempt=row.attempts)
        if retries_used >= len(schedule):
            log.error("out of attempts ({}); task is dead", row.attempts)
            return self._outcome(run, TaskStatus.DEAD, error)
        delay = schedule[retries_used]
        if delay_s is not None:
            try:
                delay = limits.number(
                    delay_s, "Retry(delay_s)", low=0, high=limits.MAX_DELAY_S, error=ArgumentError
                )
            except ArgumentError as exc:
                log.warning("{}; retrying on the schedule instead ({:g} s)", exc, delay)
        due = self.clock.now_ms() + int(delay * 1000)
        log.info("will retry in {:g} s", delay)
        return Outcome(row.id, row.key, run.token, TaskStatus.PENDING, None, due, error)

    # --- watchdog -----------------------------------------------------------------------------
    def _watchdog_loop(self) -> None:
        while not self._stopped.is_set():
            next_deadline = self._fail_late_runs(monotonic_s())
            self._stopped.wait(max(0.005, min(next_deadline - monotonic_s(), 0.5)))

    def _fail_late_runs(self, now: float) -> float:
        """Record runs past their timeout as failed; return when the next one is due to end."""
        late: list[_Run] = []
        next_deadline = now + 0.5
        with self._cond:
            for run in self._running.values():
                assert run.started_s is not None
                deadline = run.started_s + run.timeout_s
                if deadline <= now:
                    late.append(run)
                else:
                    next_deadline = min(next_deadline, deadline)
            for run in late:
                run.abandoned = True
                self._running.pop(run.row.id, None)
                self._inflight -= 1
                self.stats.timed_out += 1
            if late:
                self._cond.notify_all()
        for run in late:
            log = logger.bind(key=run.row.key, attempt=run.row.attempts)
            log.error(
                "handler exceeded its timeout of {:g} s; recorded as failed "
                "(its thread is abandoned)",
                run.timeout_s,
            )
            self._spawn("worker", self._worker_loop)
            try:
                outcome = self._failure(run, f"TimeoutError: handler exceeded {run.timeout_s:g} s")
            except Exception:
                self.thread_errors.add("watchdog")
                log.opt(exception=True).error(
                    "could not record the timeout; the run is retried when its lease ends"
                )
                continue
            with self._cond:
                self._outcomes.append(outcome)
                self._cond.notify_all()
        return next_deadline

    # --- recorder -----------------------------------------------------------------------------
    def _record_loop(self) -> None:
        while not self._stopped.is_set():
            with self._cond:
                if not self._outcomes:
                    self._cond.wait(0.05)
            self._flush_outcomes(deadline=None)

    def _flush_outcomes(self, deadline: float | None) -> None:
        backoff_s = self.settings.reconnect_initial_s
        while True:
            with self._cond:
                batch, self._outcomes = self._outcomes, []
                self._recording += len(batch)
            if not batch:
                return
            try:
                self.store.record(batch, self.clock.now_ms())
            except Exception as exc:
                if not isinstance(exc, StoreError | redis.RedisError):
                    # Not an outage: some outcome the database refuses. Write the rest one by one
                    # and leave that run to its lease, rather than retry the batch forever.
                    self.thread_errors.add("recorder")
                    logger.opt(exception=exc).error(
                        "recording {} outcome(s) failed unexpectedly; recording them one by one",
                        len(batch),
                    )
                    batch = self._record_one_by_one(batch)
                    if not batch:
                        continue
                    exc = StoreError(f"{len(batch)} outcome(s) not recorded")
                self.stats.store_errors += 1
                if isinstance(exc, StoreError) and exc.lock_timeout and len(batch) > 1:
                    written, batch = self._record_around_locks(batch)
                    self._after_record(written)
                    with self._cond:
                        self._recording -= len(written)
                        self._cond.notify_all()
                    if not batch:  # the lock went meanwhile: everything is written
                        continue
                with self._cond:
                    self._outcomes[:0] = batch
                    self._recording -= len(batch)
                if deadline is not None and monotonic_s() > deadline:
                    logger.error(
                        "could not record {} outcome(s) before shutdown: {}; their "
                        "leases will expire and they will run again",
                        len(batch),
                        exc,
                    )
                    return
                logger.error(
                    "recording {} outcome(s) failed: {}; retrying in {:.1f} s",
                    len(batch),
                    exc,
                    backoff_s,
                )
                time.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self.settings.reconnect_max_s)
                continue
            self._after_record(batch)
            with self._cond:
                self._recording -= len(batch)
                self._cond.notify_all()

    def _record_one_by_one(self, batch: list[Outcome]) -> list[Outcome]:
        """Record each outcome alone; drop (log, count) those that raise something other than a
        database outage, and return those still to write. Dropped runs stay `running` until
        their lease ends, then run again: at least once, never lost."""
        left: list[Outcome] = []
        written: list[Outcome] = []
        for outcome in batch:
            try:
                self.store.record([outcome], self.clock.now_ms())
                written.append(outcome)
            except (StoreError, redis.RedisError):
                left.append(outcome)
            except Exception:
                self.thread_errors.add("recorder")
                logger.bind(key=outcome.key, attempt=0).opt(exception=True).error(
                    "could not record this outcome; the run is retried when its lease ends"
                )
        self._after_record(written)
        with self._cond:
            self._recording -= len(batch) - len(left)
            self._cond.notify_all()
        return left

    def _record_around_locks(self, batch: list[Outcome]) -> tuple[list[Outcome], list[Outcome]]:
        """Another transaction held one of these rows past the lock wait timeout: record the
        outcomes one by one so only those of locked rows wait. Retrying the whole batch would
        hold every other outcome back until the lock goes, long enough for their leases to run
        out and their tasks to run a second time. Returns (written, still to write)."""
        logger.warning(
            "recording {} outcome(s) waited too long on a row lock; recording them one by one",
            len(batch),
        )
        written: list[Outcome] = []
        locked: list[Outcome] = []
        for i, outcome in enumerate(batch):
            try:
                self.store.record([outcome], self.clock.now_ms())
            except StoreError as err:
                if not err.lock_timeout:
                    return written, locked + batch[i:]  # the database went away: later
                logger.bind(key=outcome.key, attempt=0).warning(
                    "row locked by another transaction ({}); its outcome is kept and retried", err
                )
                locked.append(outcome)
                continue
            written.append(outcome)
        return written, locked

    def _after_record(self, batch: list[Outcome]) -> None:
        retries = [o for o in batch if o.status is TaskStatus.PENDING]
        for o in batch:
            log = logger.bind(key=o.key, attempt=0)
            if o.status is TaskStatus.DONE:
                self.stats.done += 1
                self.stats.by_key[o.key] += 1
                log.debug("done")
            elif o.status is TaskStatus.DEAD:
                self.stats.dead += 1
                self.stats.by_key[o.key] += 1
            else:
                self.stats.retried += 1
        if retries:
            try:
                items = [(o.key, o.due_at_ms) for o in retries]
                self.rt.arm(items, self.clock.now_ms())
            except redis.RedisError as exc:
                logger.warning(
                    "could not re-arm {} retry key(s): {}; reconciliation will", len(retries), exc
                )

    # --- shutdown -----------------------------------------------------------------------------
    def _release(self, runs: list[_Run]) -> None:
        if not runs:
            return
        by_token: dict[str, list[_Run]] = collections.defaultdict(list)
        for run in runs:
            by_token[run.token].append(run)
        now_ms = self.clock.now_ms()
        try:
            for token, group in by_token.items():
                self.store.release([r.row.id for r in group], token, now_ms)
            self.rt.arm([(r.row.key, r.row.due_at_ms) for r in runs], now_ms)
        except (StoreError, redis.RedisError) as exc:
            logger.warning(
                "could not release {} unstarted claim(s): {}; their leases will "
                "expire and reconciliation will run them",
                len(runs),
                exc,
            )
        with self._cond:
            self._inflight -= len(runs)
        logger.info("released {} claimed task(s) that had not started", len(runs))

    def _spawn(self, name: str, target: Callable[[], object]) -> None:
        self._threads.append(
            threads.spawn(name, target, stopped=self._stopped, errors=self.thread_errors)
        )


def _log_locked(key: str, exc: StoreError) -> None:
    logger.bind(key=key, attempt=0).warning(
        "row locked by another transaction ({}); left pending, the overdue check tries it again",
        exc,
    )
