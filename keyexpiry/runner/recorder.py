"""Recording outcomes: ended runs are written to the ledger in batches, retries re-armed in Redis;
a database outage holds them (never loses them), a locked or refused row holds back only its own."""

from __future__ import annotations

import sys
import threading

import redis
from loguru import logger
from redis import Redis

from keyexpiry import tracing
from keyexpiry.clock import Clock, monotonic_s
from keyexpiry.errors import StoreError
from keyexpiry.ledger.rows import Outcome, TaskStatus
from keyexpiry.ledger.store import Store
from keyexpiry.log import Tally
from keyexpiry.redis.arming import arm_keys
from keyexpiry.runner.arming import Arming
from keyexpiry.runner.claimer import FAILURE_LINE_EVERY_S
from keyexpiry.runner.inflight import DispatchStats, InFlight
from keyexpiry.settings import Settings
from keyexpiry.threads import Backoff, ThreadErrors


class Recorder:
    """Writes queued outcomes until stopped; `flush` writes what is left at shutdown."""

    def __init__(
        self,
        *,
        store: Store,
        redis: Redis,
        clock: Clock,
        settings: Settings,
        inflight: InFlight,
        stats: DispatchStats,
        errors: ThreadErrors,
        arming: Arming,
    ) -> None:
        """Outcomes written to `store`; retries and next occurrences armed in `redis` by
        `arming`'s thread, once their rows are written."""
        self.store, self.redis, self.clock, self.settings = store, redis, clock, settings
        self._arming = arming
        self._inflight = inflight
        self._stats = stats
        self._errors = errors
        # flush() retries until its deadline whatever stops the loop: its pause has no stop.
        self._never = threading.Event()
        self._failing = Tally(FAILURE_LINE_EVERY_S)

    def loop(self, stopped: threading.Event) -> None:
        """Record as outcomes arrive until `stopped` is set."""
        while not stopped.is_set():
            self._inflight.wait_outcomes(0.05)
            self.flush(deadline=None)

    def flush(self, deadline: float | None) -> None:
        """Write every queued outcome; on failure keep them and retry with backoff (until
        `deadline` on the monotonic clock, when given)."""
        settings = self.settings
        backoff = Backoff(settings.reconnect_initial_s, settings.reconnect_max_s)
        inflight = self._inflight
        while True:
            batch = inflight.take_outcomes()
            if not batch:
                return
            try:
                rearm: list[tuple[str, int]] = []
                with tracing.span("keyexpiry.record", **{"keyexpiry.outcomes": len(batch)}):
                    self.store.record(batch, self.clock.now_ms(), rearm)
                self._arm_next_occurrences(rearm)
            except Exception as exc:
                # Only an outage ends its wait when the ledger answers again (`Reconnects`): an
                # outcome the database refuses would be refused again at once.
                outage = isinstance(exc, StoreError | redis.RedisError)
                if not outage:
                    # Not an outage: some outcome the database refuses. Write the rest one by one
                    # and leave that run to its lease, rather than retry the batch forever.
                    self._errors.add("recorder")
                    logger.opt(exception=exc).error(
                        "recording {} outcome(s) failed unexpectedly; recording them one by one",
                        len(batch),
                    )
                    batch = self._record_one_by_one(batch)
                    if not batch:
                        continue
                    exc = StoreError(f"{len(batch)} outcome(s) not recorded")
                self._stats.store_errors += 1
                seen = self.store.reconnects.count if outage else sys.maxsize
                if isinstance(exc, StoreError) and exc.lock_timeout and len(batch) > 1:
                    written, batch = self._record_around_locks(batch)
                    self._after_record(written)
                    inflight.recorded(len(written))
                    if not batch:  # the lock went meanwhile: everything is written
                        continue
                inflight.put_back(batch)
                if deadline is not None and monotonic_s() > deadline:
                    logger.error(
                        "could not record {} outcome(s) before shutdown: {}; their "
                        "leases will expire and they will run again",
                        len(batch),
                        exc,
                    )
                    return
                wait_s = backoff.next_s()
                said = self._failing.add(1, monotonic_s())
                (logger.error if said else logger.debug)(
                    "recording {} outcome(s) failed: {}; retrying in {:.1f} s at most",
                    len(batch),
                    exc,
                    wait_s,
                )
                # Shortened when the ledger takes a new connection or a heartbeat: as the
                # claimer's.
                self.store.reconnects.pause(
                    self._never, seen, wait_s, min_s=self.settings.reconnect_initial_s
                )
                continue
            self._after_record(batch)
            inflight.recorded(len(batch))

    def _record_one_by_one(self, batch: list[Outcome]) -> list[Outcome]:
        """Record each outcome alone; drop (log, count) those that raise something other than a
        database outage, and return those still to write. Dropped runs stay `running` until
        their lease ends, then run again: at least once, never lost."""
        left: list[Outcome] = []
        written: list[Outcome] = []
        for outcome in batch:
            try:
                rearm: list[tuple[str, int]] = []
                self.store.record([outcome], self.clock.now_ms(), rearm)
                self._arm_next_occurrences(rearm)
                written.append(outcome)
            except (StoreError, redis.RedisError):
                left.append(outcome)
            except Exception:
                self._errors.add("recorder")
                logger.bind(key=outcome.key, attempt=0).opt(exception=True).error(
                    "could not record this outcome; the run is retried when its lease ends"
                )
        self._after_record(written)
        self._inflight.recorded(len(batch) - len(left))
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
                rearm: list[tuple[str, int]] = []
                self.store.record([outcome], self.clock.now_ms(), rearm)
                self._arm_next_occurrences(rearm)
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

    def _arm(self, what: str, items: list[tuple[str, int]]) -> None:
        """Hand `items` to the arming thread: a Redis node that stops answering holds it, not
        the recording of every outcome."""

        def arm() -> None:
            arm_keys(self.redis, items, self.clock.now_ms(), self.settings)

        self._arming.submit(what, arm)

    def _arm_next_occurrences(self, items: list[tuple[str, int]]) -> None:
        """Arm the keys of schedules' next occurrences (their rows committed)."""
        if items:
            self._arm(f"{len(items)} next occurrence(s)", list(dict(items).items()))

    def _after_record(self, batch: list[Outcome]) -> None:
        retries = [o for o in batch if o.status is TaskStatus.PENDING]
        for o in batch:
            log = logger.bind(key=o.key, attempt=0)
            if o.status is TaskStatus.DONE:
                self._stats.done += 1
                log.debug("done")
            elif o.status is TaskStatus.DEAD:
                self._stats.dead += 1
            else:
                self._stats.retried += 1
        if retries:
            self._arm(f"{len(retries)} retry key(s)", [(o.key, o.due_at_ms) for o in retries])
