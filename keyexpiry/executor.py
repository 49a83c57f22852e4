"""Running claimed tasks: a bounded pool of workers calls the handlers, a watchdog fails runs past
their timeout, and each ended run becomes an outcome (done, retry at a time, or dead)."""

from __future__ import annotations

import threading
import traceback
from dataclasses import replace
from typing import TYPE_CHECKING

from loguru import logger

from keyexpiry import limits, retries, threads
from keyexpiry.clock import monotonic_s
from keyexpiry.context import TaskContext, set_current
from keyexpiry.errors import ArgumentError, DoNotRetry, KeyExpiryError, Retry, StoreError
from keyexpiry.inflight import ClaimedRun, DispatchStats, InFlight
from keyexpiry.results import encode_result
from keyexpiry.rows import Outcome, TaskStatus
from keyexpiry.runtime import Runtime
from keyexpiry.transactional import run_in_transaction

if TYPE_CHECKING:
    from loguru import Logger

_ERROR_MAX_CHARS = 8000
_OUTCOME_NAMES = {TaskStatus.DONE: "done", TaskStatus.PENDING: "retry", TaskStatus.DEAD: "dead"}
"""An outcome's status as the `outcome` label of keyexpiry_runs_total."""


def ended(
    rt: Runtime, run: ClaimedRun, status: TaskStatus, error: str | None, result: str | None = None
) -> Outcome:
    """The outcome of a run that finished for good (done or dead)."""
    return Outcome(
        task_id=run.row.id,
        key=run.row.key,
        token=run.token,
        status=status,
        finished_at_ms=rt.clock.now_ms(),
        due_at_ms=run.row.due_at_ms,
        last_error=error,
        result=result,
    )


def succeeded(rt: Runtime, run: ClaimedRun, value: object) -> Outcome:
    """The outcome of a handler that returned `value`: done, the value kept as JSON.

    A value that cannot be kept (not JSON, or over `result_max_bytes`) still leaves the task
    done, with `last_error` saying why and no result: the handler's work is done, and running
    it again would repeat that work only to fail the same way.
    """
    result, why = encode_result(value, rt.settings.result_max_bytes)
    if why is not None:
        logger.bind(key=run.row.key, attempt=run.row.attempts).warning("{}", why)
    return ended(rt, run, TaskStatus.DONE, why, result)


def failed(rt: Runtime, run: ClaimedRun, error: str, *, delay_s: float | None = None) -> Outcome:
    """The outcome of a failed run: pending again after the schedule's next delay (or the
    handler's own `Retry(delay_s)` when it is in range), or dead once out of attempts."""
    row = run.row
    schedule = retries.schedule_s(row.retry_schedule_s, run.spec.options, rt.settings)
    retries_used = row.attempts - 1
    log = logger.bind(key=row.key, attempt=row.attempts)
    if retries_used >= len(schedule):
        log.error("out of attempts ({}); task is dead", row.attempts)
        return ended(rt, run, TaskStatus.DEAD, error)
    delay = schedule[retries_used]
    if delay_s is not None:
        try:
            delay = limits.number(
                delay_s, "Retry(delay_s)", low=0, high=limits.MAX_DELAY_S, error=ArgumentError
            )
        except ArgumentError as exc:
            log.warning("{}; retrying on the schedule instead ({:g} s)", exc, delay)
    due = rt.clock.now_ms() + int(delay * 1000)
    log.info("will retry in {:g} s", delay)
    return Outcome(row.id, row.key, run.token, TaskStatus.PENDING, None, due, error)


class Executor:
    """The worker pool: each worker takes a claimed run, calls its handler, queues the outcome."""

    def __init__(
        self,
        rt: Runtime,
        inflight: InFlight,
        stats: DispatchStats,
        errors: threads.ThreadErrors,
        stopped: threading.Event,
    ) -> None:
        self.rt = rt
        self.inflight = inflight
        self._stats = stats
        self.errors = errors
        self.stopped = stopped
        self.threads: list[threading.Thread] = []

    def spawn_worker(self) -> None:
        """One more worker (at start, and to replace one abandoned to a hung handler)."""
        self.threads.append(
            threads.spawn("worker", self._worker_loop, stopped=self.stopped, errors=self.errors)
        )

    def _worker_loop(self) -> None:
        while True:
            run = self.inflight.runq.get()
            if run is None:
                return
            try:
                if self._execute(run):
                    return  # timed out: the watchdog started a replacement; this thread retires
            except Exception as exc:
                self._run_broke(run, exc)

    def _run_broke(self, run: ClaimedRun, exc: Exception) -> None:
        """Something other than the handler raised around a run (a bug, or a value that slipped
        past every check): count it, record the run as failed if that still works, else leave
        it to its lease. The worker lives on either way."""
        self.errors.add("worker")
        log = logger.bind(key=run.row.key, attempt=run.row.attempts)
        log.opt(exception=exc).error("unexpected error around this run; the worker carries on")
        if not self.inflight.broke(run):
            return  # failed by the watchdog, or its outcome queued before the error
        try:
            outcome = failed(self.rt, run, f"{type(exc).__name__} around the handler: {exc}")
        except Exception:
            log.error("could not record the failure; the run is retried when its lease ends")
            return
        self.inflight.add_outcome(outcome)

    def _execute(self, run: ClaimedRun) -> bool:
        """Run one claimed task; True when the watchdog abandoned it (this thread retires)."""
        row = run.row
        log = logger.bind(key=row.key, attempt=row.attempts)
        started_ms = self.rt.clock.now_ms()
        if not self._lease_covers(run, started_ms, log):
            self.inflight.dropped()
            return False
        self.inflight.started(run)
        task = run.spec.label
        self.rt.metrics.started(task, started_ms - row.due_at_ms)
        outcome: Outcome
        try:
            if row.problem is not None:
                raise ArgumentError(f"ledger row {row.id}: {row.problem}")
            args = run.spec.decode_args(row.args)
        except KeyExpiryError as exc:
            outcome = ended(self.rt, run, TaskStatus.DEAD, f"not runnable: {exc}")
            log.error("not runnable: {}", exc)
        else:
            ctx = TaskContext(
                row.key, row.attempts, row.due_at_ms, self.rt.store.engine, started_ms
            )
            if run.spec.options.transactional:
                in_tx = run_in_transaction(
                    self.rt,
                    run,
                    self.inflight,
                    lambda conn: self._call(run, args, replace(ctx, transaction=conn), log),
                    lambda why: failed(self.rt, run, why),
                )
                if in_tx is None:
                    if not self.inflight.broke(run):  # out of flight already: timed out
                        log.warning("abandoned run returned after its timeout; rolled back")
                        return True
                    self._stats.claims_lost += 1
                    return False
                outcome = in_tx
            else:
                outcome = self._call(run, args, ctx, log)
        if not self.inflight.finished(run, outcome):
            log.warning("abandoned run returned after its timeout; its result is discarded")
            return True
        assert run.started_s is not None
        self.rt.metrics.ended(task, _OUTCOME_NAMES[outcome.status], monotonic_s() - run.started_s)
        if outcome.status is TaskStatus.DONE and outcome.finished_at_ms is not None:
            late_ms = (row.started_at_ms or 0) - row.due_at_ms
            log.bind(late_ms=late_ms).info(
                "done in {} ms, started {} ms after due",
                outcome.finished_at_ms - (row.started_at_ms or outcome.finished_at_ms),
                late_ms,
            )
        return False

    def _call(
        self, run: ClaimedRun, args: tuple[object, ...], ctx: TaskContext, log: Logger
    ) -> Outcome:
        """Call the handler with `ctx` as its `current()`; what it returned or raised, as an
        outcome."""
        set_current(ctx)
        try:
            # Every line the handler logs carries its key and attempt too.
            with logger.contextualize(key=ctx.key, attempt=ctx.attempt):
                value = run.spec.bind()(*args)
        except DoNotRetry as exc:
            log.warning("failed, not retrying: {}", exc)
            return ended(self.rt, run, TaskStatus.DEAD, f"DoNotRetry: {exc}")
        except Retry as exc:
            return failed(self.rt, run, f"Retry: {exc}", delay_s=exc.delay_s)
        except Exception as exc:
            text = "".join(traceback.format_exception(exc))[-_ERROR_MAX_CHARS:]
            log.opt(exception=exc).warning("handler raised {}: {}", type(exc).__name__, exc)
            return failed(self.rt, run, text)
        finally:
            set_current(None)
        return succeeded(self.rt, run, value)

    def _lease_covers(self, run: ClaimedRun, now_ms: int, log: Logger) -> bool:
        """Make sure the claim's lease outlasts this run; False if the claim was lost meanwhile.

        A run that waited in the queue may start with less lease left than its timeout; without
        an extension another listener could take it over mid-run and run it a second time.
        """
        grace_ms = int(self.rt.settings.lease_grace_s * 1000)
        needed_ms = now_ms + int(run.timeout_s * 1000) + grace_ms // 2
        if run.lease_until_ms >= needed_ms:
            return True
        until_ms = now_ms + int(run.timeout_s * 1000) + grace_ms
        try:
            kept = self.rt.store.extend_lease(run.row.id, run.token, until_ms, now_ms)
        except StoreError as exc:
            # Unknown whether the lease still holds: give the run back to reconciliation rather
            # than risk a second copy running.
            log.warning("could not extend a late-starting claim's lease: {}; not running", exc)
            self._stats.claims_lost += 1
            return False
        if not kept:
            log.warning("claim lost while queued (its lease ran out); not running it here")
            self._stats.claims_lost += 1
            return False
        run.lease_until_ms = until_ms
        self._stats.leases_extended += 1
        return True


class Watchdog:
    """Fails runs past their timeout (Python cannot kill a thread: the hung one is abandoned and
    a fresh worker takes its slot)."""

    def __init__(self, rt: Runtime, executor: Executor, stats: DispatchStats) -> None:
        self.rt = rt
        self._executor = executor
        self.inflight = executor.inflight
        self._stats = stats

    def loop(self) -> None:
        """Check until the dispatcher stops, sleeping until the next run could be late."""
        stopped = self._executor.stopped
        while not stopped.is_set():
            next_deadline = self._fail_late_runs(monotonic_s())
            stopped.wait(max(0.005, min(next_deadline - monotonic_s(), 0.5)))

    def _fail_late_runs(self, now: float) -> float:
        """Record runs past their timeout as failed; return when the next one is due to end."""
        late, next_deadline = self.inflight.take_late(now)
        self._stats.timed_out += len(late)
        for run in late:
            self.rt.metrics.ended(run.spec.label, "timeout", run.timeout_s)
            log = logger.bind(key=run.row.key, attempt=run.row.attempts)
            log.error(
                "handler exceeded its timeout of {:g} s; recorded as failed "
                "(its thread is abandoned)",
                run.timeout_s,
            )
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
                    self.rt, run, f"TimeoutError: handler exceeded {run.timeout_s:g} s"
                )
            except Exception:
                self._executor.errors.add("watchdog")
                log.opt(exception=True).error(
                    "could not record the timeout; the run is retried when its lease ends"
                )
                continue
            self.inflight.add_outcome(outcome)
        return next_deadline
