"""The subscription: connect (checks, confirmed subscribe), read messages, reconnect with backoff.

A gap in the connection (redis-py reconnects silently, or we rebuild it) always ends in a
reconciliation: whatever expired meanwhile is found in the ledger.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import redis
from loguru import logger
from redis import Redis

from keyexpiry.clock import RedisClock, monotonic_s
from keyexpiry.errors import RedisConfigError
from keyexpiry.keys import evicted_channel, expired_channel, wake_channel
from keyexpiry.listener.health import Health
from keyexpiry.redis.sentinel import Address, follows_sentinel, prepare_replicas
from keyexpiry.redis.server import (
    REPLICA_PROBLEM,
    check_notifications,
    config_value,
    describe_redis_error,
    eviction_warning,
    subscribe_confirmed,
)
from keyexpiry.settings import Settings
from keyexpiry.threads import Backoff, ThreadErrors

CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
_MAX_MESSAGES_PER_STEP = 5000
_REST_OF_MESSAGE_S = 0.2
"""How long `_drain` waits for the rest of a message whose first bytes it has read: then it
leaves the part it has to the next read, and the PING probe judges the link (`_probe`)."""
_READ_TAKES_TIMEOUT = "timeout" in inspect.signature(redis.Connection.read_response).parameters
"""Whether this redis-py's reads take a timeout of their own (8.x does; the suite runs 8.2)."""
_MESSAGE_TYPES = ("message", "smessage")
"""Published messages: `smessage` is the wake channel's on a cluster (sharded pub/sub)."""
PROBE_IDLE_S = 0.5
"""After this long without a message the subscription is asked a PING."""
PROBE_PATIENCE_S = 1.0
"""A PING unanswered for this long means the connection is dead though TCP says nothing (a
stalled network or proxy, a frozen server): the subscription is rebuilt, and the listener's
share of the keys goes to its peers at once. Redis answers a PING in microseconds, and the
answer is looked for only after reading found nothing (a starved listener reads it late, not
never); only a command blocking the server this long trips it falsely, which costs a reconnect,
a reconciliation and the share handed over for a beat or two, nothing else. Idle and patience
together are the silence a stalled link costs before peers take over: 4 s (1 + 3, as before)
made a 10 s stall's tasks 5.3-5.7 s late at p99 in the soak, against the issue's 3 s."""
_PROBE = b"keyexpiry-probe"


class Rebuild(redis.ConnectionError):
    """Raised by `step()` to make `serve` drop the subscription and connect afresh."""


class Handlers:
    """Where messages go: looked up at each message, so a listener's handlers can be wrapped."""

    def __init__(
        self,
        key: Callable[[bytes], None],
        evicted: Callable[[bytes], None],
        wake: Callable[[bytes], None],
    ) -> None:
        self.key, self.evicted, self.wake = key, evicted, wake


class Subscription:
    """One pub/sub connection to `expired`, `evicted` and the wake channel, kept alive."""

    def __init__(
        self,
        health: Health,
        handlers: Handlers,
        *,
        redis: Redis,
        subscriber: Callable[[], Redis],
        reset_subscriber: Callable[[], None],
        clock: RedisClock,
        settings: Settings,
        db: int,
        stop: threading.Event,
        request_reconcile: Callable[[str], None],
        errors: ThreadErrors,
    ) -> None:
        """Checks made with the commands client `redis`; the pub/sub connection made on
        `subscriber()` (`reset_subscriber()` drops it, so the next is a fresh one); `clock`
        synced at every connect; channels of database `db`."""
        self.redis, self.clock, self.settings = redis, clock, settings
        self._subscriber, self._reset_subscriber = subscriber, reset_subscriber
        self._health = health
        self._handlers = handlers
        self._stop = stop
        self._request_reconcile = request_reconcile
        self._errors = errors
        self.channel = expired_channel(db)
        self.evicted_channel = evicted_channel(db)
        self.wake_channel = wake_channel(db, settings.key_prefix)
        self._evicted_bytes = self.evicted_channel.encode()
        self._wake_bytes = self.wake_channel.encode()
        self._pubsub: Any = None
        self._heard_s = 0.0
        self._probe_sent_s: float | None = None
        self._gap = threading.Event()
        self._retry_now = threading.Event()
        self._switched = False
        self._sentinel = follows_sentinel(redis)
        self.node: Address | None = None
        """The server this subscription is on (host, port), None while not subscribed."""
        self.connected_once = False
        self.gaps = 0

    def serve(self) -> None:
        """Connect and read until `stop`; never returns on an outage, only on stop (or on a
        configuration error at the very first connect, which retrying cannot fix)."""
        settings = self.settings
        backoff = Backoff(settings.reconnect_initial_s, settings.reconnect_max_s)
        health = self._health
        while not self._stop.is_set():
            try:
                self.connect()
                backoff.reset()
                while not self._stop.is_set():
                    self.step(timeout_s=0.2)
            except CONNECTION_ERRORS as exc:
                health.subscribed.clear()
                self.close()
                if self._stop.is_set():
                    break
                self.gaps += 1
                health.connection_gap()
                wait_s = backoff.next_s()
                if self._switched:
                    self._switched = False
                    backoff.reset()  # the new master is ready: no reason to wait
                    wait_s = 0.0
                if isinstance(exc, Rebuild):
                    logger.info("rebuilding the subscription")
                elif isinstance(exc, redis.AuthenticationError):
                    # A disabled or deleted ACL user, a rotated password: an outage like any
                    # other (it may be undone), so back off and retry, and say what it is.
                    health.problem = describe_redis_error(exc)
                    logger.error("{}; retrying in {:.1f} s", health.problem, wait_s)
                elif not self.connected_once:
                    # Never connected: nothing was lost; say what the user has to fix.
                    logger.error(
                        "could not connect to Redis ({}); retrying in {:.1f} s", exc, wait_s
                    )
                else:
                    logger.error("Redis connection lost ({}); retrying in {:.1f} s", exc, wait_s)
                self._wait(wait_s)
            except RedisConfigError as exc:
                if not self.connected_once:
                    raise
                # Logged once; retried quietly until fixed (e.g. a demoted master promoted back).
                if health.problem != str(exc):
                    health.problem = str(exc)
                    logger.error("{}; retrying until it is fixed", exc)
                health.events_arriving = False
                self._pause(backoff.next_s())
            except Exception:
                # A bug or an unexpected reply must not end the listener: log it, start over.
                self._errors.add("subscriber")
                logger.exception("unexpected error in the listener loop; reconnecting")
                self._pause(backoff.next_s())

    def _pause(self, seconds: float) -> None:
        self._health.subscribed.clear()
        self.close()
        self._wait(seconds)

    def _wait(self, seconds: float) -> None:
        """Wait out a backoff; `wake()` (a stop, a master switch) ends it early."""
        self._retry_now.wait(seconds)
        self._retry_now.clear()

    def wake(self) -> None:
        """End the current backoff wait now (`serve` then looks at `stop`)."""
        self._retry_now.set()

    def master_switched(self) -> None:
        """Sentinel names another master: rebuild the subscription there now (a fresh client,
        the checks, a confirmed subscribe, a reconciliation), without waiting out a backoff."""
        self._switched = True
        if self._health.subscribed.is_set():
            self._health.reconnect_wanted = True
        self._retry_now.set()

    def check_at_start(self) -> None:
        """The start checks that retrying cannot fix (notifications off, a replica), made
        before the listener writes anything: RedisConfigError here stops it. Redis out of reach
        passes: `serve` retries that, and `connect` checks again."""
        try:
            check_notifications(self.redis, configure=self.settings.configure_redis)
        except (redis.RedisError, OSError):
            pass

    def connect(self) -> None:
        """Check the server, subscribe (confirmed), arm sentinels, ask for a reconciliation."""
        client, settings, health = self.redis, self.settings, self._health
        warning = check_notifications(client, configure=settings.configure_redis)
        if warning:
            logger.warning(warning)
        # CONFIG blocked (None): eviction cannot be ruled out.
        health.eviction_possible = config_value(client, "maxmemory-policy") != "noeviction"
        eviction = eviction_warning(client)
        if eviction:
            logger.warning(eviction)
        if self._sentinel:
            # Never reuse a connection made before: a PubSub re-dials the node it had.
            self._reset_subscriber()
        self.clock.sync()
        subscriber: Any = self._subscriber()  # redis-py types pubsub() from 8.2 on only
        pubsub: Any = subscriber.pubsub()
        self._pubsub = pubsub
        channels = [self.channel, self.evicted_channel]
        if settings.driver:
            channels.append(self.wake_channel)
        subscribe_confirmed(pubsub, channels)
        # redis-py silently reconnects and re-subscribes a dropped pubsub connection; this
        # callback is how we learn of that gap.
        pubsub.connection.register_connect_callback(self._on_reconnect)
        if self._sentinel:
            self.node = (str(pubsub.connection.host), int(pubsub.connection.port))
        self._retry_now.clear()
        self._heard_s, self._probe_sent_s = monotonic_s(), None
        health.silent_link = False
        health.subscribed.set()
        health.arm_sentinels(fresh=False)
        # From here on a FLUSHALL is told by the marker (the reconciliation below covers before).
        health.check_marker()
        reason = "reconnect" if self.connected_once else "start-up"
        self.connected_once = True
        if self.node is not None:
            logger.info("subscribed to {} on master {}:{} ({})", self.channel, *self.node, reason)
        else:
            logger.info("subscribed to {} ({})", self.channel, reason)
        # A replica is over once events flow again (the canary): ROLE may be blocked by ACL.
        if health.problem is not None and health.problem != REPLICA_PROBLEM:
            logger.warning("Redis serves this listener again (was: {})", health.problem)
            health.problem = None
        self._request_reconcile(reason)
        if self._sentinel:
            # After subscribing: an unreachable replica must not delay following the master.
            self._prepare_replicas()

    def _prepare_replicas(self) -> None:
        """A failover promotes a replica: it must announce expired keys before it is one."""
        try:
            findings = prepare_replicas(self.redis, configure=self.settings.configure_redis)
        except CONNECTION_ERRORS as exc:
            logger.warning("cannot ask the sentinels for the replicas: {}", exc)
            return
        for finding in findings:
            if finding.status != "ok":
                logger.warning("{}: {}", finding.name, finding.detail)

    def step(self, timeout_s: float) -> int:
        """Handle the messages that arrive within `timeout_s`; return how many were read."""
        self._check_gaps()
        pubsub = self._pubsub
        msg = pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout_s)
        if msg is None:
            self._probe(pubsub)
            return 0
        self._heard_s, self._probe_sent_s = monotonic_s(), None
        if msg.get("type") in _MESSAGE_TYPES:
            self._dispatch(msg["channel"], msg["data"])
        return 1 + self._drain(pubsub)

    def _probe(self, pubsub: Any) -> None:
        """Ask a silent connection a PING; raise when one goes unanswered too long.

        TCP reports nothing while a network or a proxy in between is stalled, and the
        listener would count itself subscribed, keeping its share of the keys, for as long as
        the stall lasts (found by the soak). Any message read counts as an answer."""
        now_s = monotonic_s()
        if self._probe_sent_s is not None:
            if now_s - self._probe_sent_s >= PROBE_PATIENCE_S:
                self._health.link_went_silent()
                raise redis.TimeoutError(
                    f"the subscription did not answer a PING within {PROBE_PATIENCE_S:g} s"
                )
        elif now_s - self._heard_s >= PROBE_IDLE_S:
            pubsub.ping(_PROBE)
            self._probe_sent_s = now_s

    def _check_gaps(self) -> None:
        """Raise Rebuild when health wants the subscription rebuilt; after a silent reconnect
        by redis-py, count the gap and ask for a reconciliation."""
        health = self._health
        if health.reconnect_wanted:
            health.reconnect_wanted = False
            raise Rebuild("rebuilding the subscription")
        if self._gap.is_set():
            self._gap.clear()
            if self._sentinel:
                # redis-py re-subscribed on whichever node the sentinels name, unchecked.
                raise Rebuild("the subscription reconnected behind Sentinel")
            self.gaps += 1
            health.connection_gap()
            logger.warning(
                "subscription was re-established after a dropped connection; "
                "reconciling what may have expired in the gap"
            )
            self._request_reconcile("reconnect")

    def _drain(self, pubsub: Any) -> int:
        """Handle the messages already waiting on the connection, read straight off it.

        A listener of a fleet reads every expired event and claims only its share, so this
        loop's cost per message is most of what a listener spends on its peers' events:
        `get_message` wraps each read in a health check, a retry and a dict (12-15 µs a
        message with hiredis, against 6-7 µs here, measured). Anything but a plain message
        (a subscribe confirmation, a PONG) goes through `handle_message`, which keeps the
        PubSub's own state. A connection error ends the step like any other: `serve`
        reconnects and reconciles."""
        conn = pubsub.connection
        count = 0
        while count < _MAX_MESSAGES_PER_STEP and conn.can_read(timeout=0):
            # push_request: hiredis hands pub/sub messages over as push replies; without it
            # redis-py passes them to its push handler and blocks reading the next one.
            # A bounded read: `can_read` says yes as soon as any new bytes came, and the
            # subscriber has no socket timeout, so a stream that stopped half-way through a
            # message held this thread (and with it the probe, and the rebuild the canary asks
            # for) until the rest came, were it minutes.
            if _READ_TAKES_TIMEOUT:
                try:
                    reply = conn.read_response(
                        push_request=True, timeout=_REST_OF_MESSAGE_S, disconnect_on_error=False
                    )
                except redis.TimeoutError:
                    break  # the part read stays in the parser for the next read
            else:
                reply = conn.read_response(push_request=True)
            count += 1
            if isinstance(reply, list) and len(reply) == 3 and reply[0] == b"message":
                self._dispatch(reply[1], reply[2])
            else:
                msg = pubsub.handle_message(reply, ignore_subscribe_messages=True)
                if msg is not None and msg.get("type") in _MESSAGE_TYPES:
                    self._dispatch(msg["channel"], msg["data"])
        return count

    def _dispatch(self, channel: bytes, data: bytes) -> None:
        if channel == self._wake_bytes:
            self._handlers.wake(data)
        elif channel == self._evicted_bytes:
            self._handlers.evicted(data)
        else:
            self._handlers.key(data)

    def _on_reconnect(self, _connection: object) -> None:
        self._gap.set()

    def close(self) -> None:
        """Drop the pub/sub connection (safe to call when there is none)."""
        self.node = None
        if self._pubsub is not None:
            try:
                # The connection goes back to the pool with its callbacks: without this, the
                # next subscription's first connect would be taken for a dropped connection.
                if self._pubsub.connection is not None:
                    self._pubsub.connection.deregister_connect_callback(self._on_reconnect)
                self._pubsub.close()
            except Exception:
                pass
            self._pubsub = None
