"""What is in flight between claim and record: the claimed runs, the outcomes waiting to be
written, and the one condition that guards them (claimer, workers, watchdog and recorder share it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from keyexpiry.clock import monotonic_s
from keyexpiry.ledger.rows import Occurrence, Outcome, TaskRow
from keyexpiry.registry import TaskSpec
from keyexpiry.runner.runq import RunQueue, Worker

# Claims may run ahead of the workers by about this much queued work, so the claimer's round trip
# is paid per batch, not per worker slot; the queue stays short enough that a claim's lease
# rarely needs extending before its handler starts.
_QUEUE_TARGET_S = 0.25
# Outcomes wait about this long for others before they are written: a trickle of handlers ending
# one at a time is recorded in one transaction per interval, not one per run. Nothing waits on
# the write (the worker slot is free as soon as the handler returns), so only the ledger's view
# of a finished run lags by this much.
RECORD_GATHER_S = 0.05


@dataclass(eq=False)
class ClaimedRun:
    """One claimed row on its way through a worker: its claim token, lease and timing."""

    row: TaskRow
    token: str
    spec: TaskSpec
    timeout_s: float
    lease_until_ms: int
    started_s: float | None = None
    abandoned: bool = False
    """Failed by the watchdog; whatever its thread returns later is discarded."""
    committing: bool = False
    """A transactional run committing its success: the watchdog leaves it be."""
    end_tx: Callable[[], None] | None = None
    """Ends a transactional run's open transaction from another thread (MySQL/MariaDB: kills its
    connection), while the run holds it; the watchdog takes it when it abandons the run."""
    tx_taken: bool = False
    """The watchdog took `end_tx`: the run's connection must never go back to the pool."""
    occurrence: Occurrence | None = None
    """The schedule's occurrence this run stands for (set as it starts), or None."""
    worker: Worker | None = None
    """The worker running it (sync handlers), which the watchdog gives up when it hangs."""
    claimed_s: float = field(default_factory=monotonic_s)
    """When it was claimed (monotonic): a run that waited long may have been taken over."""
    inline: bool = False
    """Run by the claimer's own thread (`runner.claimer`), not by a worker."""


@dataclass
class DispatchStats:
    """Counters since start, for status output, tests and the benchmark."""

    submitted: int = 0
    claimed: int = 0
    claimed_inline: int = 0
    """Lone runs the claimer ran on its own thread (`runner.claimer`)."""
    claim_hand_offs: int = 0
    """Times such a run took too long and another thread took over the claims."""
    done: int = 0
    retried: int = 0
    dead: int = 0
    timed_out: int = 0
    not_claimed: int = 0
    already_queued: int = 0
    """Submissions dropped because the key was still waiting for its claim."""
    intake_full: int = 0
    """Submissions dropped because the intake was full (a flood of events): the due tasks
    among them are found in the ledger instead."""
    no_row: int = 0
    """Task keys heard with no ledger row (forged, or rows deleted): ignored."""
    found_due: int = 0
    """Due tasks found in the ledger while events were dropped or held up, claimed first."""
    leases_extended: int = 0
    lease_waits: int = 0
    """Late-starting runs whose lease extension met a ledger outage and waited for it."""
    claims_lost: int = 0
    claims_settled: int = 0
    """Claims whose commit's outcome was unknown, claimed again under their token."""
    ignored: int = 0
    store_errors: int = 0


class InFlight:
    """Claimed runs (queued or running) and outcomes not yet recorded, under one condition."""

    def __init__(
        self, concurrency: int, claim_batch: int, async_limit: int = 100, ramp_s: float = 0.0
    ) -> None:
        """`ramp_s`: how long the oldest queued run waits behind active workers before one more
        is woken (`runner.runq`); 0 wakes one per run."""
        self.cond = threading.Condition()
        self.runq: RunQueue[ClaimedRun] = RunQueue(ramp_s)
        """Claimed runs waiting for a worker."""
        self.count = 0
        """Claimed and not yet finished (queued or running)."""
        self.running: dict[int, ClaimedRun] = {}
        self.coroutines = 0
        """Runs of async handlers started and not finished (they hold no worker)."""
        self.outcomes: list[Outcome] = []
        self._first_outcome_s = 0.0  # when the oldest queued outcome was queued
        self.recording = 0
        """Outcomes taken by the recorder and not yet written."""
        self._concurrency = concurrency
        self._claim_batch = claim_batch
        self._async_limit = async_limit
        self._run_s_avg: float | None = None  # moving average of handler run time
        self._spec_run_s: dict[str, float] = {}  # and per task method (its spec's label)
        self._spec_runs: dict[str, int] = {}  # runs folded into it (the first 20 count 1/n)
        self.inline = 0
        """Runs claiming threads are running themselves now: 0 or 1, 2 for a moment after a
        hand-off (the old thread's run and the new claimer's). Changed under `inline_lock`:
        two threads may change it at once."""
        self.inline_lock = threading.Lock()
        self.on_leave: Callable[[ClaimedRun], None] = _nothing
        """Called (outside the condition) for each run that leaves flight, however it leaves:
        flow control gives its permit back."""

    def claim_limit(self) -> int:
        """How many claimed runs may be in flight: the workers plus a short queue ahead of them,
        plus room for coroutines.

        The queue is sized from the measured run time of sync handlers so it holds about
        `_QUEUE_TARGET_S` of work: hundreds for trivial handlers, none beyond the pool for slow
        ones. Coroutines hold no worker: each running one widens the window by one, and by one
        more while the loop has a free slot for it, so a burst of async tasks reaches
        `async_concurrency` in a few doubling claims rather than a worker pool's worth at a time.
        """
        workers = self._concurrency
        avg = self._run_s_avg
        ahead = (
            workers
            if avg is None
            else min(int(workers * _QUEUE_TARGET_S / max(avg, 1e-4)), self._claim_batch)
        )
        running = self.coroutines
        return workers + ahead + running + min(running, self._async_limit - running)

    def claim_room(self) -> int:
        """How many runs a claim may take now: none until the queue ahead of the workers has
        half drained (or the flight has any room, when no queue is kept ahead).

        Claiming whatever room a finished run left made a saturated listener claim a few keys
        at a time (15 on average in a 30k wave, each claim a round trip and its statement's
        fixed cost); from half a queue, the workers still have that half to run while the
        claim is answered, and it takes up to half the queue's worth of keys at once.
        """
        limit = self.claim_limit()
        low_water = max(1, (limit - self._concurrency) // 2)
        room = limit - self.count
        return room if room >= low_water else 0

    def add_claimed(self, runs: list[ClaimedRun]) -> None:
        """Queue freshly claimed runs for the workers."""
        with self.cond:
            self.count += len(runs)
        self.runq.put(runs)

    def hold(self, run: ClaimedRun) -> None:
        """A freshly claimed run the claimer runs itself: in flight, not queued."""
        with self.cond:
            self.count += 1

    def typical_run_s(self, spec: TaskSpec) -> float | None:
        """The moving average of the run time of `spec`'s sync runs here (None before its
        first); a run past its timeout counts as that long."""
        return self._spec_run_s.get(spec.label)

    def started(self, run: ClaimedRun) -> None:
        """A worker begins `run` (the watchdog now times it)."""
        with self.cond:
            run.started_s = monotonic_s()
            self.running[run.row.id] = run
            if run.spec.is_async:
                self.coroutines += 1

    def dropped(self, *runs: ClaimedRun) -> None:
        """Claimed runs that will not run here (claim lost, released at shutdown)."""
        with self.cond:
            self.count -= len(runs)
            self.cond.notify_all()
        for run in runs:
            self.on_leave(run)

    def finished(self, run: ClaimedRun, outcome: Outcome) -> bool:
        """A run returned; queue its outcome. False when the watchdog already failed it."""
        with self.cond:
            if run.abandoned:
                return False
            self._leave(run)
            first = not self.outcomes
            self._queue_outcome(outcome)
            assert run.started_s is not None
            if not run.spec.is_async:
                # A coroutine's time says nothing of how long a worker stays busy.
                took_s = monotonic_s() - run.started_s
                avg = self._run_s_avg
                self._run_s_avg = took_s if avg is None else avg + 0.05 * (took_s - avg)
                self._fold_run_s(run.spec, took_s)
            # Only when a waiter may go on: the recorder waits for a first outcome, the claimer
            # for room, a stop for the last run. Waking the claimer at every ending run, only
            # for it to find no room yet, cost a thread wake-up (and a GIL hand-off) a run.
            if first or not self.running or self.claim_room() > 0:
                self.cond.notify_all()
        self.on_leave(run)
        return True

    def committing(self, run: ClaimedRun) -> bool:
        """A transactional run is about to record and commit its success: from now on the
        watchdog leaves it alone (its commit decides). False when the watchdog already failed
        it: it must roll back."""
        with self.cond:
            if run.abandoned:
                return False
            run.committing = True
        return True

    def attach_tx(self, run: ClaimedRun, end: Callable[[], None]) -> bool:
        """A transactional run holds an open transaction that `end` can end from outside;
        False when the watchdog already failed it (it must not run)."""
        with self.cond:
            if run.abandoned:
                return False
            run.end_tx = end
        return True

    def detach_tx(self, run: ClaimedRun) -> bool:
        """A transactional run is done with its connection: True when the connection may go
        back to the pool, False when the watchdog is ending it (discard it)."""
        with self.cond:
            run.end_tx = None
            return not run.tx_taken

    def broke(self, run: ClaimedRun) -> bool:
        """Something around `run` raised: take it out of flight. False when it is already out
        (failed by the watchdog, or its outcome queued before the error)."""
        with self.cond:
            if run.abandoned:
                return False
            if run.started_s is not None and run.row.id not in self.running:
                return False
            self._leave(run)
            self.cond.notify_all()
        self.on_leave(run)
        return True

    def take_late(self, now: float) -> tuple[list[ClaimedRun], float]:
        """Runs past their timeout, marked abandoned and out of flight; and when the next
        running one will be late."""
        late: list[ClaimedRun] = []
        next_deadline = now + 0.5
        with self.cond:
            for run in self.running.values():
                assert run.started_s is not None
                deadline = run.started_s + run.timeout_s
                if run.committing:
                    continue
                if deadline <= now:
                    late.append(run)
                else:
                    next_deadline = min(next_deadline, deadline)
            for run in late:
                run.abandoned = True
                run.tx_taken = run.end_tx is not None
                self._leave(run)
                if not run.spec.is_async:
                    self._fold_run_s(run.spec, run.timeout_s)
            if late:
                self.cond.notify_all()
        for run in late:
            self.on_leave(run)
        return late, next_deadline

    def _fold_run_s(self, spec: TaskSpec, took_s: float) -> None:
        """Fold one sync run's time into its method's average (under the condition): the plain
        mean of its first 20 runs (a first run slowed by a cold start weighs 1/n, not all),
        then a moving one at 5 %: one slow run keeps the method off the claimer's thread for
        the next ~90."""
        label = spec.label
        runs = self._spec_runs.get(label, 0) + 1
        self._spec_runs[label] = runs
        avg = self._spec_run_s.get(label, took_s)
        self._spec_run_s[label] = avg + max(1 / runs, 0.05) * (took_s - avg)

    def _leave(self, run: ClaimedRun) -> None:
        """`run` is out of flight (under the condition)."""
        self.count -= 1
        if self.running.pop(run.row.id, None) is not None and run.spec.is_async:
            self.coroutines -= 1

    def add_outcome(self, outcome: Outcome) -> None:
        """Queue an outcome decided outside a worker (timeout, failure around a run)."""
        with self.cond:
            self._queue_outcome(outcome)
            self.cond.notify_all()

    def _queue_outcome(self, outcome: Outcome) -> None:
        if not self.outcomes:
            self._first_outcome_s = monotonic_s()
        self.outcomes.append(outcome)

    def take_outcomes(self) -> list[Outcome]:
        """Every queued outcome, now counted as being recorded."""
        with self.cond:
            batch, self.outcomes = self.outcomes, []
            self.recording += len(batch)
        return batch

    def recorded(self, count: int) -> None:
        """`count` outcomes taken by `take_outcomes` are written (or given up)."""
        with self.cond:
            self.recording -= count
            self.cond.notify_all()

    def put_back(self, batch: list[Outcome]) -> None:
        """Outcomes whose write failed go back to the head of the queue."""
        with self.cond:
            if not self.outcomes:
                self._first_outcome_s = monotonic_s()
            self.outcomes[:0] = batch
            self.recording -= len(batch)

    def wait_outcomes(self, timeout_s: float, gather_s: float = RECORD_GATHER_S) -> None:
        """Wait up to `timeout_s` for an outcome to record, then until the oldest queued one has
        waited `gather_s` for others to join it."""
        with self.cond:
            if not self.outcomes:
                self.cond.wait(timeout_s)
            if not self.outcomes:
                return
            left_s = self._first_outcome_s + gather_s - monotonic_s()
        # A sleep, not the condition: every ending run notifies it, and each wake-up would cost
        # about what the gathering saves.
        if left_s > 0:
            time.sleep(left_s)

    def quiet(self) -> bool:
        """Nothing claimed, running or waiting to be recorded."""
        with self.cond:
            return self.count == 0 and not self.outcomes and self.recording == 0


def _nothing(_run: ClaimedRun) -> None:
    pass
