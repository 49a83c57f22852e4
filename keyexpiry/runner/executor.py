"""Running claimed tasks: a bounded pool of workers calls the handlers, a watchdog fails runs past
their timeout, and each ended run becomes an outcome (done, retry at a time, or dead).

Long because a run's whole life on a worker is here (start checks, the call, transactional
runs, the outcome, the watchdog that abandons it): split, each part would reach into the others'
state under the same flight condition."""

from __future__ import annotations

import inspect
import threading
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from loguru import logger

from keyexpiry import limits, retries, threads, tracing
from keyexpiry.clock import Clock, iso_ms, monotonic_s
from keyexpiry.context import TaskContext, set_current
from keyexpiry.errors import ArgumentError, DoNotRetry, KeyExpiryError, Retry, StoreError
from keyexpiry.ledger.rows import MalformedRows, Occurrence, Outcome, TaskStatus
from keyexpiry.ledger.store import Store
from keyexpiry.log import Tally
from keyexpiry.results import encode_result
from keyexpiry.run_metrics import RunMetrics
from keyexpiry.runner.coroutines import CoroutineRunner
from keyexpiry.runner.gate import Gate
from keyexpiry.runner.inflight import ClaimedRun, DispatchStats, InFlight
from keyexpiry.runner.runq import Worker
from keyexpiry.runner.transactional import run_in_transaction
from keyexpiry.schedules.rules import plan_run
from keyexpiry.settings import Settings

if TYPE_CHECKING:
    from loguru import Logger

_ERROR_MAX_CHARS = 8000
AWAY_CHECK_S = 0.05
"""The watchdog looks this often whether the claimer's own run has gone on past
`HAND_OFF_AFTER_S` (`Claimer.hand_off`): with no key heard since, that is the next look."""
_OUTCOME_NAMES = {TaskStatus.DONE: "done", TaskStatus.PENDING: "retry", TaskStatus.DEAD: "dead"}
"""An outcome's status as the `outcome` label of keyexpiry_runs_total."""


def late_ms(started_ms: int, due_at_ms: int) -> int | None:
    """How late a run started, or None for a due time before 1970 (`limits.MIN_DUE_MS`), which
    keyexpiry never writes: a row so written is run as due now, and its ~9e18 ms would swamp
    the lateness histogram's sum for good (a later run's milliseconds vanish beside it)."""
    return None if due_at_ms < limits.MIN_DUE_MS else started_ms - due_at_ms


def ended(
    clock: Clock, run: ClaimedRun, status: TaskStatus, error: str | None, result: str | None = None
) -> Outcome:
    """The outcome of a run that finished for good (done or dead)."""
    return Outcome(
        task_id=run.row.id,
        key=run.row.key,
        token=run.token,
        status=status,
        finished_at_ms=clock.now_ms(),
        due_at_ms=run.row.due_at_ms,
        last_error=error,
        result=result,
        occurrence=run.occurrence,
    )


def succeeded(clock: Clock, settings: Settings, run: ClaimedRun, value: object) -> Outcome:
    """The outcome of a handler that returned `value`: done, the value kept as JSON.

    A value that cannot be kept (not JSON, or over `result_max_bytes`) still leaves the task
    done, with `last_error` saying why and no result: the handler's work is done, and running
    it again would repeat that work only to fail the same way.
    """
    result, why = encode_result(value, settings.result_max_bytes)
    if why is not None:
        logger.bind(key=run.row.key, attempt=run.row.attempts).warning("{}", why)
    return ended(clock, run, TaskStatus.DONE, why, result)


def failed(
    clock: Clock, settings: Settings, run: ClaimedRun, error: str, *, delay_s: float | None = None
) -> Outcome:
    """The outcome of a failed run: pending again after the schedule's next delay (or the
    handler's own `Retry(delay_s)` when it is in range), or dead once out of attempts."""
    row = run.row
    schedule = retries.schedule_s(row.retry_schedule_s, run.spec.options, settings)
    retries_used = row.attempts - 1
    log = logger.bind(key=row.key, attempt=row.attempts)
    if retries_used >= len(schedule):
        log.error("out of attempts ({}); task is dead", row.attempts)
        return ended(clock, run, TaskStatus.DEAD, error)
    delay = schedule[retries_used]
    if delay_s is not None:
        try:
            delay = limits.number(
                delay_s, "Retry(delay_s)", low=0, high=limits.MAX_DELAY_S, error=ArgumentError
            )
        except ArgumentError as exc:
            log.warning("{}; retrying on the schedule instead ({:g} s)", exc, delay)
    due = clock.now_ms() + int(delay * 1000)
    log.info("will retry in {:g} s", delay)
    return Outcome(
        row.id, row.key, run.token, TaskStatus.PENDING, None, due, error,
        occurrence=run.occurrence,
    )  # fmt: skip


class Executor:
    """The worker pool: each worker takes a claimed run, calls its handler, queues the outcome.

    A run of an `async def` handler is handed to `coroutines` instead: the worker does not wait
    for it, so coroutines in flight are bounded by `async_concurrency`, not by the workers.
    """

    def __init__(
        self,
        *,
        store: Store,
        clock: Clock,
        settings: Settings,
        metrics: RunMetrics,
        inflight: InFlight,
        stats: DispatchStats,
        errors: threads.ThreadErrors,
        stopped: threading.Event,
    ) -> None:
        """Leases extended, schedules read and transactional runs recorded in `store`; each
        run's start and end observed in `metrics`."""
        self.store, self.clock, self.settings, self.metrics = store, clock, settings, metrics
        self.inflight = inflight
        self._stats = stats
        self.errors = errors
        self.stopped = stopped
        self.stopping = stopped
        """Set when the listener begins to stop (the dispatcher hands in the claimer's stop):
        a run waiting for the ledger to extend its lease gives up then."""
        self._lease_waits = Tally(60.0)
        self.threads: list[threading.Thread] = []
        self.coroutines = CoroutineRunner(self, settings.async_concurrency)
        """Where `async def` handlers run: an event loop on a thread of its own."""
        self.gate: Gate | None = None
        """Flow control: a run whose method was paused after its claim is given back."""
        self.malformed = MalformedRows()
        """Where a claimed row that is malformed is said (once) and counted: a listener hands
        in its reconciler's, so a row its walk reported already is not said twice."""

    def spawn_worker(self) -> None:
        """One more worker (at start, and to replace one abandoned to a hung handler)."""
        self.threads.append(
            threads.spawn("worker", self._worker_loop, stopped=self.stopped, errors=self.errors)
        )

    def _worker_loop(self) -> None:
        me = Worker()
        try:
            while True:
                run = self.inflight.runq.get(me)
                if run is None:
                    return
                run.worker = me
                try:
                    if run.spec.is_async:
                        self.coroutines.submit(run)  # never waits: the worker takes the next
                    elif self._execute(run) or run.abandoned:
                        # Timed out (also when it then returned early, a schedule's read failing
                        # after its timeout): the watchdog started a replacement; this retires.
                        return
                except Exception as exc:
                    self.run_broke(run, exc)
                    if run.abandoned:
                        return  # as above: its replacement is running already
        finally:
            # Whatever ends this loop (`threads.spawn` restarts it after an error with a new
            # place in the queue), this one no longer counts as active.
            self.inflight.runq.lost(me)

    def run_here(self, run: ClaimedRun) -> bool:
        """Run a claimed sync run on the calling thread (the claimer's: `runner.claimer`);
        True when the watchdog abandoned it meanwhile (another thread claims now)."""
        run.inline = True
        inflight = self.inflight
        with inflight.inline_lock:
            inflight.inline += 1
        try:
            return self._execute(run) or run.abandoned
        except Exception as exc:
            self.run_broke(run, exc)
            return run.abandoned
        finally:
            with inflight.inline_lock:
                inflight.inline -= 1

    def run_broke(self, run: ClaimedRun, exc: Exception) -> None:
        """Something other than the handler raised around a run (a bug, or a value that slipped
        past every check): count it, record the run as failed if that still works, else leave
        it to its lease. The worker (or the event loop) lives on either way."""
        self.errors.add("worker")
        log = logger.bind(key=run.row.key, attempt=run.row.attempts)
        log.opt(exception=exc).error("unexpected error around this run; the worker carries on")
        if not self.inflight.broke(run):
            return  # failed by the watchdog, or its outcome queued before the error
        try:
            outcome = failed(
                self.clock, self.settings, run, f"{type(exc).__name__} around the handler: {exc}"
            )
        except Exception:
            log.error("could not record the failure; the run is retried when its lease ends")
            return
        self.inflight.add_outcome(outcome)

    def _execute(self, run: ClaimedRun) -> bool:
        """Run one claimed task with a sync handler; True when the watchdog abandoned it (this
        thread retires)."""
        prepared = self.begin(run)
        if prepared is None:
            return False
        call, ctx = prepared
        if run.spec.options.transactional:
            return self._execute_in_transaction(run, call, ctx)
        return not self.finish(run, self._call(run, call, ctx))

    def _call(self, run: ClaimedRun, call: Callable[[], Any], ctx: TaskContext) -> Outcome:
        """Call a sync handler with `ctx` as its `current()`; what it returned or raised, as an
        outcome."""
        result: object = None
        error: BaseException | None = None
        set_current(ctx)
        try:
            # Every line the handler logs carries its key and attempt too.
            with logger.contextualize(key=ctx.key, attempt=ctx.attempt):
                result = call()
            if inspect.isawaitable(result):
                _discard(result)
                error = TypeError("the handler returned an awaitable: declare it `async def`")
        except Exception as exc:
            error = exc
        finally:
            set_current(None)
        return self.settle(run, result, error)

    def _execute_in_transaction(
        self, run: ClaimedRun, call: Callable[[], Any], ctx: TaskContext
    ) -> bool:
        """`_execute` for a transactional handler (`keyexpiry.runner.transactional`)."""
        outcome = run_in_transaction(
            self.store,
            self.clock,
            run,
            self.inflight,
            lambda conn: self._call(run, call, replace(ctx, transaction=conn)),
            lambda why: failed(self.clock, self.settings, run, why),
        )
        if outcome is None:  # rolled back, nothing to record here
            if not self.inflight.broke(run):  # out of flight already: the watchdog failed it
                logger.bind(key=ctx.key, attempt=ctx.attempt).warning(
                    "abandoned run returned after its timeout; its transaction is rolled back"
                )
                return True
            self._stats.claims_lost += 1
            return False
        return not self.finish(run, outcome)

    def begin(self, run: ClaimedRun) -> tuple[Callable[[], Any], TaskContext] | None:
        """What comes before any handler call, sync or async: the lease made to cover the run,
        the run marked started (the watchdog times it from here), its arguments decoded.

        Returns the handler call (arguments bound) and its context; None when the run ended
        here: its claim was lost (dropped), or its row cannot run (recorded dead).
        """
        row = run.row
        log = logger.bind(key=row.key, attempt=row.attempts)
        started_ms = self.clock.now_ms()
        if self.gate is not None and self.gate.paused_now(run.spec):
            # Paused between its claim and its start: given back unstarted (no attempt).
            self._give_back_paused(run, started_ms, log)
            return None
        if not self._lease_covers(run, started_ms, log):
            self.inflight.dropped(run)
            return None
        self.inflight.started(run)
        late = late_ms(started_ms, row.due_at_ms)
        if late is not None:
            self.metrics.started(run.spec.label, late)
        if row.schedule_name is not None and not self._plan_occurrence(run, started_ms, log):
            return None
        if row.problem is not None:
            # Never run with what a malformed row says (which of its columns and its key its
            # writer meant, nothing tells): said once, counted, and recorded dead.
            self.malformed.report(
                row.key, row.problem, "recorded dead, not run", attempt=row.attempts
            )
            why = f"not runnable: ledger row {row.id}: {row.problem}"
            self.finish(run, ended(self.clock, run, TaskStatus.DEAD, why))
            return None
        try:
            args = run.spec.decode_args(row.args)
        except KeyExpiryError as exc:
            log.error("not runnable: {}", exc)
            self.finish(run, ended(self.clock, run, TaskStatus.DEAD, f"not runnable: {exc}"))
            return None
        # A due time before 1970 (written outside keyexpiry) is shown to the handler as the
        # earliest one keyexpiry writes: a time any datetime can hold.
        due_at_ms = max(row.due_at_ms, limits.MIN_DUE_MS)
        payload = row.payload
        ctx = TaskContext(
            row.key,
            row.attempts,
            due_at_ms,
            self.store.engine,
            started_ms,
            payload=payload,
            scheduled_for_ms=None if run.occurrence is None else run.occurrence.scheduled_for_ms,
        )
        spec = run.spec
        traced = tracing.run_span(spec.label, row.key, row.attempts, late, row.traceparent)

        def invoke() -> Any:
            # The instance is made inside the call: a constructor that raises is the handler's
            # failure, retried like any other.
            if spec.takes_payload:
                return spec.bind()(*args, payload=payload)
            return spec.bind()(*args)

        if spec.is_async:

            async def call_async() -> Any:
                with traced():
                    return await invoke()

            return call_async, ctx

        def call() -> Any:
            with traced():
                return invoke()

        return call, ctx

    def _plan_occurrence(self, run: ClaimedRun, now_ms: int, log: Logger) -> bool:
        """Which occurrence of its schedule `run` stands for (`keyexpiry.schedules.rules.plan_run`);
        False when it is not to run (a missed occurrence under `catch_up="none"`: recorded as
        skipped, and the schedule moves on). A schedule that is gone (removed, or not this
        key's) leaves a plain run; a ledger out of reach fails this attempt (retried)."""
        row = run.row
        assert row.schedule_name is not None
        try:
            sched = self.store.get_schedule(row.schedule_name)
        except StoreError as exc:
            # Its occurrence cannot be told: this attempt fails, and is retried per schedule.
            self.finish(
                run, failed(self.clock, self.settings, run, f"could not read its schedule: {exc}")
            )
            return False
        if sched is None or sched.task_key != row.key or sched.occurrence_ms is None:
            log.warning("schedule {!r} is gone: running as a plain task", row.schedule_name)
            return True
        if row.due_at_ms < sched.occurrence_ms:
            # Moved ahead of its occurrence (run now): an extra run; the occurrence stays next.
            run.occurrence = Occurrence(sched.name, row.due_at_ms, started_ms=now_ms, extra=True)
            return True
        plan = plan_run(
            sched.recurrence, sched.occurrence_ms, now_ms, sched.anchor_ms, sched.catch_up,
            sched.catch_up_max,
        )  # fmt: skip
        run.occurrence = Occurrence(
            sched.name, plan.scheduled_for_ms, skipped=not plan.run, started_ms=now_ms
        )
        if plan.missed:
            log.info(
                "schedule {}: occurrences missed since {} (at least {}); catch_up={}: {}",
                sched.name,
                iso_ms(sched.occurrence_ms),
                plan.missed,
                sched.catch_up,
                f"this run stands for {iso_ms(plan.scheduled_for_ms)}" if plan.run else "skipped",
            )
        if not plan.run:
            self.finish(run, ended(self.clock, run, TaskStatus.DONE, None))
            return False
        return True

    def _give_back_paused(self, run: ClaimedRun, now_ms: int, log: Logger) -> None:
        assert self.gate is not None
        try:
            self.store.release([run.row.id], run.token, now_ms)
        except StoreError as exc:
            log.warning("paused before it started; not given back ({}): runs after its lease", exc)
        else:
            log.info("paused before it started: given back, held until resumed")
            self.gate.hold_paused(run.spec, run.row.key)
        self.inflight.dropped(run)

    def settle(self, run: ClaimedRun, result: object, error: BaseException | None) -> Outcome:
        """What an ended handler call becomes, the same for sync and async handlers: returned
        (done), or raised (retried on the schedule, or dead: `DoNotRetry`, out of attempts).

        `result` is the handler's return value, kept with the row (`succeeded`).
        """
        log = logger.bind(key=run.row.key, attempt=run.row.attempts)
        if error is None:
            return succeeded(self.clock, self.settings, run, result)
        if isinstance(error, DoNotRetry):
            log.warning("failed, not retrying: {}", error)
            return ended(self.clock, run, TaskStatus.DEAD, f"DoNotRetry: {error}")
        if isinstance(error, Retry):
            return failed(self.clock, self.settings, run, f"Retry: {error}", delay_s=error.delay_s)
        text = "".join(traceback.format_exception(error))[-_ERROR_MAX_CHARS:]
        log.opt(exception=error).warning("handler raised {}: {}", type(error).__name__, error)
        return failed(self.clock, self.settings, run, text)

    def finish(self, run: ClaimedRun, outcome: Outcome) -> bool:
        """Queue a started run's outcome; False when the watchdog already failed it (the
        outcome is discarded)."""
        row = run.row
        log = logger.bind(key=row.key, attempt=row.attempts)
        if not self.inflight.finished(run, outcome):
            log.warning("abandoned run returned after its timeout; its result is discarded")
            return False
        assert run.started_s is not None
        self.metrics.ended(
            run.spec.label, _OUTCOME_NAMES[outcome.status], monotonic_s() - run.started_s
        )
        if outcome.status is TaskStatus.DONE and outcome.finished_at_ms is not None:
            took_ms = outcome.finished_at_ms - (row.started_at_ms or outcome.finished_at_ms)
            late = late_ms(row.started_at_ms or 0, row.due_at_ms)
            if late is None:
                log.info("done in {} ms (due before 1970: run as due now)", took_ms)
            else:
                log.bind(late_ms=late).info("done in {} ms, started {} ms after due", took_ms, late)
        return True

    def _lease_covers(self, run: ClaimedRun, now_ms: int, log: Logger) -> bool:
        """Make sure the claim's lease outlasts this run; False if the claim was lost meanwhile.

        A run that waited in the queue may start with less lease left than its timeout; without
        an extension another listener could take it over mid-run and run it a second time.
        """
        grace_ms = int(self.settings.lease_grace_s * 1000)
        needed_ms = now_ms + int(run.timeout_s * 1000) + grace_ms // 2
        # A peer takes over a silent listener's runs whatever their lease: one that waited
        # half `takeover_after_s` (this listener frozen meanwhile, its beats with it) asks the
        # ledger first. The short Cluster soak: runs queued when a SIGSTOP (6 s) came started
        # after it, 0.7 s after their takeover had run them again.
        waited_s = monotonic_s() - run.claimed_s
        if run.lease_until_ms >= needed_ms and waited_s < self.settings.takeover_after_s / 2:
            return True
        kept = self._extend_lease(run, now_ms, grace_ms, log)
        if kept is None:
            self._stats.claims_lost += 1
            return False
        if kept is False:
            log.warning("claim lost while queued (its lease ran out); not running it here")
            self._stats.claims_lost += 1
            return False
        run.lease_until_ms = kept
        self._stats.leases_extended += 1
        return True

    def _extend_lease(
        self, run: ClaimedRun, now_ms: int, grace_ms: int, log: Logger
    ) -> int | bool | None:
        """Extend `run`'s lease to cover a whole run from now: the new lease end, False when the
        claim was lost, None when the ledger could not say before the lease ran out (or the
        listener stops, or the row is locked).

        An outage of a database server waits for the ledger while the lease lasts, as the
        claimer and the recorder do: given up at once, a run that started late in a failover
        waited its whole lease and ran on a second attempt (a hundred tasks of a wave in the
        PostgreSQL failover test on a loaded CI machine, 12 s late). Waiting is safe: the
        extension is checked against the claim's token, so a claim taken over meanwhile reads
        False. A row lock held too long, or a busy SQLite file, is contention, not an outage:
        the run is given up as before. (Retried on SQLite, the extensions of a backlog's runs
        competed with the recorder for its one writer: with one of three listeners killed
        under load, 0 to 1,150 tasks ran twice in three runs, against 64 to 154 without.)
        """
        backoff = threads.Backoff(self.settings.reconnect_initial_s, self.settings.reconnect_max_s)
        reconnects = self.store.reconnects
        waited = False
        while True:
            until_ms = now_ms + int(run.timeout_s * 1000) + grace_ms
            seen = reconnects.count
            try:
                kept = self.store.extend_lease(run.row.id, run.token, until_ms, now_ms)
            except StoreError as exc:
                left_s = (run.lease_until_ms - self.clock.now_ms()) / 1000
                outage = not (exc.lock_timeout or self.store.embedded)
                if not outage or left_s <= 0 or self.stopping.is_set():
                    # Unknown whether the lease still holds: give the run back to reconciliation
                    # rather than risk a second copy running.
                    log.warning(
                        "could not extend a late-starting claim's lease: {}; not running", exc
                    )
                    return None
                if not waited:
                    self._stats.lease_waits += 1
                    said = self._lease_waits.add(1, monotonic_s())
                    (log.warning if said else log.debug)(
                        "could not extend a late-starting claim's lease: {}; waiting for the "
                        "ledger while the lease lasts ({:.1f} s)",
                        exc,
                        left_s,
                    )
                    waited = True
                wait_s = min(backoff.next_s(), left_s)
                reconnects.pause(
                    self.stopping,
                    seen,
                    wait_s,
                    min_s=min(wait_s, self.settings.reconnect_initial_s),
                )
                now_ms = self.clock.now_ms()
                continue
            if waited:
                log.info("lease extended once the ledger answered: running")
            return until_ms if kept else False


class Watchdog:
    """Fails runs past their timeout: a coroutine is cancelled; a thread cannot be killed in
    Python, so a hung one is abandoned and a fresh worker takes its slot."""

    def __init__(self, executor: Executor, stats: DispatchStats) -> None:
        # The executor's clock, settings and metrics: a timed-out run fails as one that ended.
        self.clock, self.settings, self.metrics = (
            executor.clock,
            executor.settings,
            executor.metrics,
        )
        self._executor = executor
        self.inflight = executor.inflight
        self._stats = stats
        self.hand_off: Callable[[bool], object] = _no_hand_off
        """The claimer's `hand_off` (set by the dispatcher): another thread takes the claims
        when the claimer's own run took too long (always, with True)."""

    def loop(self) -> None:
        """Check until the dispatcher stops, sleeping until the next run could be late."""
        stopped = self._executor.stopped
        while not stopped.is_set():
            next_deadline = self._fail_late_runs(monotonic_s())
            self.hand_off(False)
            # Nothing wakes it when the claimer starts a run of its own (a wake-up per run is
            # what running it there saves): a handler slower than its method's usual holds
            # the claims no longer than this and `HAND_OFF_AFTER_S`.
            wait_s = min(next_deadline - monotonic_s(), AWAY_CHECK_S)
            stopped.wait(max(0.005, wait_s))

    def _fail_late_runs(self, now: float) -> float:
        """Record runs past their timeout as failed; return when the next one is due to end."""
        late, next_deadline = self.inflight.take_late(now)
        self._stats.timed_out += len(late)
        for run in late:
            self.metrics.ended(run.spec.label, "timeout", run.timeout_s)
            log = logger.bind(key=run.row.key, attempt=run.row.attempts)
            log.error(
                "handler exceeded its timeout of {:g} s; recorded as failed ({})",
                run.timeout_s,
                "its coroutine is cancelled" if run.spec.is_async else "its thread is abandoned",
            )
            if run.spec.is_async:
                self._executor.coroutines.cancel(run)
            elif run.inline:
                # The claimer's thread hangs in it: another thread claims from now on (the
                # workers were never short of one).
                self.hand_off(True)
            else:
                if run.worker is not None:
                    self.inflight.runq.lost(run.worker, run)
                self._executor.spawn_worker()
            end_tx = run.end_tx
            if run.tx_taken and end_tx is not None:
                try:
                    end_tx()  # its locks go now, not when (if ever) the handler returns
                    log.warning("its transaction was ended (its writes rolled back)")
                except Exception as exc:
                    log.warning("could not end its transaction: {}", exc)
            try:
                outcome = failed(
                    self.clock,
                    self.settings,
                    run,
                    f"TimeoutError: handler exceeded {run.timeout_s:g} s",
                )
            except Exception:
                self._executor.errors.add("watchdog")
                log.opt(exception=True).error(
                    "could not record the timeout; the run is retried when its lease ends"
                )
                continue
            self.inflight.add_outcome(outcome)
        return next_deadline


def _no_hand_off(_force: bool) -> None:
    pass


def _discard(awaitable: Awaitable[Any]) -> None:
    """Close a coroutine that will never be awaited (no "never awaited" warning)."""
    close = getattr(awaitable, "close", None)
    if callable(close):
        close()
