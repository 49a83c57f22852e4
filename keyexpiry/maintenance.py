"""The listener's maintenance thread: reconciliations when asked (start-up, reconnect, sentinel;
coalesced), and between them the periodic self-check of loss control."""

from __future__ import annotations

import threading
from collections.abc import Callable

import redis
from loguru import logger

from keyexpiry import retention
from keyexpiry.clock import monotonic_s
from keyexpiry.errors import StoreError
from keyexpiry.health import Health
from keyexpiry.reconcile import Reconciler
from keyexpiry.rows import TaskStatus
from keyexpiry.runtime import Runtime
from keyexpiry.threads import Backoff, ThreadErrors

_PRUNE_BATCHES = 10
"""At most this many batches of 1,000 rows per prune round (each its own short transaction)."""
_EXPECTED = (StoreError, redis.RedisError, OSError)
"""Outages: logged in one line and retried. Anything else is a bug: traceback and count."""


class Maintenance:
    """Runs reconciliations on request and the self-check every second in between."""

    def __init__(
        self,
        rt: Runtime,
        reconciler: Reconciler,
        health: Health,
        *,
        self_check: Callable[[float], None],
        stop: threading.Event,
        errors: ThreadErrors,
    ) -> None:
        self.rt = rt
        self._reconciler = reconciler
        self._health = health
        self._self_check = self_check
        self._stop = stop
        self._errors = errors
        self._wanted = threading.Event()
        self._idle = threading.Event()
        self.schema_ready = False
        self.reconciles_done = 0
        self.pruned = 0
        """Finished rows this listener deleted (retention)."""
        self._last_prune_s = monotonic_s()

    def request(self, reason: str) -> None:
        """Run a reconciliation soon (requests made meanwhile are coalesced)."""
        logger.debug("reconciliation requested: {}", reason)
        self._idle.clear()
        self._wanted.set()

    def wake(self) -> None:
        """Make the loop look at `stop` now."""
        self._wanted.set()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no reconciliation is requested or running (a test sync point)."""
        return self._idle.wait(timeout_s)

    def ensure_schema(self) -> None:
        """Create the ledger table before any thread queries it (a fresh state dir has none);
        a database that is down now is retried by the loop."""
        try:
            self.rt.store.create_schema()
            self.schema_ready = True
        except StoreError as exc:
            logger.error("ledger not reachable at start-up ({}); retrying", exc)

    def loop(self) -> None:
        """Until `stop`: reconcile when asked, else self-check every second."""
        settings = self.rt.settings
        backoff = Backoff(settings.reconnect_initial_s, settings.reconnect_max_s)
        self._health.started(monotonic_s())
        while not self._stop.is_set():
            if not self._wanted.wait(min(1.0, settings.lease_check_s)):
                self._idle.set()
                self._check()
                continue
            if self._stop.is_set():
                break
            self._wanted.clear()
            try:
                if not self.schema_ready:
                    # A database that was down at start-up: retried here until it answers.
                    self.rt.store.create_schema()
                    self.schema_ready = True
                report = self._reconciler.run()
                self._health.regenerate_sentinels_if_needed()
                backoff.reset()
            except redis.ReadOnlyError as exc:
                # Overdue rows were handed to the claimer before the failing write; the
                # reconnect once Redis is a master again reconciles (and re-arms) in full.
                self._health.read_only(exc)
                self._idle.set()
                continue
            except Exception as exc:
                wait_s = backoff.next_s()
                if isinstance(exc, _EXPECTED):
                    logger.error("reconciliation failed ({}); retrying in {:.1f} s", exc, wait_s)
                else:
                    self._errors.add("reconcile")
                    logger.exception("reconciliation failed; retrying in {:.1f} s", wait_s)
                self._stop.wait(wait_s)
                self._wanted.set()
                continue
            self.reconciles_done += 1
            if report.overdue or report.rearmed or report.lease_expired:
                logger.info("reconciliation: {}", report)
            if not self._wanted.is_set():
                self._idle.set()

    def _prune_if_due(self, now_s: float) -> None:
        """A few batches of finished rows past their retention, every `prune_every_s`: a
        backlog is worked off over minutes without holding this thread (or locks) long."""
        settings = self.rt.settings
        if now_s - self._last_prune_s < settings.prune_every_s or not self.schema_ready:
            return
        self._last_prune_s = now_s
        before = retention.cutoffs(
            self.rt.clock.now_ms(),
            {
                TaskStatus.DONE: settings.retain_done_s,
                TaskStatus.CANCELLED: settings.retain_done_s,
                TaskStatus.DEAD: settings.retain_dead_s,
            },
        )
        report = retention.prune(self.rt.store, before, max_batches=_PRUNE_BATCHES)
        self.pruned += report.total
        if report.total:
            logger.info("retention: deleted {} finished row(s)", report)

    def _check(self) -> None:
        try:
            self._self_check(monotonic_s())
            self._prune_if_due(monotonic_s())
        except redis.ReadOnlyError as exc:
            self._health.read_only(exc)
        except Exception as exc:
            if not isinstance(exc, _EXPECTED):
                self._errors.add("reconcile")
                logger.opt(exception=exc).error("self-check failed unexpectedly")
            elif self._health.subscribed.is_set():
                logger.warning("self-check failed: {}", exc)
            else:  # the subscriber's own line already says Redis is away
                logger.debug("self-check failed: {}", exc)
