"""Claim, run, record: everything between "this key expired" and a recorded outcome.

The dispatcher only composes and orchestrates; the work is in its parts, each on threads of its
own so the subscription never waits on the database or a handler:
- `claimer`: keys queued once each, claimed in batches (one transaction per batch);
- `executor`: a bounded pool of workers runs handlers; a watchdog fails runs past their timeout;
- `coroutines`: `async def` handlers, awaited on an event loop of their own;
- `recorder`: outcomes written in batches, retries re-armed;
- `inflight`: the claimed runs and queued outcomes they share, under one condition.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable

import redis
from loguru import logger

from keyexpiry import threads
from keyexpiry.clock import monotonic_s
from keyexpiry.errors import StoreError
from keyexpiry.runner.arming import Arming
from keyexpiry.runner.claimer import Claimer
from keyexpiry.runner.executor import Executor, Watchdog
from keyexpiry.runner.gate import Gate
from keyexpiry.runner.inflight import ClaimedRun, DispatchStats, InFlight
from keyexpiry.runner.recorder import Recorder
from keyexpiry.runtime import Runtime

__all__ = ["DispatchStats", "Dispatcher"]


class Dispatcher:
    """Runs submitted task keys once per claim on a bounded worker pool."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.settings = rt.settings
        self.stats = DispatchStats()
        self.thread_errors = threads.ThreadErrors()
        """Unexpected exceptions the dispatcher's threads survived."""
        self._stopped = threading.Event()
        self.inflight = InFlight(
            rt.settings.concurrency,
            rt.settings.claim_batch,
            rt.settings.async_concurrency,
            rt.settings.worker_ramp_ms / 1000,
        )
        # Each part is handed what it uses of the runtime, here and nowhere else.
        self.gate = Gate(
            store=rt.store,
            redis=rt.redis,
            clock=rt.clock,
            settings=rt.settings,
            owner=rt.owner,
            errors=self.thread_errors,
        )
        """Flow control: pauses, fleet-wide limits, rates and groups (`runner.gate`)."""
        self.inflight.on_leave = self.gate.release
        self.arming = Arming(self.thread_errors)
        """Keys of committed rows armed on a thread of their own (`runner.arming`)."""
        self.claimer = Claimer(
            store=rt.store,
            redis=rt.redis,
            clock=rt.clock,
            settings=rt.settings,
            registry=rt.registry,
            owner=rt.owner,
            inflight=self.inflight,
            stats=self.stats,
            errors=self.thread_errors,
            gate=self.gate,
            arming=self.arming,
        )
        self.executor = Executor(
            store=rt.store,
            clock=rt.clock,
            settings=rt.settings,
            metrics=rt.metrics,
            inflight=self.inflight,
            stats=self.stats,
            errors=self.thread_errors,
            stopped=self._stopped,
        )
        self.executor.gate = self.gate
        self.executor.stopping = self.claimer.stop
        self.watchdog = Watchdog(self.executor, self.stats)
        self.claimer.run_here = self.executor.run_here
        self.claimer.spawn = self._spawn_claimer
        self.watchdog.hand_off = self.claimer.hand_off
        self.recorder = Recorder(
            store=rt.store,
            redis=rt.redis,
            clock=rt.clock,
            settings=rt.settings,
            inflight=self.inflight,
            stats=self.stats,
            errors=self.thread_errors,
            arming=self.arming,
        )

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the claimer, the recorder, the watchdog and the worker pool."""
        self._spawn_claimer(self.claimer.generation)
        self._spawn("recorder", lambda: self.recorder.loop(self._stopped))
        self._spawn("arming", lambda: self.arming.loop(self._stopped))
        self._spawn("watchdog", self.watchdog.loop)
        for _ in range(self.settings.concurrency):
            self.executor.spawn_worker()

    def submit(self, keys: Iterable[str]) -> None:
        """Queue task keys whose expiry (or overdue state) was seen; never blocks."""
        self.claimer.intake.submit(keys)

    def stop(self, timeout_s: float) -> None:
        """Stop claiming, let running handlers finish for up to `timeout_s`, release the rest."""
        self.claimer.stop.set()
        inflight = self.inflight
        with inflight.cond:
            inflight.cond.notify_all()  # a claimer waiting for room sees the stop now
        deadline = monotonic_s() + timeout_s
        while self.claimer.claiming and monotonic_s() < deadline:
            time.sleep(0.01)
        unstarted = inflight.runq.drain()
        unstarted += self.executor.coroutines.withdraw()  # waiting for a coroutine slot
        self._release(unstarted)
        inflight.runq.close()
        with inflight.cond:
            while inflight.running and monotonic_s() < deadline:
                inflight.cond.wait(0.05)
            if inflight.running:
                logger.warning(
                    "{} handler(s) still running at shutdown; their leases will expire and "
                    "reconciliation will run them again",
                    len(inflight.running),
                )
        flush_deadline = max(deadline, monotonic_s() + 5.0)
        self.recorder.flush(deadline=flush_deadline)
        with inflight.cond:
            # The recorder may have taken the last batch just before us: wait for its write.
            while inflight.recording and monotonic_s() < flush_deadline:
                inflight.cond.wait(0.05)
        if not self.arming.drain(flush_deadline):
            logger.warning("stopping with keys not yet armed; reconciliation will arm them")
        self._stopped.set()
        self.executor.coroutines.close()
        with inflight.cond:
            inflight.cond.notify_all()

    def backlog(self) -> int:
        """Keys submitted and not yet claimed (or found not claimable), a claim whose commit's
        outcome is unknown included."""
        return len(self.claimer.intake) + self.claimer.unsettled_keys()

    def idle(self) -> bool:
        """Nothing queued, claimed, running or waiting to be recorded."""
        return (
            not self.backlog()
            and not self.claimer.claiming
            and self.inflight.quiet()
            and self.arming.idle()
        )

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until `idle()`; False on timeout. A sync point for tests and the demo."""
        deadline = monotonic_s() + timeout_s
        while monotonic_s() < deadline:
            if self.idle():
                return True
            time.sleep(0.005)
        return self.idle()

    # --- shutdown -----------------------------------------------------------------------------
    def _release(self, runs: list[ClaimedRun]) -> None:
        """Give claimed runs that never started back to the ledger (pending, key re-armed)."""
        if not runs:
            return
        by_token: dict[str, list[ClaimedRun]] = collections.defaultdict(list)
        for run in runs:
            by_token[run.token].append(run)
        now_ms = self.rt.clock.now_ms()
        try:
            for token, group in by_token.items():
                self.rt.store.release([r.row.id for r in group], token, now_ms)
            self.rt.arm([(r.row.key, r.row.due_at_ms) for r in runs], now_ms)
        except (StoreError, redis.RedisError) as exc:
            logger.warning(
                "could not release {} unstarted claim(s): {}; their leases will "
                "expire and reconciliation will run them",
                len(runs),
                exc,
            )
        self.inflight.dropped(*runs)
        logger.info("released {} claimed task(s) that had not started", len(runs))

    def _spawn_claimer(self, generation: int) -> None:
        """A thread claiming as `generation` (`Claimer.loop`): restarted after an error, it is
        still that one, and ends if the claims have moved on."""
        self._spawn("claimer", lambda: self.claimer.loop(generation))

    def _spawn(self, name: str, target: Callable[[], object]) -> None:
        threads.spawn(name, target, stopped=self._stopped, errors=self.thread_errors)
