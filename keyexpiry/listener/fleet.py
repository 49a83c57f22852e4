"""Listeners know each other by heartbeats: each writes its row every `heartbeat_s`; one silent
for `takeover_after_s` is dead, and whichever live listener notices first requeues its running
tasks. A killed listener's work then waits seconds, not its handlers' timeout plus the lease
grace; a slow listener keeps beating (its own thread), so its runs are never taken.

Only a listener that has itself beaten without a gap for a whole takeover window judges others:
after a database outage (or this process being frozen) every heartbeat is old, and the first
listener back must not take over peers that are alive but have not had their turn to beat.

Each beat also reads who is live and recomputes this listener's share of the keys
(`keyexpiry.listener.partition`): a peer silent for three beats is out of the share already
(its runs are still its own until `takeover_after_s`); buckets a listener gains had no
listener, so their overdue rows are run now.

A listener that hears nothing from Redis (its subscription lost, or silent past the probe's
answer) for two beats in a row announces no classes: its peers take its share at their next
beat and run what became overdue meanwhile, while its heartbeat, and so its runs, go on. Without
this, a listener cut off from Redis but not from the ledger kept its share, and every task of
that share waited for Redis to come back (found by the soak: a 10 s stall made a third of the
tasks due in it up to 11.7 s late)."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable

import redis
from loguru import logger

from keyexpiry.clock import RedisClock, monotonic_s
from keyexpiry.errors import StoreError
from keyexpiry.keys import task_class_of
from keyexpiry.ledger.heartbeats import ListenerRow
from keyexpiry.ledger.store import Store
from keyexpiry.listener.partition import BUCKETS, Partition, bucket_of
from keyexpiry.listener.reconcile import Reconciler
from keyexpiry.log import SaidOnce
from keyexpiry.registry import Registry
from keyexpiry.settings import Settings

# More overdue rows than this at a takeover are left to the periodic overdue repair (re-armed).
_CATCH_UP_ROWS = 10_000


def share_silence_s(settings: Settings) -> float:
    """How long a listener's heartbeat may be silent before peers drop it from the share of the
    keys: three beats (at least 2 s), at most `takeover_after_s`.

    Sooner than the takeover of its runs: a wrong drop only makes two listeners try the same
    keys for a moment (the claim still picks one), while a dead listener's share waits for
    this long with nobody claiming it. A floor of 2 s keeps a beat delayed by a loaded machine
    from reshuffling the share."""
    return min(settings.takeover_after_s, max(3 * settings.heartbeat_s, 2.0))


class Fleet:
    """This listener's heartbeat and the takeover of silent peers."""

    def __init__(
        self,
        *,
        store: Store,
        clock: RedisClock,
        settings: Settings,
        registry: Registry,
        owner: str,
        reconciler: Reconciler,
        running: Callable[[], int],
        submit: Callable[[list[str]], None] | None = None,
        hearing: Callable[[], bool] | None = None,
        silent_link: Callable[[], bool] | None = None,
    ) -> None:
        """Heartbeats of `owner` (announcing `registry`'s classes) written to `store`, timed
        by `clock`'s extrapolation (a beat never waits on Redis)."""
        self.store, self.clock, self.settings = store, clock, settings
        self.registry, self.owner = registry, owner
        self._hearing = hearing
        self._silent_link = silent_link
        self._heard = True
        self._poke = threading.Event()
        self.away = False
        """True while this listener hears nothing from Redis and announces no classes."""
        self._reconciler = reconciler
        self._running = running
        self._submit = submit
        # Buckets given up are kept for two beats: peers read the change within one.
        self.partition = Partition(owner, registry.class_names(), hold_s=2 * settings.heartbeat_s)
        self.caught_up = 0
        """Overdue tasks of gained buckets handed to the claimer (their events had no one)."""
        self._started_ms: int | None = None
        self.failing = False
        """True while heartbeats cannot be written (peers will take this listener's runs)."""
        self.beats = 0
        self.failed_beats = 0
        self._steady_since_s: float | None = None
        """Monotonic time since which this listener's beats have come without a gap."""
        self._last_beat_s = -1e18
        self.takeovers = 0
        """Silent listeners whose runs this one requeued."""
        self._alive_said = SaidOnce(limit=1000)
        """Peers found alive in spite of an old heartbeat, said once each."""

    def beat(self) -> None:
        """Write the heartbeat, then take over any peer silent for too long."""
        now_ms = self.clock.extrapolated_ms()
        if self._started_ms is None:
            self._started_ms = now_ms
        classes = self.registry.class_names()
        self._note_hearing()
        row = ListenerRow(
            self.owner, socket.gethostname(), os.getpid(), self._started_ms, now_ms,
            self._running(), frozenset() if self.away else classes,
        )  # fmt: skip
        self.partition.set_classes(classes)
        self.store.beat(row)
        # Threads waiting out a backoff after a ledger outage may try again now.
        self.store.reconnects.answered()
        self.beats += 1
        settings = self.settings
        self._share(now_ms - int(share_silence_s(settings) * 1000), now_ms)
        beat_s = monotonic_s()
        if self._steady_since_s is None or beat_s - self._last_beat_s > 2 * settings.heartbeat_s:
            self._steady_since_s = beat_s  # a gap (outage, freeze): start a new streak
        self._last_beat_s = beat_s
        if beat_s - self._steady_since_s < settings.takeover_after_s:
            return
        silent_before = now_ms - int(settings.takeover_after_s * 1000)
        for peer in self.store.silent(silent_before):
            if peer != self.owner:
                self._take_over(peer, silent_before)

    def poke(self) -> None:
        """Beat now rather than at the next interval (the link to Redis was found silent, or
        the listener is stopping)."""
        self._poke.set()

    def _note_hearing(self) -> None:
        """Go away after two beats without hearing Redis (one would hand the share over at
        every brief reconnect), or at once when the link was found silent (an unanswered PING:
        seconds of silence already, no brief reconnect); come back at the first beat that
        hears it."""
        hearing = self._hearing is None or self._hearing()
        silent = self._silent_link is not None and self._silent_link()
        away = not hearing and (not self._heard or silent)
        self._heard = hearing
        if away and not self.away:
            logger.warning(
                "not subscribed to Redis: peers take this listener's share of the keys until it "
                "subscribes again (its running tasks stay its own)"
            )
        elif self.away and not away:
            logger.info("subscribed again: taking this listener's share of the keys back")
        self.away = away

    def _share(self, live_since_ms: int, now_ms: int) -> None:
        members = self.store.live_members(live_since_ms)
        before = self.partition.peers
        gained = self.partition.update(members, monotonic_s())
        if self.partition.peers != before:
            logger.info(
                "sharing the task keys with {} other listener(s): {} of {} buckets here",
                self.partition.peers,
                self.partition.owned_buckets(),
                len(self.partition.classes) * BUCKETS,
            )
        if gained:
            # Due up to now, not up to the beat's start: a key that fell due while the members
            # were read had its event heard and dropped (the bucket still a peer's), and only
            # this read finds it (the Patroni hour: 7 tasks of a frozen peer's share waited
            # 12-14 s for the overdue check).
            self._catch_up(gained, max(now_ms, self.clock.extrapolated_ms()))

    def _catch_up(self, gained: dict[str, set[int]], now_ms: int) -> None:
        """Run the overdue rows of buckets just gained: while nobody owned them (a peer died,
        not yet silent long enough), their expired events were heard and dropped by all."""
        if self._submit is None:
            return
        prefix = self.settings.key_prefix.encode()

        def gained_key(key: str) -> bool:
            raw = key.encode()
            buckets = gained.get(task_class_of(raw, prefix) or "")
            return buckets is not None and bucket_of(raw) in buckets

        # Paged past the overdue rows of other buckets, which may come first by the thousand.
        keys = [k for k, _ in self._reconciler.overdue_keys(now_ms, _CATCH_UP_ROWS, gained_key)]
        if keys:
            self.caught_up += len(keys)
            logger.info("{} overdue task(s) of buckets taken over: claiming them", len(keys))
            self._submit(keys)

    def stopping(self) -> bool:
        """Begin a graceful stop: mark this listener's row so peers take its keys at their next
        beat. Return whether any peer shares them (then keep serving for `partition.hold_s`)."""
        if self.partition.peers == 0:
            return False
        try:
            self.store.mark_stopping(self.owner, self.clock.extrapolated_ms())
        except (StoreError, redis.RedisError, OSError) as exc:
            logger.warning("could not hand this listener's keys over before stopping: {}", exc)
            return False
        return True

    def _take_over(self, peer: str, silent_before_ms: int) -> None:
        report = self._reconciler.requeue_runs_of(peer, silent_before_ms)
        if report.claimed_since_silent:
            if self._alive_said.first(peer):
                logger.warning(
                    "listener {} looks silent for over {:g} s but claimed {} run(s) since: "
                    "alive (its heartbeat was written late); its runs stay its own",
                    peer,
                    self.settings.takeover_after_s,
                    report.claimed_since_silent,
                )
            return
        # Deleted only if still silent: a paused listener that resumed meanwhile keeps its row.
        if self.store.forget(peer, silent_before_ms=silent_before_ms):
            self.takeovers += 1
            logger.warning(
                "listener {} silent for over {:g} s: took over, {} running task(s) requeued, "
                "{} dead",
                peer,
                self.settings.takeover_after_s,
                report.lease_expired - report.dead,
                report.dead,
            )

    def loop(self, stopped: threading.Event) -> None:
        """Beat every `heartbeat_s` until `stopped`; then remove this listener's row."""
        while not stopped.is_set():
            try:
                self.beat()
                if self.failing:
                    logger.info("heartbeats are written again")
                self.failing = False
            except (StoreError, redis.RedisError, OSError) as exc:
                self._steady_since_s = None
                self.failed_beats += 1
                if not self.failing:
                    logger.warning("cannot write this listener's heartbeat: {}", exc)
                self.failing = True
            # `poke` cuts the wait short; stopping pokes too (`stopped` alone would wait).
            self._poke.wait(self.settings.heartbeat_s)
            self._poke.clear()
        self.leave()

    def leave(self) -> None:
        """Remove this listener's row (a clean stop is not a death to take over)."""
        try:
            self.store.forget(self.owner)
        except (StoreError, redis.RedisError, OSError) as exc:
            logger.debug("could not remove this listener's heartbeat row: {}", exc)
