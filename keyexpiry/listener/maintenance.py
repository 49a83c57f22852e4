"""The listener's maintenance thread: reconciliations when asked (start-up, reconnect, sentinel;
coalesced), and between them the periodic self-check of loss control."""

from __future__ import annotations

import threading
from collections.abc import Callable

import redis
from loguru import logger

from keyexpiry.clock import Clock, monotonic_s
from keyexpiry.errors import KeyExpiryError, RedisUnavailableError, StoreError
from keyexpiry.ledger import retention
from keyexpiry.ledger.rows import TaskStatus
from keyexpiry.ledger.store import Store
from keyexpiry.listener.health import Health
from keyexpiry.listener.reconcile import PendingWalk, Reconciler
from keyexpiry.settings import Settings
from keyexpiry.threads import Backoff, ThreadErrors

_PRUNE_BATCHES = 10
"""At most this many batches of 1,000 rows per prune round (each its own short transaction)."""
SCHEDULES_CHECK_S = 5.0
"""How often a listener looks for schedules whose occurrence row went missing."""
_WALK_PAGE_ROWS = 500
"""Keys per page of the walk over rows due later: a few ms of this process's time each."""
_WALK_PACE = 1.0
"""After each page of that walk the thread rests as long as the page took: the walk takes at
most about half of one thread's time (so about twice its unpaced length), and the interpreter
and the ledger are free in between for the claimer, the workers and the subscription."""
_WALK_BUSY_WAIT_S = 0.02
"""While keys wait for the claimer, the walk waits in steps of this: due work goes first."""
_EXPECTED = (StoreError, redis.RedisError, OSError)
"""Outages: logged in one line and retried. Anything else is a bug: traceback and count."""
FAILING_AFTER = 3
"""Failures in a row of a duty (the reconciliation's start, its walk, the self-check) that make
the listener not ready: each is retried (with backoff, or at the next second), but one that
fails every time, whatever the reason, means missed events are no longer repaired."""
_START = "reconciliation"
_WALK = "reconciliation walk"
"""The two halves of a reconciliation, counted apart: a start that works (asked for again by
every sentinel, which anyone can publish) says nothing of a walk that fails every page."""


class Maintenance:
    """Runs reconciliations on request and the self-check every second in between."""

    def __init__(
        self,
        reconciler: Reconciler,
        health: Health,
        *,
        store: Store,
        clock: Clock,
        settings: Settings,
        declare_schedules: Callable[[], object],
        restore_schedules: Callable[[], object],
        self_check: Callable[[float], None],
        stop: threading.Event,
        errors: ThreadErrors,
        backlog: Callable[[], int] = lambda: 0,
    ) -> None:
        """The schema made and finished rows pruned in `store`; `declare_schedules()` declares
        this listener's `@exposed(cron=…)` schedules, `restore_schedules()` puts back missing
        occurrences (`schedules.operate`, handed in: this thread only says when)."""
        self.store, self.clock, self.settings = store, clock, settings
        self._declare_schedules, self._restore_schedules = declare_schedules, restore_schedules
        self._reconciler = reconciler
        self._health = health
        self._self_check = self_check
        self._stop = stop
        self._errors = errors
        self._backlog = backlog
        self._walk: PendingWalk | None = None
        """The walk over rows due later of the reconciliation under way, if any."""
        self._next_walk: PendingWalk | None = None
        """The walk of a reconciliation asked for during `_walk`, run when that one ends (the
        first such: it starts earliest in due order; later ones' urgent parts were done)."""
        self._last_check_s = 0.0
        self._wanted = threading.Event()
        self._idle = threading.Event()
        self.schema_ready = False
        self.reconciles_done = 0
        self.pruned = 0
        """Finished rows this listener deleted (retention)."""
        self._last_prune_s: float | None = None
        """When the last prune round ran (None: none yet, the first check prunes)."""
        self._failures: dict[str, tuple[int, str]] = {}
        """Failures in a row of each duty (`_START`, `_WALK`, "self-check") and the last one."""
        self.schedules_declared = False
        self._last_schedules_s = -SCHEDULES_CHECK_S

    def failing(self) -> list[str]:
        """Why the loop is not doing its job: each duty that failed `FAILING_AFTER` times in
        a row, with its last error (readiness reports these)."""
        return [
            f"{duty} failed {n} times in a row (last: {error})"
            # A copy (atomic): the HTTP thread asks while this one updates.
            for duty, (n, error) in sorted(self._failures.copy().items())
            if n >= FAILING_AFTER
        ]

    def _failed_again(self, duty: str, exc: BaseException) -> None:
        n, _ = self._failures.get(duty, (0, ""))
        error = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        self._failures[duty] = (n + 1, f"{type(exc).__name__}: {error}")

    def _worked(self, duty: str) -> None:
        self._failures.pop(duty, None)

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
            self.store.create_schema()
            self.schema_ready = True
        except StoreError as exc:
            logger.error("ledger not reachable at start-up ({}); retrying", exc)

    def loop(self) -> None:
        """Until `stop`: reconcile when asked, else self-check every second.

        A reconciliation does its urgent part at once (`Reconciler.start`: leases, rows due
        within minutes), then walks the rows due later a paced page at a time, yielding to due
        work, with the self-check every second in between. A request during the walk does its
        urgent part at once and walks once more after this walk (requests coalesce).
        """
        settings = self.settings
        backoff = Backoff(settings.reconnect_initial_s, settings.reconnect_max_s)
        # Its own: a start that works must not cut short the waits of a walk that fails.
        walk_backoff = Backoff(settings.reconnect_initial_s, settings.reconnect_max_s)
        check_every_s = min(1.0, settings.lease_check_s)
        self._health.started(monotonic_s())
        self._last_check_s = monotonic_s()
        while not self._stop.is_set():
            if self._walk is not None and not self._wanted.is_set():
                if monotonic_s() - self._last_check_s >= check_every_s:
                    self._check()
                self._walk_step(walk_backoff)
                continue
            if not self._wanted.wait(check_every_s):
                self._idle.set()
                self._check()
                continue
            if self._stop.is_set():
                break
            self._wanted.clear()
            try:
                if not self.schema_ready:
                    # A database that was down at start-up: retried here until it answers.
                    self.store.create_schema()
                    self.schema_ready = True
                walk = self._reconciler.start(page_rows=_WALK_PAGE_ROWS)
                self._health.regenerate_sentinels_if_needed()
                backoff.reset()
                self._worked(_START)
            except redis.ReadOnlyError as exc:
                # Overdue rows were handed to the claimer before the failing write; the
                # reconnect once Redis is a master again reconciles (and re-arms) in full.
                self._health.read_only(exc)
                if self._walk is None:
                    self._idle.set()
                continue
            except Exception as exc:
                self._stop.wait(self._failed(_START, exc, backoff))
                self._wanted.set()
                continue
            report = walk.report
            if report.overdue or report.rearmed or report.lease_expired:
                # Said now: the walk over rows due later (and its summary) may take minutes.
                logger.info("reconciliation, rows due first: {}", report)
            if self._walk is None:
                self._walk = walk
            elif self._next_walk is None:
                self._next_walk = walk

    def _failed(self, duty: str, exc: Exception, backoff: Backoff) -> float:
        """Log a failed `duty` (`_START` or `_WALK`; a traceback only for the unexpected) and
        return how long to wait before trying again."""
        wait_s = backoff.next_s()
        self._failed_again(duty, exc)
        if isinstance(exc, _EXPECTED):
            logger.error("{} failed ({}); retrying in {:.1f} s", duty, exc, wait_s)
        else:
            self._errors.add("reconcile")
            logger.exception("{} failed; retrying in {:.1f} s", duty, wait_s)
        return wait_s

    def _walk_step(self, backoff: Backoff) -> None:
        """One page of the walk over rows due later, then a rest as long as the page took;
        while keys wait for the claimer, a short wait instead (due work first)."""
        walk = self._walk
        assert walk is not None
        if self._backlog():
            self._wanted.wait(_WALK_BUSY_WAIT_S)
            return
        began_s = monotonic_s()
        try:
            more = walk.step()
        except redis.ReadOnlyError as exc:
            # The reconnect once Redis is a master again reconciles in full.
            self._health.read_only(exc)
            self._walk = self._next_walk = None
            return
        except Exception as exc:
            # After the pause the same page is read again.
            self._wanted.wait(self._failed(_WALK, exc, backoff))
            return
        backoff.reset()
        self._worked(_WALK)
        if more:
            # A request (or stop) ends the rest early: its urgent part must not wait.
            self._wanted.wait((monotonic_s() - began_s) * _WALK_PACE)
            return
        self.reconciles_done += 1
        report = walk.report
        if report.overdue or report.rearmed or report.lease_expired:
            logger.info("reconciliation: {}", report)
        self._walk, self._next_walk = self._next_walk, None
        if self._walk is None and not self._wanted.is_set():
            self._idle.set()

    def _prune_if_due(self, now_s: float) -> None:
        """A few batches of finished rows past their retention, every `prune_every_s` (and at
        start: a listener back from downtime starts on what piled up); a round that found more
        than it may delete is followed by another at the next check, about a second later,
        until the backlog is gone. Each round is short and each batch its own transaction:
        this thread (and the rows' locks) are never held long.

        One round every `prune_every_s` alone deletes 10,000 rows a minute at the default
        60 s, fewer than one listener finishes at 170 tasks/s: past that the ledger grew
        for as long as the load lasted."""
        settings = self.settings
        last = self._last_prune_s
        if (last is not None and now_s - last < settings.prune_every_s) or not self.schema_ready:
            return
        self._last_prune_s = now_s
        before = retention.cutoffs(
            self.clock.now_ms(),
            {
                TaskStatus.DONE: settings.retain_done_s,
                TaskStatus.CANCELLED: settings.retain_done_s,
                TaskStatus.DEAD: settings.retain_dead_s,
            },
        )
        report = retention.prune(self.store, before, max_batches=_PRUNE_BATCHES)
        self.pruned += report.total
        if report.total >= _PRUNE_BATCHES * retention.BATCH_ROWS:
            self._last_prune_s = now_s - settings.prune_every_s  # more waits: again next check
        if report.total:
            logger.info("retention: deleted {} finished row(s)", report)

    def keep_schedules(self) -> None:
        """Declare this listener's `@exposed(cron=…)` schedules (until that has worked once),
        and put back any schedule's missing occurrence row, every `SCHEDULES_CHECK_S`."""
        now_s = monotonic_s()
        if now_s - self._last_schedules_s < SCHEDULES_CHECK_S or not self.schema_ready:
            return
        self._last_schedules_s = now_s
        if not self.schedules_declared:
            try:
                self._declare_schedules()
            except (StoreError, RedisUnavailableError):
                raise  # an outage: tried again at the next check
            except KeyExpiryError as exc:
                # A definition the ledger refuses (another schedule runs that task): said once.
                logger.error("schedules not declared: {}", exc)
            self.schedules_declared = True
        self._restore_schedules()

    def _check(self) -> None:
        self._last_check_s = monotonic_s()
        try:
            self._self_check(monotonic_s())
            self._prune_if_due(monotonic_s())
            self.keep_schedules()
            self._worked("self-check")
        except redis.ReadOnlyError as exc:
            self._health.read_only(exc)
        except Exception as exc:
            self._failed_again("self-check", exc)
            if not isinstance(exc, _EXPECTED):
                self._errors.add("reconcile")
                logger.opt(exception=exc).error("self-check failed unexpectedly")
            elif self._health.subscribed.is_set():
                logger.warning("self-check failed: {}", exc)
            else:  # the subscriber's own line already says Redis is away
                logger.debug("self-check failed: {}", exc)
