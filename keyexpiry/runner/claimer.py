"""Claiming: keys heard expiring are queued once each, then claimed in batches (one ledger
transaction per batch) and handed to the workers as claimed runs.

A lone run of a method whose runs typically end within `INLINE_RUN_MAX_S`, claimed while every
worker is idle, is run by the claimer itself: a task due now then crosses two threads (the
subscription's reader, the claimer), not three, and handing it to a worker cost a thread
wake-up (7 % of a run-now listener's interpreter time for that one `release()`) and its GIL
hand-off (0.4 ms p50, 3.3 ms p99: docs/PERFORMANCE.md). The price is that the next claim waits
for that handler; so a run that goes on past `HAND_OFF_AFTER_S` while keys wait (or that the
watchdog, looking every `AWAY_CHECK_S`, finds past it) hands the claims to a new claimer thread,
and the old one ends with its run: a handler that hangs on the claimer's thread holds no claim,
and a key heard behind an unusually slow one waits ~0.05-0.1 s for its claim at most.

Long because the claim loop's every branch (flood and deaf reads of the ledger, a commit's
unknown outcome, row locks, rows that are not claimable, and the runs it keeps for itself with
their hand-off) reads and writes the same loop state (`claiming`, the intake, `_unsettled`, the
generation); split apart, each part would reach into the others' fields.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import redis
from loguru import logger
from redis import Redis

from keyexpiry import retries, tracing
from keyexpiry.clock import Clock, monotonic_s
from keyexpiry.errors import KeyExpiryError, StoreError, UnknownTaskError
from keyexpiry.keys import excerpt, parse_key
from keyexpiry.ledger.rows import TaskRow, TaskStatus
from keyexpiry.ledger.store import Store
from keyexpiry.log import SaidOnce, Tally
from keyexpiry.redis.arming import arm_keys
from keyexpiry.registry import Registry, TaskSpec
from keyexpiry.runner.arming import Arming
from keyexpiry.runner.gate import Gate
from keyexpiry.runner.inflight import ClaimedRun, DispatchStats, InFlight
from keyexpiry.runner.intake import INTAKE_MAX_KEYS, Intake
from keyexpiry.settings import Settings
from keyexpiry.threads import Backoff, ThreadErrors

_WARNED_UNKNOWN_MAX = 1000
"""Unknown classes and methods explained once each; past this many, only at debug level."""
DUE_SCAN_EVERY_S = 0.2
"""While events are dropped, or keys with no ledger row hold the queue up, the ledger is asked
this often at most which tasks are due: those go first."""
DEAF_SCAN_EVERY_S = 0.05
"""While no expired event arrives (`Claimer.deaf`), the ledger is asked this often which tasks
are due: a task then starts this late at most, not a self-check's second (the Patroni hour: a
listener deaf for 15 s ran its share up to 1.24 s late)."""
DEAF_SCAN_SHARE = 0.25
"""...but never more than this share of the time: a read that walks many due rows that are not
this listener's (a peer's backlog, tasks held by a pause) waits four times its own length, up
to `DEAF_SCAN_MAX_S`."""
DEAF_SCAN_MAX_S = 0.3
"""The longest wait between two such reads (a loaded ledger, a long walk): still a fraction of
the self-check's second, which read them before."""
DUE_PAGE_KEYS = 1024
"""Due tasks read from the ledger at a time (or 4 claims' worth, for a larger `claim_batch`)."""
FAILURE_LINE_EVERY_S = 10.0
"""A claim (or an outcome's record) failing again and again is said at most this often."""
INLINE_RUN_MAX_S = 0.001
"""A lone run is run on the claimer's thread when its method's runs here take this long or less
on average (moving, 5 % weight: one slow run keeps the method on the workers for ~90 runs)."""
HAND_OFF_AFTER_S = 0.05
"""A run on the claimer's thread going on this long while keys wait for a claim hands the claims
to a new thread. Not a couple of ms: on a loaded machine a run's time by the clock includes its
waits for the interpreter (a switch interval is 5 ms), and at 2 ms the claims changed threads
so often that run-now tasks gained nothing (docs/PERFORMANCE.md, 2026-12-07)."""
SUMMARY_EVERY_S = 60.0
"""Keys with no row and dropped events are each said once, then summed up at most this often."""


@dataclass(frozen=True)
class _Unsettled:
    """A claim whose commit's outcome is unknown: the connection broke between sending it and
    reading its answer. Its keys are claimed again under its token before any other claim."""

    keys: list[str]
    token: str
    now_ms: int
    lease_until_ms: int
    """The lost claim's times, passed again: rows it took hold its lease, and the runs must
    know that one (an outage may have eaten it: the run then extends it, under the token,
    before it starts, or finds the row taken over)."""


class Claimer:
    """The claim loop: waits for room among the workers, claims a batch, queues the runs."""

    def __init__(
        self,
        *,
        store: Store,
        redis: Redis,
        clock: Clock,
        settings: Settings,
        registry: Registry,
        owner: str,
        inflight: InFlight,
        stats: DispatchStats,
        errors: ThreadErrors,
        gate: Gate,
        arming: Arming,
    ) -> None:
        """Claims in `store` under tokens of `owner`; keys resolved by `registry`; a pending
        task whose key is gone re-armed in `redis`."""
        self.store, self.redis, self.clock = store, redis, clock
        self._arming = arming
        self.settings, self.registry, self.owner = settings, registry, owner
        batch = settings.claim_batch
        self.intake = Intake(stats, batch * 4, max(INTAKE_MAX_KEYS, batch * 16))
        self._due_page = max(DUE_PAGE_KEYS, batch * 4)
        self.find_due: Callable[[int], list[str]] | None = None
        """Up to n keys of due tasks this listener would run, read from the ledger (set by the
        listener; without it dropped events wait for the overdue check)."""
        self.deaf: Callable[[], bool] = _never
        """Whether this listener hears no expired events now (set by the listener): its due
        tasks are then read from the ledger every `DEAF_SCAN_EVERY_S`."""
        self._due_wanted = False
        self._due_read_s = -DUE_SCAN_EVERY_S
        self._deaf_every_s = DEAF_SCAN_EVERY_S
        self._claimed_at_read: int | None = None
        """Claims won when a full page of due tasks was read (None: the page was not full)."""
        self._no_row = Tally(SUMMARY_EVERY_S)
        self._dropped = Tally(SUMMARY_EVERY_S)
        self._failing = Tally(FAILURE_LINE_EVERY_S)
        self._dropped_seen = 0
        self.gate = gate
        gate.wake = self.intake.wake
        self._inflight = inflight
        self._stats = stats
        self._errors = errors
        self._seq = itertools.count(1)
        self._warned_unknown: set[str] = set()
        self._unsettled: _Unsettled | None = None
        self._refused_said = SaidOnce(limit=1_000)
        self.claiming = False
        self.stop = threading.Event()
        self.run_here: Callable[[ClaimedRun], bool] | None = None
        """Runs a claimed run on the calling thread, True when the watchdog abandoned it (set
        by the dispatcher: without it, every run goes to the workers)."""
        self.spawn: Callable[[int], None] = _nothing
        """Starts a thread running `loop` for the generation given (set by the dispatcher)."""
        self._role = threading.Lock()
        self.generation = 0
        """Which thread's `loop` claims (its generation, fixed when it was spawned): a loop of
        another ends, also one its thread's supervisor starts again after an error."""
        self._away_thread: int | None = None
        self.away_since_s: float | None = None
        """When the claiming thread began running a run itself (None: it is not)."""
        self._here: ClaimedRun | None = None
        self._away_run: ClaimedRun | None = None
        self.intake.on_queued = self._queued

    def loop(self, generation: int = 0) -> None:
        """Claim until `stop` is set, as the claimer of `generation` (until a hand-off makes
        another); whatever fails, the keys stay queued and the loop lives.

        A claim whose commit's outcome is unknown (`_Unsettled`) is claimed again under its own
        token before anything else, as soon as the ledger answers: the rows it took run now,
        not a lease later.
        """
        backoff = Backoff(self.settings.reconnect_initial_s, self.settings.reconnect_max_s)
        inflight = self._inflight
        while not self.stop.is_set() and self.generation == generation:
            unsettled, self._unsettled = self._unsettled, None
            if unsettled is not None:
                batch, token = unsettled.keys, unsettled.token
                times: tuple[int, int] | None = (unsettled.now_ms, unsettled.lease_until_ms)
            else:
                self._read_due_first()
                self._say_tallies()
                gate = self.gate
                # Deaf, the ledger is read at its own pace, not only when a key comes.
                most_s = self._deaf_every_s if self.deaf() else 0.1
                if not self.intake.wait(gate.wait_s(most_s)) and gate.wait_s(most_s) > 0:
                    continue
                with inflight.cond:
                    self.claiming = True
                    while (room := inflight.claim_room()) <= 0 and not self.stop.is_set():
                        inflight.cond.wait(0.1)
                    room = min(room, self.settings.claim_batch)
                if self.stop.is_set():
                    self.claiming = False
                    break
                batch = gate.take_ready(room)
                batch += self.intake.take(room - len(batch))
                token = f"{self.owner}:{next(self._seq)}"
                times = None
            self.claiming = True
            try:
                self._claim_batch(batch, token, times)
                if unsettled is not None:
                    self._stats.claims_settled += 1
                    logger.info(
                        "ledger answers again: the claim of {} task(s) whose commit was unknown "
                        "is settled",
                        len(batch),
                    )
                backoff.reset()
            except Exception as exc:
                # A dead claimer would leave the keys marked queued, and every later sighting
                # of them ignored.
                self._stats.store_errors += 1
                # Only an outage ends its wait when the ledger answers again: a claim that fails
                # otherwise would fail again at once.
                outage = isinstance(exc, StoreError | redis.RedisError)
                seen = self.store.reconnects.count if outage else sys.maxsize
                if self._unsettled is None:
                    self.intake.requeue(batch)
                wait_s = backoff.next_s()
                if outage:
                    # Retried as soon as a heartbeat gets through, so while the ledger takes
                    # those but refuses claims that is every beat: said once per interval.
                    said = self._failing.add(1, monotonic_s())
                    (logger.error if said else logger.debug)(
                        "claiming {} task(s) failed: {}; retrying in {:.1f} s at most",
                        len(batch),
                        exc,
                        wait_s,
                    )
                else:
                    self._errors.add("claimer")
                    logger.exception(
                        "claiming {} task(s) failed; retrying in {:.1f} s", len(batch), wait_s
                    )
                # Until the ledger takes a new connection or a heartbeat (another thread got
                # through), not the whole backoff: a failover's backlog runs once the new
                # primary answers.
                self.store.reconnects.pause(
                    self.stop, seen, wait_s, min_s=self.settings.reconnect_initial_s
                )
            finally:
                # A run kept to be run here keeps `claiming` set until it has run: a stop waits
                # for it as for a claim (it is in no queue the stop could drain).
                here, self._here = self._here, None
                if here is None:
                    self.claiming = False
            if here is not None and not self._run_here(here, generation):
                return  # another thread claims now

    def _run_here(self, run: ClaimedRun, generation: int) -> bool:
        """Run `run` on this thread (module docstring); False when the claims were handed to
        another thread meanwhile: this one ends."""
        assert self.run_here is not None
        self._stats.claimed_inline += 1
        self._away_run = run
        self._away_thread = threading.get_ident()
        self.away_since_s = monotonic_s()
        try:
            self.run_here(run)
        finally:
            with self._role:
                mine = self.generation == generation
                if mine:
                    self.away_since_s = None
                    self.claiming = False
        return mine

    def hand_off(self, force: bool = False) -> bool:
        """Start another claiming thread if this claimer's own run has gone on past
        `HAND_OFF_AFTER_S` (any time, with `force`: it is abandoned); the running one ends
        with its run. True when handed off."""
        since = self.away_since_s
        if since is None or not (force or monotonic_s() - since > HAND_OFF_AFTER_S):
            return False
        if threading.get_ident() == self._away_thread:
            return False  # the run itself (its permit given back wakes the intake) is ending
        with self._role:
            if self.away_since_s != since:
                return False  # back already, or another run
            self.away_since_s = None
            self.generation += 1
            generation = self.generation
            # The run is the old thread's now (a stop waits for it among the running ones).
            self.claiming = False
        try:
            self.spawn(generation)
        except Exception as exc:
            # No thread to hand to (the process is out of threads): the old one claims on
            # when its run returns, as if nothing had been handed.
            with self._role:
                if self.generation == generation:
                    self.generation -= 1
                    self.away_since_s = since
                    self.claiming = True
            logger.error("could not start another claiming thread: {}", exc)
            return False
        self._stats.claim_hand_offs += 1
        run = self._away_run
        log = logger if run is None else logger.bind(key=run.row.key, attempt=run.row.attempts)
        log.info(
            "run on the claiming thread for {:.0f} ms so far; another thread claims now",
            (monotonic_s() - since) * 1000,
        )
        return True

    def _queued(self) -> None:
        """Keys were queued: if the claimer is away running one, hand off once it took long."""
        if self.away_since_s is not None:
            self.hand_off()

    def _read_due_first(self) -> None:
        """While events are dropped (the intake full) or keys with no row hold the queue up,
        read the due tasks from the ledger and queue them ahead of every event: due work never
        waits behind a flood, and a dropped event of a real task costs it a moment, not its
        run."""
        intake = self.intake
        if intake.overflowed:
            intake.overflowed = False
            self._due_wanted = True
            dropped = self._stats.intake_full
            if self._dropped.add(dropped - self._dropped_seen, monotonic_s()):
                logger.warning(
                    "more task keys heard than the intake holds ({} waiting): events dropped "
                    "and counted, due tasks read from the ledger instead",
                    len(intake),
                )
            self._dropped_seen = dropped
        find_due = self.find_due
        deaf = self.deaf()
        if not (self._due_wanted or deaf) or find_due is None or intake.first_count():
            return
        now_s = monotonic_s()
        # After a full page whose tasks ran, read on at once: a backlog of dropped events (a
        # start-up after downtime) drains at the claims' pace, not a page per interval.
        full = self._claimed_at_read
        read_on = full is not None and self._stats.claimed > full
        every_s = self._deaf_every_s if deaf else DUE_SCAN_EVERY_S
        if now_s - self._due_read_s < every_s and not read_on:
            return
        self._due_read_s = now_s
        limit = self._due_page
        try:
            keys = find_due(limit)
            took_s = monotonic_s() - now_s
            self._deaf_every_s = min(
                DEAF_SCAN_MAX_S, max(DEAF_SCAN_EVERY_S, took_s / DEAF_SCAN_SHARE)
            )
        except (StoreError, redis.RedisError) as exc:
            # Still wanted: read again at the next turn. The claims fail too, and say so.
            logger.debug("reading due tasks from the ledger failed: {}", exc)
            return
        except Exception:
            self._errors.add("claimer")
            logger.exception("reading due tasks from the ledger failed")
            return
        self._due_wanted = len(keys) >= limit  # a full page: more may be due
        self._claimed_at_read = self._stats.claimed if self._due_wanted else None
        if keys:
            self._stats.found_due += len(keys)
            intake.put_first(keys)

    def _say_tallies(self) -> None:
        """Sum up what was counted and not said (keys with no row, dropped events)."""
        now_s = monotonic_s()
        if n := self._no_row.unsaid(now_s):
            logger.warning(
                "{} more task key(s) with no ledger row in the last {:g} s (forged, or rows "
                "deleted): ignored",
                n,
                SUMMARY_EVERY_S,
            )
        if n := self._dropped.unsaid(now_s):
            logger.warning(
                "{} more event(s) dropped in the last {:g} s (the intake was full): due tasks "
                "read from the ledger instead",
                n,
                SUMMARY_EVERY_S,
            )

    def unsettled_keys(self) -> int:
        """Keys of a claim whose commit's outcome is unknown, waiting to be claimed again."""
        unsettled = self._unsettled
        return 0 if unsettled is None else len(unsettled.keys)

    def _claim_batch(self, keys: list[str], token: str, times: tuple[int, int] | None) -> None:
        """Claim `keys` under `token`, at `times` (now, lease end) when repeating a claim whose
        commit's outcome is unknown, else now."""
        specs: dict[str, TaskSpec] = {}
        for key in keys:
            spec = self._spec_for_key(key)
            if spec is not None:
                specs[key] = spec
        if times is None:
            # Not a claim repeated after a lost reply: its rows may run under `token` already.
            specs = self.gate.admit(specs, token)
        if not specs:
            return
        settings = self.settings
        now_ms = self.clock.now_ms() if times is None else times[0]
        timeout_s = max(retries.timeout_s(s.options, settings) for s in specs.values())
        lease_until_ms = (
            now_ms + int((timeout_s + settings.lease_grace_s) * 1000) if times is None else times[1]
        )
        locked: set[str] = set()
        try:
            with tracing.span("keyexpiry.claim", **{"keyexpiry.keys": len(specs)}):
                rows = self.store.claim(
                    list(specs), now_ms=now_ms, lease_until_ms=lease_until_ms, token=token
                )
        except StoreError as exc:
            if not exc.lock_timeout:
                # The statement may have committed before its answer was lost (a failover, a
                # cut connection): its rows may be running under `token` with no thread to run
                # them. Only the same token finds them again.
                self._unsettled = _Unsettled(list(specs), token, now_ms, lease_until_ms)
                raise
            rows, locked = self._claim_around_locks(list(specs), exc, now_ms, lease_until_ms, token)
        except BaseException:
            # Not a commit whose outcome is unknown (above): nothing runs under `token`, so its
            # permits go back (kept, they would be refreshed for as long as this listener lives).
            self.gate.unclaimed(specs, token, specs)
            raise
        self._stats.claimed += len(rows)
        runs = [
            ClaimedRun(
                row,
                token,
                specs[row.key],
                retries.timeout_s(specs[row.key].options, settings),
                lease_until_ms,
            )
            for row in rows
        ]
        here = self._lone(runs)
        if here is None:
            self._inflight.add_claimed(runs)
        else:
            self._inflight.hold(here)
        try:
            self._after_claim(specs, rows, token, locked)
        except BaseException:
            if here is not None:
                self._inflight.runq.put([here])  # still runs, on a worker
            raise
        self._here = here

    def _lone(self, runs: list[ClaimedRun]) -> ClaimedRun | None:
        """The one run of a claim that the claimer runs itself (module docstring), or None."""
        if len(runs) != 1 or self.run_here is None:
            return None
        run = runs[0]
        spec = run.spec
        if spec.is_async or spec.options.transactional:
            return None
        runq = self._inflight.runq
        if len(runq) or runq.active() or self.stop.is_set():
            return None
        typical_s = self._inflight.typical_run_s(spec)
        return run if typical_s is not None and typical_s <= INLINE_RUN_MAX_S else None

    def _after_claim(
        self, specs: dict[str, TaskSpec], rows: list[TaskRow], token: str, locked: set[str]
    ) -> None:
        """Flow permits of the keys not claimed given back; those keys explained, and a pending
        task's missing key re-armed."""
        claimed = {r.key for r in rows}
        # Keys left to be claimed again under `token` (a connection lost among the one-by-one
        # claims) keep their permits: that claim is not admitted again.
        unsettled = self._unsettled
        again = set(unsettled.keys) if unsettled is not None and unsettled.token == token else set()
        self.gate.unclaimed(specs, token, (k for k in specs if k not in claimed and k not in again))
        # A locked row is left to the overdue check: re-armed now, it would come straight back
        # and wait on the lock again.
        unclaimed = [k for k in specs if k not in claimed and k not in locked]
        if unclaimed:
            self._stats.not_claimed += len(unclaimed)
            self._check_unclaimed(unclaimed)

    def _claim_around_locks(
        self, keys: list[str], exc: StoreError, now_ms: int, lease_until_ms: int, token: str
    ) -> tuple[list[TaskRow], set[str]]:
        """Another transaction held one of these rows past the lock wait timeout: claim the keys
        one by one so only the locked rows are left behind, pending. Retrying those at once would
        keep the claimer waiting on the lock; the overdue check offers them again later.
        Returns the rows claimed and the keys found locked.
        """
        self._stats.store_errors += 1
        if len(keys) == 1:
            _log_locked(keys[0], exc)
            return [], set(keys)
        logger.warning(
            "claiming {} task(s) waited too long on a row lock ({}); claiming them one by one",
            len(keys),
            exc,
        )
        # Each claim reads back its key's row if the token holds it, also when an earlier
        # statement of the failed claim (autocommitted) took it.
        rows: dict[int, TaskRow] = {}
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
                    self._unsettled = _Unsettled(keys[i:], token, now_ms, lease_until_ms)
                    break
                _log_locked(key, err)
                locked.add(key)
        return list(rows.values()), locked

    def _spec_for_key(self, key: str) -> TaskSpec | None:
        try:
            parsed = parse_key(key, prefix=self.settings.key_prefix)
            return self.registry.resolve(parsed.class_name, parsed.method)
        except UnknownTaskError as exc:
            self._stats.ignored += 1
            self._note_unknown(key, exc)
            return None
        except KeyExpiryError as exc:
            self._stats.ignored += 1
            # Its row is re-armed by every overdue check and comes back: said once per key.
            log = logger.bind(key=excerpt(key), attempt=0)
            if self._refused_said.first(key):
                log.warning("ignored key: {}", exc)
            else:
                log.debug("ignored key again: {}", exc)
            return None

    def _note_unknown(self, key: str, exc: UnknownTaskError) -> None:
        """Say once per unknown class (or method), not once per key of another app's
        `user@bob`, what becomes of such a key: a real task waits for a listener that has its
        class; a key with no ledger row was never a task."""
        if str(exc) in self._warned_unknown:
            return
        if len(self._warned_unknown) >= _WARNED_UNKNOWN_MAX:
            # Forged keys may name endless made-up classes: what is said once is kept bounded.
            logger.bind(key=excerpt(key), attempt=0).debug("{}: ignored", exc)
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
        rowless: list[str] = []
        for key in keys:
            row = rows.get(key)
            if row is None:
                rowless.append(key)
            elif row.status is TaskStatus.PENDING:
                # A stale event (task rescheduled), this host's clock a hair behind Redis's, or
                # a row that fell due since the claim: if its key is gone, nothing else would
                # announce it (a due time already past expires at once).
                rearm.append(row)
            else:
                logger.bind(key=key, attempt=row.attempts).debug(
                    "not claimed: task is {}", row.status
                )
        if rowless:
            self._note_rowless(rowless)
        if rearm:
            # On the arming thread: a node that stops answering must not hold every claim.
            self._arming.submit(
                f"{len(rearm)} unclaimed pending task(s) whose key may be gone",
                lambda: self._rearm_missing(rearm),
            )

    def _rearm_missing(self, rows: list[TaskRow]) -> None:
        """Arm the keys of `rows` that Redis does not hold."""
        existing = self.redis.pipeline(transaction=False)
        for row in rows:
            existing.exists(row.key)
        present = existing.execute()
        missing = [r for r, p in zip(rows, present, strict=True) if not p]
        # Set only if still missing: a reschedule since set the new due.
        arm_keys(
            self.redis,
            [(r.key, r.due_at_ms) for r in missing],
            self.clock.now_ms(),
            self.settings,
            missing=True,
        )

    def _note_rowless(self, keys: list[str]) -> None:
        """A registered task's key with no row: a create whose commit the ledger lost (a
        failover under asynchronous replication), a row deleted by hand, a key set without
        one, or a forged event. Nothing can run it; an operator should hear of it, once a
        minute, not once a key (anyone who may PUBLISH can send a million)."""
        self._stats.no_row += len(keys)
        if len(self.intake):
            # Keys with no row ahead of others: real tasks may be waiting behind a flood.
            self._due_wanted = True
        if self._no_row.add(len(keys), monotonic_s()):
            more = f" ({len(keys) - 1} more such key(s) in this claim)" if len(keys) > 1 else ""
            logger.bind(key=keys[0], attempt=0).warning(
                "no ledger row for this task's key (lost or never written): ignored{}", more
            )


def _never() -> bool:
    return False


def _nothing(_generation: int) -> None:
    pass


def _log_locked(key: str, exc: StoreError) -> None:
    logger.bind(key=key, attempt=0).warning(
        "row locked by another transaction ({}); left pending, the overdue check tries it again",
        exc,
    )
