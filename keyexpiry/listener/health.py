"""Loss control: is Redis still telling this listener about expired keys? The canary, the
sentinel keys, the replica (read-only) state, and the periodic self-check that repairs what no
event announced."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable

import redis
from loguru import logger
from redis import Redis

from keyexpiry.clock import monotonic_s
from keyexpiry.errors import StoreError
from keyexpiry.keys import canary_key, marker_key, sentinel_key
from keyexpiry.listener.reconcile import Reconciler
from keyexpiry.masking import mask_url
from keyexpiry.redis.server import REPLICA_PROBLEM
from keyexpiry.settings import Settings

_CANARY_PATIENCE_S = 30.0
"""How long the canary's event may lag behind a stream of other expired events."""
MARKER_EVERY_S = 1.0
UNHEARD_RUNS_EVERY_S = 1.0
"""How often due tasks of an unheard Cluster primary run from the ledger."""
"""How often each listener reads the marker (see `Health.check_marker`)."""
_CANARY_LOOKUPS = 20
"""Lookups that expire the canary, a millisecond apart (see `Health._expire_canaries`)."""


class Health:
    """What this listener knows of Redis's event flow, and the checks that keep it honest."""

    def __init__(
        self,
        *,
        redis: Redis,
        redis_url: str,
        settings: Settings,
        owner: str,
        node_tags: Callable[[], list[str]],
        on_cluster: bool = False,
        reconciler: Reconciler,
        events: Callable[[], int],
        backlog: Callable[[], int],
        request_reconcile: Callable[[str], None],
        mine: Callable[[str], bool] | None = None,
    ) -> None:
        """Canaries and sentinels set in `redis` (`redis_url` names it in logs), one per hash
        tag of `node_tags()` (one per Cluster primary when `on_cluster`)."""
        self.redis, self.redis_url, self.settings = redis, redis_url, settings
        self._node_tags, self._on_cluster = node_tags, on_cluster
        self.on_cluster = on_cluster
        """Whether Redis is a Cluster (each primary's events heard, or not, on their own)."""
        self._reconciler = reconciler
        self._events = events
        self._backlog = backlog
        self._mine = mine
        self._request_reconcile = request_reconcile
        self.subscribed = threading.Event()
        self.silent_link = False
        """True from an unanswered PING until subscribed again: not a brief reconnect, a link
        that carried nothing for `PROBE_IDLE_S + PROBE_PATIENCE_S`."""
        self.on_silent_link: Callable[[], None] | None = None
        """Called when the link is found silent (the listener beats at once: peers take its
        share at their next beat, not two beats later)."""
        self.events_arriving = True
        """False while the canary's expiry event does not come back (see `self_check`)."""
        self.problem: str | None = None
        """Why Redis cannot serve this listener right now (a replica, refused credentials)."""
        self.reconnect_wanted = False
        """Set when the subscription must be rebuilt (a lost canary looks like a dead socket)."""
        self.eviction_possible = True
        """False when the server's maxmemory-policy is noeviction (read at every connect)."""
        self.canaries_seen = 0
        self.canary = canary_key(owner, settings.key_prefix)
        self._canary_seen = threading.Event()
        self._canaries_pending: dict[bytes, str] = {}
        """Canary keys sent and not heard back yet (one per cluster primary), and their tag."""
        self._canary_sent_s: float | None = None
        self._canary_first_sent_s = 0.0  # when the canary now awaited was first sent
        self._canary_events = 0  # events heard when the canary went out
        self._last_lease_check_s = 0.0
        self._last_canary_s = 0.0
        self._marker_lock = threading.Lock()  # read at a subscription and by the marker thread
        self._markers: dict[str, str] = {}
        """The marker's token last read on each primary (by hash tag): see `check_marker`."""
        self.unheard_primaries: Callable[[], list[str]] = list
        """Cluster primaries whose events this listener cannot hear now (set by a Cluster
        subscription): while any, due tasks run from the ledger as when no event arrives."""
        self._unheard_said: tuple[str, ...] = ()
        self.markers_lost = 0
        """Times a marker was found gone or replaced: Redis lost keys (for metrics)."""

    @property
    def deaf(self) -> bool:
        """Whether due tasks run from the ledger now, not from events: the canary's event did
        not come back. A Cluster primary unheard while the others are heard is left to
        `unheard_loop`, once a second as before: there most of the share still comes by
        events, and the Cluster's fault tests with 50 ms reads failed in CI in ways not yet
        explained."""
        return not self.events_arriving

    # --- what the subscription reports --------------------------------------------------------
    def canary_arrived(self, *, expired: bool, key: bytes | None = None) -> None:
        """Our canary's event came back (expired, or evicted before it could); on a cluster,
        once every primary's canary (`key`) has."""
        if expired:
            self.canaries_seen += 1
        if key is not None:
            self._canaries_pending.pop(key, None)
            if self._canaries_pending:
                return
        self._canary_seen.set()

    def connection_gap(self) -> None:
        """The subscription dropped: the canary's event may have been lost, send another."""
        self._canary_sent_s = None

    def link_went_silent(self) -> None:
        """The subscription's PING went unanswered: mark the link silent and tell the fleet."""
        self.silent_link = True
        # Before the fleet is told: the beat it runs at once must find this listener deaf.
        self.subscribed.clear()
        if self.on_silent_link is not None:
            self.on_silent_link()

    def started(self, now_s: float) -> None:
        """The periodic checks count from now."""
        self._last_lease_check_s = now_s
        self._last_canary_s = now_s

    # --- sentinels ----------------------------------------------------------------------------
    def arm_sentinels(self, *, fresh: bool) -> None:
        """Set the sentinel keys (expiring 1..N intervals from now); `fresh` replaces them."""
        count = self.settings.sentinel_count
        if count == 0:
            return
        interval_ms = int(self.settings.sentinel_interval_s * 1000)
        pipe = self.redis.pipeline(transaction=False)
        for i, key in self._sentinel_keys():
            pipe.set(key, b"", px=i * interval_ms, nx=not fresh)
        pipe.execute()

    def _sentinel_keys(self) -> list[tuple[int, str]]:
        """(index, key) of every sentinel: `sentinel_count` on each cluster primary (a data
        loss on one node fires or removes its own), `sentinel_count` on a single server."""
        prefix = self.settings.key_prefix
        return [
            (i, sentinel_key(i, prefix) + tag)
            for tag in self._node_tags()
            for i in range(1, self.settings.sentinel_count + 1)
        ]

    def regenerate_sentinels_if_needed(self) -> None:
        """Set a fresh batch once more than half of the sentinels have fired."""
        count = self.settings.sentinel_count
        if count == 0:
            return
        pipe = self.redis.pipeline(transaction=False)
        keys = self._sentinel_keys()
        for _, key in keys:
            pipe.exists(key)
        fired = sum(1 for present in pipe.execute() if not present)
        if fired * 2 > len(keys):
            logger.info("{} of {} sentinels fired: setting a fresh batch", fired, len(keys))
            self.arm_sentinels(fresh=True)

    # --- the marker ---------------------------------------------------------------------------
    def check_marker(self) -> None:
        """Read the marker key on each primary, setting it where it is missing; a token other
        than the one read last time means Redis lost its keys since (FLUSHALL, FLUSHDB, a
        restart without persistence): reconcile now.

        Every listener compares with its own last reading, so each of them notices and runs its
        own share of the tasks that fell due meanwhile, within a second. Before, only sentinels
        that vanished said so, read once per canary interval by one listener, and the others'
        shares waited for their overdue check (`stuck_after_s` then `lease_check_s`: the soak's
        15 s FLUSHALL tail). One round trip a second; the key has no expiry, so no policy of the
        volatile kind evicts it (an `allkeys-*` one may: a reconciliation more, not a loss).
        """
        with self._marker_lock:
            lost, of = self._read_markers()
        if lost:
            self.markers_lost += 1
            where = f" on {lost} of {of} primaries" if self._on_cluster else ""
            logger.warning(
                "Redis lost keys{} (its marker key is gone: FLUSHALL, FLUSHDB or a restart "
                "without persistence): reconciling from the ledger",
                where,
            )
            self._request_reconcile("marker lost")

    def marker_loop(self, stop: threading.Event) -> None:
        """`check_marker` once a second while subscribed, until `stop`, and on a Cluster the
        canary's step too; on a thread of its own, since a primary that stops answering holds
        it for a socket timeout. Not while a primary is unheard: it may not answer (it is
        reconciled when it is subscribed again)."""
        while not stop.wait(MARKER_EVERY_S):
            if not self.subscribed.is_set() or self.unheard_primaries():
                continue
            try:
                self.check_marker()
                if self._on_cluster:
                    self._canary_step(monotonic_s())
            except (redis.RedisError, OSError) as exc:
                logger.debug("marker or canary check failed: {}", exc)

    def unheard_loop(self, stop: threading.Event) -> None:
        """On a Cluster, once a second while a primary's events go unheard: this listener's
        share of the due tasks runs from the ledger. A thread of its own that never talks to
        Redis: the periodic check that does the same shares the maintenance thread with a
        reconciliation's walk, whose reads of the paused primary's keys wait for as long as it
        is paused (the Cluster soak: one listener of three ran its share at the pause's end)."""
        while not stop.wait(UNHEARD_RUNS_EVERY_S):
            if not self.subscribed.is_set() or not self.unheard_primaries():
                continue
            try:
                self._reconciler.repair_stuck(grace_ms=0, events_arriving=False, mine=self._mine)
            except StoreError as exc:
                logger.debug("running an unheard primary's due tasks failed: {}", exc)

    def _read_markers(self) -> tuple[int, int]:
        """(primaries whose marker changed since the last reading, primaries)."""
        tags = self._node_tags()
        key = marker_key(self.settings.key_prefix)
        token = secrets.token_hex(8)
        pipe = self.redis.pipeline(transaction=False)
        for tag in tags:
            pipe.set(key + tag, token, nx=True)
            # At most 64 bytes: anyone may write there, and the value is only compared.
            pipe.getrange(key + tag, 0, 63)
        replies = pipe.execute(raise_on_error=False)
        lost: list[str] = []
        for i, tag in enumerate(tags):
            for reply in replies[2 * i : 2 * i + 2]:
                if isinstance(reply, redis.ReadOnlyError):
                    raise reply  # a replica: the listener's read-only handling says so once
            reply = replies[2 * i + 1]
            seen = type(reply).__name__ if isinstance(reply, Exception) else repr(reply)
            before = self._markers.get(tag)
            if before is not None and seen != before:
                lost.append(tag)
            self._markers[tag] = seen
        for tag in [t for t in self._markers if t not in tags]:
            del self._markers[tag]  # a primary gone from the topology
        return len(lost), len(tags)

    # --- the periodic self-check --------------------------------------------------------------
    def self_check(self, now_s: float) -> None:
        """Periodic checks that need no event to trigger them.

        - leases: runs whose listener died are found within `lease_check_s`, not at the next
          sentinel; so are pending tasks overdue by `stuck_after_s` (their key or event lost);
        - canary: a key this listener expires itself must come back as an event; while it does
          not (notifications off, a demoted master, a half-open socket), due tasks are run from
          the ledger by reconciling every canary interval, and the subscription is rebuilt;
        - sentinels: if most vanished without firing (FLUSHALL, a Redis restart while we were
          connected elsewhere), reconcile and set them again.
        """
        settings = self.settings
        began_s = monotonic_s()
        arriving = self.events_arriving and not self._deaf_to_some()
        if now_s - self._last_lease_check_s >= settings.lease_check_s or not arriving:
            self._last_lease_check_s = now_s
            self._reconciler.requeue_expired_leases()
            # Overdue rows while our claimer still has events queued are most likely among them:
            # re-arming them now would only swell the backlog. They are repaired once it drains
            # (or by the next full pass). Only our share: a live peer's are its own to repair.
            if self._backlog() == 0 or not arriving:
                # Without events the ledger is the only path: run what is due now.
                self._reconciler.repair_stuck(
                    grace_ms=int(settings.stuck_after_s * 1000) if arriving else 0,
                    events_arriving=arriving,
                    mine=self._mine,
                )
        if not self.subscribed.is_set() or self._on_cluster:
            # On a Cluster the marker's thread sends the canary (`marker_loop`, which skips an
            # unheard primary): one sent here to a paused primary waited out the socket timeout
            # in a new connection's handshake and held this thread, and so the ledger runs
            # above, with it (the Cluster soak: two listeners of three stopped them).
            return
        # The queries above take long on a loaded ledger: a canary sent at a time already past
        # would be judged lost before its event had the window it is due.
        self._canary_step(now_s + monotonic_s() - began_s)

    def _canary_step(self, now_s: float) -> None:
        """Judge the canary in flight; send one when its interval has passed, or while events
        are not arriving."""
        self._check_canary(now_s)
        if self._canary_sent_s is None and (
            now_s - self._last_canary_s >= self.settings.canary_interval_s
            or not self.events_arriving
        ):
            self._send_canary(now_s)

    def _deaf_to_some(self) -> bool:
        """Whether a Cluster primary's events go unheard now (said once per change): its keys'
        tasks would wait for it to answer again, so they run from the ledger meanwhile (found by
        the Cluster soak: a primary paused for 10 s held its tasks 10 s)."""
        unheard = tuple(self.unheard_primaries())
        if unheard != self._unheard_said:
            if unheard:
                logger.warning(
                    "not subscribed to primary {}: running its due tasks from the ledger until "
                    "its events are heard again",
                    ", ".join(unheard),
                )
            else:
                logger.info("every primary's events are heard again")
            self._unheard_said = unheard
        return bool(unheard)

    def _check_canary(self, now_s: float) -> None:
        if self._canary_sent_s is None:
            return
        events = self._events()
        if self._canary_seen.is_set():
            if not self.events_arriving:
                logger.warning("expired events are arriving again")
                if self.problem == REPLICA_PROBLEM:
                    self.problem = None
            self.events_arriving = True
            self._canary_sent_s = None
        elif (
            now_s - self._canary_sent_s > 2.0
            and events > self._canary_events
            and now_s - self._canary_first_sent_s < _CANARY_PATIENCE_S
        ):
            # Other expired events are being read: the canary's is queued behind a burst
            # (100k keys due at once), not lost. Give it another window, within a limit:
            # another application's steady stream of events must not hide a lost canary.
            self._canary_events = events
            self._canary_sent_s = now_s
        elif now_s - self._canary_sent_s > 2.0:
            if self.events_arriving:
                silent = ", ".join(sorted(self._canaries_pending.values()))
                logger.error(
                    "expired events are not arriving{} (notifications switched off, a replica, "
                    "or a dead connection?): running due tasks from the ledger until they do",
                    f" from the primary serving {silent}" if silent else "",
                )
            self.events_arriving = False
            self._canary_sent_s = None
            self.reconnect_wanted = True  # a half-open socket looks exactly like this

    def _send_canary(self, now_s: float) -> None:
        self._last_canary_s = now_s
        self._canary_seen.clear()
        self._canary_sent_s = now_s
        self._canary_first_sent_s = now_s
        self._canary_events = self._events()
        client = self.redis
        # One canary per cluster primary (a hash tag puts each on its node): a node whose
        # notifications are off is noticed like a single server's.
        tags = self._node_tags()
        canaries = {(self.canary + tag).encode(): tag for tag in tags}
        self._canaries_pending = dict(canaries) if self._on_cluster else {}
        pipe = client.pipeline(transaction=False)
        for key in canaries:
            pipe.set(key, b"", px=1)
        pipe.execute()
        self._expire_canaries(client, list(canaries))
        count = self.settings.sentinel_count
        if count:
            keys = [key for _, key in self._sentinel_keys()]
            if int(client.exists(*keys)) * 2 < len(keys):
                logger.warning("sentinels vanished without firing: reconciling")
                self._request_reconcile("sentinels missing")

    def _expire_canaries(self, client: redis.Redis, keys: list[bytes]) -> None:
        """Look the canaries up until Redis has expired them (and announced it) on the lookup.

        A lookup within the millisecond of the SET finds a key not yet past due (PTTL 0 or 1)
        and leaves it; Redis's own sweep samples random keys with a TTL and, among a million
        task keys, may not reach it for many seconds: the canary's event would come too late
        and look lost (a false "events are not arriving" alarm). Each try is ~1 ms apart.
        """
        left = keys
        for _ in range(_CANARY_LOOKUPS):
            pipe = client.pipeline(transaction=False)
            for key in left:
                pipe.pttl(key)
            left = [k for k, ttl in zip(left, pipe.execute(), strict=True) if int(ttl) >= 0]
            if not left:
                return
            time.sleep(0.001)

    def read_only(self, exc: redis.ReadOnlyError) -> None:
        """Redis refuses writes: a master demoted to replica (or a read-only replica from the
        start). Replicas never announce `expired`, so switch to running due tasks from the
        ledger, and reconnect: the connect checks the role until Redis is a master again."""
        if self.problem != REPLICA_PROBLEM:
            self.problem = REPLICA_PROBLEM
            logger.error(
                "{} ({} refused a write: {}); running due tasks from the ledger until it is a "
                "master again",
                REPLICA_PROBLEM,
                mask_url(self.redis_url),
                exc,
            )
        else:
            logger.debug("Redis still refuses writes: {}", exc)
        self.events_arriving = False
        self._canary_sent_s = None
        if self.subscribed.is_set():
            self.reconnect_wanted = True
