"""The subscription on a Redis Cluster: one pub/sub connection per primary, read through one
selector, following the topology.

Each primary announces only the keys it holds, so every primary gets its own `PubSub` on
`expired` and `evicted`; the wake channel is sharded (`SSUBSCRIBE` on the primary serving its
slot). One `select` waits on all of them and a ready connection is read with the same `_drain`
fast path as a single server's. Every `refresh_s` the slot table is read again: a primary that
appeared (failover, node added) is subscribed, one that stopped serving slots is dropped, and a
change of who serves which slots asks for a reconciliation, which finds in the ledger what
expired unheard meanwhile (events during a switch are lost by nature). A lost node connection
ends that node's subscription only; the others go on.
"""

from __future__ import annotations

import queue
import selectors
import threading
from dataclasses import dataclass
from typing import Any

import redis
from loguru import logger
from redis.crc import key_slot

from keyexpiry.clock import monotonic_s
from keyexpiry.errors import RedisConfigError
from keyexpiry.listener.subscription import (
    _MAX_MESSAGES_PER_STEP,
    _MESSAGE_TYPES,
    _PROBE,
    CONNECTION_ERRORS,
    PROBE_IDLE_S,
    PROBE_PATIENCE_S,
    Subscription,
)
from keyexpiry.redis.cluster import ClusterNodes, Topology
from keyexpiry.redis.server import (
    REPLICA_PROBLEM,
    check_notifications,
    check_replica_notifications,
    config_value,
    eviction_warning,
    subscribe_confirmed,
)

REFRESH_S = 1.0
"""How often the slot table is read: a new primary is subscribed within about this long of the
cluster announcing it (after a failover, the node timeout and the election come first)."""
RESUBSCRIBE_CONFIRM_S = 1.0
"""How long a primary has to confirm a subscription made again (on a thread of its own, while
the others' events are read); one that does not (stalled) is tried again later."""
RESUBSCRIBE_BACKOFF_MAX_S = 8.0
"""A primary that failed to subscribe is tried again after 1 s, then twice as long each time,
up to this."""


@dataclass(eq=False)
class _Feed:
    """One primary's subscription."""

    address: str
    client: redis.Redis
    pubsub: Any
    wake: bool
    """Whether this primary's subscription holds the (sharded) wake channel."""
    unread: bool = True
    """Messages may wait in the parser's buffer (select cannot tell): read before selecting."""
    heard_s: float = 0.0
    """When this primary's connection last gave anything (a message, a PONG)."""
    probe_sent_s: float | None = None
    """When a PING was sent to it that has not been answered yet."""


class ClusterSubscription(Subscription):
    """`Subscription` over every primary of a cluster (see the module docstring)."""

    refresh_s = REFRESH_S

    def __init__(self, *args: Any, cluster: ClusterNodes, **kwargs: Any) -> None:
        """`Subscription`'s arguments, and the cluster's nodes (each primary subscribed)."""
        super().__init__(*args, **kwargs)
        self.cluster = cluster
        self._feeds: dict[str, _Feed] = {}
        self._selector = selectors.DefaultSelector()
        self.topology: Topology | None = None
        self._next_refresh_s = 0.0
        self._wake_slot = key_slot(self.wake_channel.encode())
        self._node_problems: dict[str, str] = {}
        self._problem_said: str | None = None  # the Health.problem `_check_nodes` last set
        self._retry: dict[str, tuple[float, float]] = {}
        """address -> (not before, backoff s): primaries whose subscription failed or stalled."""
        self.resubscribed = 0
        """Primaries subscribed after the first connect (failover, node added, reconnects)."""
        self._joining: set[str] = set()
        """Primaries being subscribed again on a thread of their own (`_join`)."""
        self._joined: queue.SimpleQueue[tuple[str, _Feed | None, BaseException | None, int]]
        self._joined = queue.SimpleQueue()
        self._generation = 0
        """Bumped by `close`: a subscription a join made for an earlier one is closed unused."""

    @property
    def addresses(self) -> list[str]:
        """The primaries subscribed now."""
        return sorted(self._feeds)

    def unheard(self) -> list[str]:
        """Primaries serving slots that this listener is not subscribed to now (stalled,
        failing, being subscribed again): the expired events of their keys go unheard."""
        topology = self.topology
        if topology is None:
            return []
        return [a for a in topology.primaries if a not in self._feeds]

    def selected_sockets(self) -> set[int]:
        """ids of the sockets the selector waits on (for tests)."""
        return {id(key.fileobj) for key in dict(self._selector.get_map()).values()}

    def current_sockets(self) -> set[int]:
        """ids of the sockets the subscriptions read now (for tests)."""
        return {id(getattr(f.pubsub.connection, "_sock", None)) for f in self._feeds.values()}

    # --- connect ------------------------------------------------------------------------------
    def check_at_start(self) -> None:
        """`Subscription.check_at_start` on every primary (replicas are `connect`'s to check:
        one without notifications is logged, not fatal)."""
        try:
            topology = self.cluster.topology()
        except (redis.RedisError, OSError):
            return
        for address in topology.primaries:
            try:
                client = self.cluster.admin(address)
                check_notifications(client, configure=self.settings.configure_redis)
            except RedisConfigError as exc:
                raise RedisConfigError(f"cluster node {address}: {exc}") from None
            except (redis.RedisError, OSError):
                continue

    def connect(self) -> None:
        """Read the topology, check every node, subscribe every primary; at least one must be
        subscribed (the others are tried again at every refresh)."""
        health = self._health
        topology = self.cluster.topology()
        first = not self.connected_once
        self._check_nodes(topology, first=first)
        self.clock.sync()
        for address in topology.primaries:
            try:
                self._add_feed(self._open_feed(address, self._holds_wake(topology, address)))
            except CONNECTION_ERRORS as exc:
                logger.warning("cannot subscribe to primary {} yet: {}", address, exc)
        if not self._feeds:
            raise redis.ConnectionError("no cluster primary could be subscribed")
        self.topology = topology
        self._next_refresh_s = monotonic_s() + self.refresh_s
        health.subscribed.set()
        health.arm_sentinels(fresh=False)
        # From here on a FLUSHALL is told by the marker (the reconciliation below covers before).
        health.check_marker()
        reason = "reconnect" if self.connected_once else "start-up"
        self.connected_once = True
        logger.info(
            "subscribed to {} on {} of {} cluster primaries: {} ({})",
            self.channel,
            len(self._feeds),
            len(topology.primaries),
            topology.describe(),
            reason,
        )
        if health.problem not in (None, REPLICA_PROBLEM) and not self._node_problems:
            logger.warning("Redis serves this listener again (was: {})", health.problem)
            health.problem = None
        self._request_reconcile(reason)

    def _check_nodes(self, topology: Topology, *, first: bool) -> None:
        """Notifications on every node, replicas included (a replica promoted later must already
        announce expiries): turned on where missing with `configure_redis`, else a primary
        without them is an error at start-up and a logged problem later."""
        configure = self.settings.configure_redis
        self._node_problems.clear()
        policies: list[str | None] = []
        for address in topology.nodes:
            try:
                client = self.cluster.admin(address)
                primary = address in topology.slots
                if primary:
                    warning = check_notifications(client, configure=configure)
                    eviction = eviction_warning(client)
                    if eviction:
                        logger.warning("{}: {}", address, eviction)
                    policies.append(config_value(client, "maxmemory-policy"))
                else:
                    warning = check_replica_notifications(client, configure=configure)
                if warning:
                    logger.warning("{}: {}", address, warning)
            except RedisConfigError as exc:
                message = f"cluster node {address}: {exc}"
                if first and address in topology.slots:
                    raise RedisConfigError(message) from None
                self._node_problems[address] = message
                logger.error("{}", message)
            except CONNECTION_ERRORS as exc:
                logger.debug("cannot check cluster node {}: {}", address, exc)
        if self._node_problems:
            self._health.problem = self._problem_said = "; ".join(self._node_problems.values())
        elif self._problem_said is not None:
            # Said by an earlier check (a restarted primary found a replica while the slot
            # table still named it): kept, it held the listener not ready for good after a
            # failover in CI's short soak. The one clear is its own problem's.
            if self._health.problem == self._problem_said:
                logger.warning("every cluster node checks out again (was: {})", self._problem_said)
                self._health.problem = None
            self._problem_said = None
        # CONFIG blocked (None) on any primary: eviction cannot be ruled out.
        self._health.eviction_possible = any(p != "noeviction" for p in policies)

    def _holds_wake(self, topology: Topology, address: str) -> bool:
        return self.settings.driver and topology.owner(self._wake_slot) == address

    def _open_feed(self, address: str, wake: bool, *, confirm_s: float = 10.0) -> _Feed:
        """A subscription to `address`, confirmed, not yet read (`_add_feed` reads it)."""
        client = self.cluster.subscriber(address)
        untyped: Any = client  # redis-py types pubsub() from 8.2 on only
        pubsub: Any = untyped.pubsub()
        try:
            subscribe_confirmed(pubsub, [self.channel, self.evicted_channel], timeout_s=confirm_s)
            if wake:
                _ssubscribe_confirmed(pubsub, self.wake_channel, confirm_s)
        except BaseException:
            pubsub.close()
            client.close()
            raise
        pubsub.connection.register_connect_callback(self._on_reconnect)
        return _Feed(address, client, pubsub, wake, heard_s=monotonic_s())

    def _add_feed(self, feed: _Feed) -> None:
        feed.heard_s = monotonic_s()
        self._feeds[feed.address] = feed
        self._register_sockets()
        if self.connected_once:
            self.resubscribed += 1

    def _join(self, address: str, wake: bool) -> None:
        """Subscribe `address` again on a thread of its own: a node that does not answer (a
        paused or stalled primary: its connection's handshake waits for it) held the thread
        that reads every primary's events, for seconds, at each try (the Cluster soak's
        stalled primary made every task wait). `_take_joined` adds the result."""
        self._joining.add(address)
        generation = self._generation

        def join() -> None:
            try:
                feed = self._open_feed(address, wake, confirm_s=RESUBSCRIBE_CONFIRM_S)
            except Exception as exc:
                self._joined.put((address, None, exc, generation))
            else:
                self._joined.put((address, feed, None, generation))

        threading.Thread(target=join, name=f"keyexpiry-join-{address}", daemon=True).start()

    def _take_joined(self) -> None:
        """Add the subscriptions `_join` made (reconciling what their primaries' events missed
        meanwhile); schedule another try for those that failed."""
        added: list[str] = []
        while True:
            try:
                address, feed, exc, generation = self._joined.get_nowait()
            except queue.Empty:
                break
            self._joining.discard(address)
            topology = self.topology
            if feed is None:
                _, backoff_s = self._retry.get(address, (0.0, 0.5))
                backoff_s = min(backoff_s * 2, RESUBSCRIBE_BACKOFF_MAX_S)
                self._retry[address] = (monotonic_s() + backoff_s, backoff_s)
                logger.debug(
                    "cannot subscribe to primary {} yet ({}); trying again in {:g} s",
                    address,
                    exc,
                    backoff_s,
                )
                continue
            stale = generation != self._generation or address in self._feeds
            if stale or topology is None or address not in topology.slots:
                self._close_unused(feed)
                continue
            if feed.wake != self._holds_wake(topology, address):
                self._close_unused(feed)  # the wake channel moved meanwhile: joined again
                continue
            self._retry.pop(address, None)
            self._add_feed(feed)
            added.append(address)
        if added and self.topology is not None:
            self._check_nodes(self.topology, first=False)
            self.gaps += 1
            self._health.connection_gap()
            logger.warning(
                "cluster topology changed (subscribed to {}): now {}; reconciling what may have "
                "expired unheard",
                ", ".join(added),
                self.topology.describe(),
            )
            self._request_reconcile("topology")

    @staticmethod
    def _close_unused(feed: _Feed) -> None:
        try:
            feed.pubsub.close()
            feed.client.close()
        except Exception:
            pass

    # --- read ---------------------------------------------------------------------------------
    def step(self, timeout_s: float) -> int:
        """Handle the messages that arrive within `timeout_s` on any primary; refresh the
        topology when due. Return how many messages were read."""
        if self._gap.is_set():
            # redis-py reconnected a node's pub/sub on a new socket: select the new ones.
            self._register_sockets()
        self._check_gaps()
        self._take_joined()
        now_s = monotonic_s()
        if now_s >= self._next_refresh_s:
            self._refresh(now_s)
        feeds = list(self._feeds.values())
        # Messages already read off a socket into the parser (a drain cut short, a subscribe
        # confirmation read with an event behind it) are not seen by select: read those first.
        ready = [f for f in feeds if f.unread]
        if not ready:
            wait_s = max(0.0, min(timeout_s, self._next_refresh_s - monotonic_s()))
            if feeds:
                ready = [key.data for key, _ in self._selector.select(wait_s)]
            else:
                self._stop.wait(wait_s)
        count = 0
        for feed in ready:
            try:
                msg = feed.pubsub.get_message(ignore_subscribe_messages=True, timeout=0)
                if msg is not None and msg.get("type") in _MESSAGE_TYPES:
                    self._dispatch(msg["channel"], msg["data"])
                drained = self._drain(feed.pubsub)
                feed.unread = drained >= _MAX_MESSAGES_PER_STEP
                read = (msg is not None) + drained
                if read:
                    feed.heard_s, feed.probe_sent_s = monotonic_s(), None
                count += read
            except CONNECTION_ERRORS as exc:
                self._lose(feed, f"connection lost ({exc})")
        self._probe_silent(feeds)
        return count

    def _probe_silent(self, feeds: list[_Feed]) -> None:
        """Ask each silent primary's connection a PING, and drop one that leaves it unanswered
        for `PROBE_PATIENCE_S`: TCP says nothing while the link to one node is stalled (a
        network or proxy in between, a frozen node), and its keys would go unheard for as long
        as it lasts, the other primaries' events hiding it from the canary. Dropped, the
        primary is subscribed again at the next refresh, which reconciles what expired unheard
        (as `Subscription._probe` does for a single server)."""
        now_s = monotonic_s()
        for feed in feeds:
            if feed.address not in self._feeds:
                continue  # lost above
            if feed.probe_sent_s is not None:
                if now_s - feed.probe_sent_s >= PROBE_PATIENCE_S:
                    self._lose(feed, f"did not answer a PING within {PROBE_PATIENCE_S:g} s")
                    # Stalled, not gone: subscribing again at once would wait on it too.
                    self._retry[feed.address] = (now_s + 1.0, 1.0)
            elif now_s - feed.heard_s >= PROBE_IDLE_S:
                try:
                    feed.pubsub.ping(_PROBE)
                except CONNECTION_ERRORS as exc:
                    self._lose(feed, f"connection lost ({exc})")
                    continue
                feed.probe_sent_s = now_s

    def _refresh(self, now_s: float) -> None:
        """Follow the topology: subscribe new primaries, drop former ones, reconcile on change."""
        self._next_refresh_s = now_s + self.refresh_s
        try:
            topology = self.cluster.topology()
        except CONNECTION_ERRORS as exc:
            logger.warning("cannot read the cluster topology: {}", exc)
            return
        old = self.topology
        moved = topology.moved_from(old) if old is not None else []
        for address, feed in list(self._feeds.items()):
            wake_moved = feed.wake != (topology.owner(self._wake_slot) == address)
            if address not in topology.slots:
                self._lose(feed, "no longer serves any slot")
            elif wake_moved and self.settings.driver:
                self._lose(feed, "the wake channel's slot moved")
            else:
                try:
                    feed.pubsub.check_health()  # a quiet node's half-open socket shows here
                except CONNECTION_ERRORS as exc:
                    self._lose(feed, f"health check failed ({exc})")
        self.topology = topology
        for address in topology.primaries:
            if address in self._feeds or address in self._joining:
                continue
            not_before_s, _ = self._retry.get(address, (0.0, 0.5))
            if now_s >= not_before_s:
                self._join(address, self._holds_wake(topology, address))
        if moved:
            logger.warning(
                "cluster topology changed (slots moved on {}): now {}; reconciling what may "
                "have expired unheard",
                ", ".join(moved),
                topology.describe(),
            )
            self._request_reconcile("topology")

    def _lose(self, feed: _Feed, why: str) -> None:
        logger.warning("dropped the subscription to cluster node {}: {}", feed.address, why)
        self._close_feed(feed)
        # Read the slot table again soon: a replica may be promoted in its place.
        self._next_refresh_s = min(self._next_refresh_s, monotonic_s() + 0.1)

    def _register_sockets(self) -> None:
        """A fresh selector over every feed's current socket (a reconnect replaces it, and a
        closed socket's descriptor may be reused by another)."""
        self._selector.close()
        self._selector = selectors.DefaultSelector()
        for feed in self._feeds.values():
            sock = getattr(feed.pubsub.connection, "_sock", None)
            if sock is not None:
                self._selector.register(sock, selectors.EVENT_READ, feed)

    def _close_feed(self, feed: _Feed) -> None:
        self._feeds.pop(feed.address, None)
        self._register_sockets()
        try:
            if feed.pubsub.connection is not None:
                feed.pubsub.connection.deregister_connect_callback(self._on_reconnect)
            feed.pubsub.close()
            feed.client.close()
        except Exception:
            pass

    def close(self) -> None:
        """Drop every primary's subscription (those being joined are closed as they come)."""
        self._generation += 1
        while True:
            try:
                joined = self._joined.get_nowait()[1]
            except queue.Empty:
                break
            if joined is not None:
                self._close_unused(joined)
        self._joining.clear()
        for feed in list(self._feeds.values()):
            self._close_feed(feed)
        # The selector holds the file objects of closed sockets otherwise.
        self._selector.close()
        self._selector = selectors.DefaultSelector()


def _ssubscribe_confirmed(pubsub: Any, channel: str, timeout_s: float = 10.0) -> None:
    pubsub.ssubscribe(channel)
    deadline = monotonic_s() + timeout_s
    while True:
        if monotonic_s() > deadline:
            raise redis.TimeoutError(f"no ssubscribe confirmation within {timeout_s:g} s")
        msg = pubsub.get_message(timeout=max(0.0, min(0.5, deadline - monotonic_s())))
        if msg is not None and msg.get("type") == "ssubscribe":
            return
