"""The long-running subscriber: expired events in, dispatched tasks out, forever.

The loop is trivial and the work is in `step()`, so tests can drive one step at a time. Anything a
Redis key says is checked before it reaches the dispatcher: other applications' keys are dropped
without a word, a key that claims to be a task but cannot be one is logged once (as a short
excerpt) and dropped, and an oversized key is never decoded or queued.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import redis
from loguru import logger

from keyexpiry.arming import WAKE_MAX_BYTES, parse_wake
from keyexpiry.clock import monotonic_s
from keyexpiry.dispatch import Dispatcher
from keyexpiry.driver import ExpiryDriver
from keyexpiry.errors import KeyFormatError, RedisConfigError, StoreError
from keyexpiry.keys import (
    INTERNAL_MARK,
    MAX_KEY_BYTES,
    SENTINEL_MARK,
    canary_key,
    evicted_channel,
    excerpt,
    expired_channel,
    parse_key,
    sentinel_key,
    task_class_of,
    wake_channel,
)
from keyexpiry.reconcile import Reconciler
from keyexpiry.redis_server import (
    REPLICA_PROBLEM,
    check_notifications,
    config_value,
    describe_redis_error,
    eviction_warning,
    subscribe_confirmed,
)
from keyexpiry.registry import Registry
from keyexpiry.runtime import Runtime
from keyexpiry.settings import Settings, mask_url
from keyexpiry.store import Store
from keyexpiry.threads import ThreadErrors, spawn

_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


class _Rebuild(redis.ConnectionError):
    """Raised by `step()` to make `_serve` drop the subscription and connect afresh."""


_MAX_MESSAGES_PER_STEP = 5000
_CANARY_PATIENCE_S = 30.0
"""How long the canary's event may lag behind a stream of other expired events."""


def _well_formed(key: str) -> bool:
    try:
        parse_key(key)
    except KeyFormatError:
        return False
    return True


class Listener:
    """Subscribes to expired events and runs the tasks they name, once per claim.

    Reconnects with capped exponential backoff and reconciles after every gap; never exits on a
    Redis or database outage. `stop()` (or SIGTERM/SIGINT) ends `run()` gracefully.
    """

    def __init__(
        self,
        settings: Settings,
        registry: Registry | None = None,
        *,
        store: Store | None = None,
        owner: str | None = None,
    ) -> None:
        self.rt = Runtime.open(settings, registry, store=store, owner=owner)
        rt = self.rt
        # Shorthands: tests and status read these.
        self.settings, self.registry, self.store = settings, rt.registry, rt.store
        self.redis, self.clock, self.owner, self.redis_url = (
            rt.redis,
            rt.clock,
            rt.owner,
            rt.redis_url,
        )
        self.db = rt.db
        self.channel = expired_channel(self.db)
        self.evicted_channel = evicted_channel(self.db)
        self._evicted_channel_bytes = self.evicted_channel.encode()
        self.dispatcher = Dispatcher(rt)
        self.reconciler = Reconciler(rt, submit=self.dispatcher.submit)
        self.driver = ExpiryDriver(rt)
        self.wake_channel = wake_channel(self.db, settings.key_prefix)
        self._wake_channel_bytes = self.wake_channel.encode()
        self.subscribed = threading.Event()
        self.reconciles_done = 0
        self.gaps = 0
        self.events = 0
        self._refused = 0
        self.foreign = 0
        """Expired keys of other applications, dropped without a word."""
        self.wakes_refused = 0
        """Wake messages too long to be keyexpiry's, dropped undecoded."""
        self._prefix_bytes = settings.key_prefix.encode()
        self._internal_bytes = (settings.key_prefix + INTERNAL_MARK).encode()
        self._sentinel_bytes = (settings.key_prefix + SENTINEL_MARK).encode()
        self._stop = threading.Event()
        self._gap = threading.Event()
        self._reconcile_wanted = threading.Event()
        self._reconcile_idle = threading.Event()
        self._pubsub: Any = None
        self._connected_once = False
        self._schema_ready = False
        self._canary = canary_key(self.owner, settings.key_prefix)
        self._canary_bytes = self._canary.encode()
        self._canary_seen = threading.Event()
        self._canary_sent_s: float | None = None
        self._canary_first_sent_s = 0.0  # when the canary now awaited was first sent
        self._canary_events = 0  # `events` when the canary went out
        self.events_arriving = True
        self.problem: str | None = None
        """Why Redis cannot serve this listener right now (a replica, refused credentials)."""
        self.evicted = 0
        """Task keys Redis evicted (maxmemory) that were handed back to the ledger."""
        self.canaries_seen = 0
        self._eviction_possible = True
        self._eviction_warned = False
        self._reconnect_wanted = False
        self._last_lease_check_s = 0.0
        self._last_canary_s = 0.0
        """False while the canary's expiry event does not come back (see `_self_check`)."""

    # --- public -------------------------------------------------------------------------------
    def run(self) -> None:
        """Listen until `stop()`; then shut down gracefully."""
        restore = self._install_signal_handlers()
        logger.info(
            "listener {} starting: redis {}, ledger {}, {} task method(s), concurrency {}",
            self.owner,
            mask_url(self.redis_url),
            mask_url(self.store.engine.url.render_as_string(hide_password=True)),
            len(self.registry.specs()),
            self.settings.concurrency,
        )
        self._ensure_schema()
        self.dispatcher.start()
        if self.settings.driver:
            self.driver.start(self.thread_errors)
        reconcile_thread = spawn(
            "reconcile", self._reconcile_loop, stopped=self._stop, errors=self.thread_errors
        )
        try:
            self._serve()
        finally:
            self.subscribed.clear()
            logger.info(
                "listener stopping: finishing running handlers (up to {:g} s)",
                self.settings.shutdown_timeout_s,
            )
            self.driver.stop()
            self.dispatcher.stop(self.settings.shutdown_timeout_s)
            self._close_pubsub()
            self._reconcile_wanted.set()
            reconcile_thread.join(timeout=5)
            self.rt.close()
            restore()
            logger.info("listener stopped")

    def _ensure_schema(self) -> None:
        """Create the ledger table before any thread queries it (a fresh state dir has none);
        a database that is down now is retried by the reconcile loop."""
        try:
            self.store.create_schema()
            self._schema_ready = True
        except StoreError as exc:
            logger.error("ledger not reachable at start-up ({}); retrying", exc)

    @property
    def thread_errors(self) -> ThreadErrors:
        """Unexpected exceptions the listener's threads survived (each logged with its key)."""
        return self.dispatcher.thread_errors

    @property
    def ignored(self) -> int:
        """Expired keys that claimed to be tasks but were not runnable ones (logged once each)."""
        return self._refused + self.dispatcher.stats.ignored

    def status(self) -> dict[str, object]:
        """What the listener sees now: subscription, event flow, the current Redis problem."""
        return {
            "owner": self.owner,
            "subscribed": self.subscribed.is_set(),
            "events_arriving": self.events_arriving,
            "problem": self.problem,
            "events": self.events,
            "gaps": self.gaps,
            "evicted": self.evicted,
            "done": self.dispatcher.stats.done,
            "thread_errors": self.thread_errors.count,
        }

    def stop(self) -> None:
        """Ask `run()` to finish (safe from any thread or a signal handler)."""
        self._stop.set()
        self._reconcile_wanted.set()

    def request_reconcile(self, reason: str) -> None:
        """Run a reconciliation soon on the reconcile thread (coalesced)."""
        logger.debug("reconciliation requested: {}", reason)
        self._reconcile_idle.clear()
        self._reconcile_wanted.set()

    def wait_reconciled(self, timeout_s: float) -> bool:
        """Wait until no reconciliation is requested or running (a test sync point)."""
        return self._reconcile_idle.wait(timeout_s)

    def step(self, timeout_s: float) -> int:
        """Handle the events that arrive within `timeout_s`; return how many were read."""
        if self._reconnect_wanted:
            self._reconnect_wanted = False
            raise _Rebuild("rebuilding the subscription")
        if self._gap.is_set():
            self._gap.clear()
            self.gaps += 1
            self._canary_sent_s = None  # its event may have been lost in the gap: send another
            logger.warning(
                "subscription was re-established after a dropped connection; "
                "reconciling what may have expired in the gap"
            )
            self.request_reconcile("reconnect")
        pubsub = self._pubsub
        msg = pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout_s)
        count = 0
        while msg is not None:
            count += 1
            if msg.get("type") == "message":
                if msg["channel"] == self._wake_channel_bytes:
                    self.handle_wake(msg["data"])
                elif msg["channel"] == self._evicted_channel_bytes:
                    self.handle_evicted(msg["data"])
                else:
                    self.handle_key(msg["data"])
            if count >= _MAX_MESSAGES_PER_STEP:
                break  # a message read is always handled; the rest waits for the next step
            msg = pubsub.get_message(ignore_subscribe_messages=True, timeout=0)
        return count

    def handle_key(self, raw: bytes | str) -> None:
        """Route one expired key: sentinel → reconcile; task key → dispatcher; else ignore.

        Keys of other applications sharing the database are dropped silently (counted in
        `foreign`): those outside the prefix and, with no prefix, those not shaped like
        `Class@...` for a registered class (an unregistered class's well-formed key may be a
        task for another listener: the claimer logs it once). A key that claims to be ours but
        cannot be a task key is logged once, as a short excerpt; one over the key limit is never
        decoded or queued.
        """
        self.events += 1
        data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogateescape")
        prefix = self._prefix_bytes
        if not data.startswith(prefix):
            self.foreign += 1
            return
        if data.startswith(self._internal_bytes):
            self._handle_internal(data)
            return
        class_name = task_class_of(data, prefix)
        ours = bool(prefix) or (class_name is not None and self.registry.has_class(class_name))
        if len(data) > MAX_KEY_BYTES:
            self._refuse(data, f"longer than the {MAX_KEY_BYTES}-byte key limit", ours=ours)
            return
        try:
            key = data.decode("utf-8")
        except UnicodeDecodeError:
            self._refuse(data, "not valid UTF-8", ours=ours)
            return
        if not ours and not _well_formed(key):
            self.foreign += 1
            return
        # Parsed (and refused if malformed) once, by the claimer: not here as well.
        self.dispatcher.submit([key])

    def handle_evicted(self, raw: bytes | str) -> None:
        """A key Redis evicted under maxmemory: its `expired` event will never come, so hand a
        task key to the claimer now: it runs it if due, else re-arms its missing key."""
        data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogateescape")
        if len(data) > MAX_KEY_BYTES or not data.startswith(self._prefix_bytes):
            return  # not ours (and never decode a huge foreign key)
        if data == self._canary_bytes:
            self._canary_seen.set()  # evicted before it expired: events do arrive
            return
        if data.startswith(self._internal_bytes):
            return  # another listener's canary, a sentinel: the self-checks notice those
        try:
            key = data.decode("utf-8")
            parse_key(key, prefix=self.settings.key_prefix)
        except (UnicodeDecodeError, KeyFormatError):
            return  # the application's own keys are evicted too: not ours, not worth a line
        self.evicted += 1
        # Under noeviction Redis evicts nothing: such a message was published by someone else.
        # The claimer still checks the key (harmless), but no maxmemory alarm is raised.
        if self._eviction_possible and not self._eviction_warned:
            self._eviction_warned = True
            logger.warning(
                "Redis is evicting task keys (maxmemory): each is re-armed or run from the "
                "ledger; set maxmemory-policy noeviction"
            )
        logger.bind(key=key, attempt=0).debug("task key evicted: handed to the claimer")
        self.dispatcher.submit([key])

    def handle_wake(self, data: bytes) -> None:
        """Hand the tasks a wake message announces to the driver; a message longer than any
        keyexpiry sends is dropped undecoded (logged the first time)."""
        if len(data) > WAKE_MAX_BYTES:
            self.wakes_refused += 1
            if self.wakes_refused == 1:
                logger.warning(
                    "ignored a {}-byte message on {}: longer than keyexpiry sends",
                    len(data),
                    self.wake_channel,
                )
            return
        self.driver.note(parse_wake(data))

    def _handle_internal(self, data: bytes) -> None:
        if data == self._canary_bytes:
            self.canaries_seen += 1
            self._canary_seen.set()
        elif data.startswith(self._sentinel_bytes):
            logger.info("sentinel {} fired: reconciling", excerpt(data))
            self.request_reconcile("sentinel")
        # Else another listener's canary, an expired driver lock: ours, not a task.

    def _refuse(self, data: bytes, reason: str, *, ours: bool) -> None:
        if not ours:
            self.foreign += 1
            return
        self._refused += 1
        logger.bind(key=excerpt(data), attempt=0).warning("ignored key: {}", reason)

    # --- connection ---------------------------------------------------------------------------
    def _serve(self) -> None:
        backoff_s = self.settings.reconnect_initial_s
        while not self._stop.is_set():
            try:
                self._connect()
                backoff_s = self.settings.reconnect_initial_s
                while not self._stop.is_set():
                    self.step(timeout_s=0.2)
            except _CONNECTION_ERRORS as exc:
                self.subscribed.clear()
                self._close_pubsub()
                if self._stop.is_set():
                    break
                self.gaps += 1
                self._canary_sent_s = None
                if isinstance(exc, _Rebuild):
                    logger.info("rebuilding the subscription")
                elif isinstance(exc, redis.AuthenticationError):
                    # A disabled or deleted ACL user, a rotated password: an outage like any
                    # other (it may be undone), so back off and retry, and say what it is.
                    self.problem = describe_redis_error(exc)
                    logger.error("{}; retrying in {:.1f} s", self.problem, backoff_s)
                else:
                    logger.error("Redis connection lost ({}); retrying in {:.1f} s", exc, backoff_s)
                self._stop.wait(backoff_s)
                backoff_s = min(backoff_s * 2, self.settings.reconnect_max_s)
            except RedisConfigError as exc:
                if not self._connected_once:
                    raise
                # Logged once; retried quietly until fixed (e.g. a demoted master promoted back).
                if self.problem != str(exc):
                    self.problem = str(exc)
                    logger.error("{}; retrying until it is fixed", exc)
                self.events_arriving = False
                self._pause(backoff_s)
                backoff_s = min(backoff_s * 2, self.settings.reconnect_max_s)
            except Exception:
                # A bug or an unexpected reply must not end the listener: log it, start over.
                self.thread_errors.add("subscriber")
                logger.exception("unexpected error in the listener loop; reconnecting")
                self._pause(backoff_s)
                backoff_s = min(backoff_s * 2, self.settings.reconnect_max_s)

    def _pause(self, seconds: float) -> None:
        self.subscribed.clear()
        self._close_pubsub()
        self._stop.wait(seconds)

    def _connect(self) -> None:
        warning = check_notifications(self.redis, configure=self.settings.configure_redis)
        if warning:
            logger.warning(warning)
        # CONFIG blocked (None): eviction cannot be ruled out.
        self._eviction_possible = config_value(self.redis, "maxmemory-policy") != "noeviction"
        eviction = eviction_warning(self.redis)
        if eviction:
            logger.warning(eviction)
        self.clock.sync()
        pubsub: Any = self.rt.subscriber().pubsub()  # type: ignore[no-untyped-call]
        self._pubsub = pubsub
        channels = [self.channel, self.evicted_channel]
        if self.settings.driver:
            channels.append(self.wake_channel)
        subscribe_confirmed(pubsub, channels)
        # redis-py silently reconnects and re-subscribes a dropped pubsub connection; this
        # callback is how we learn of that gap.
        pubsub.connection.register_connect_callback(self._on_reconnect)
        self.subscribed.set()
        self._arm_sentinels(fresh=False)
        reason = "reconnect" if self._connected_once else "start-up"
        self._connected_once = True
        logger.info("subscribed to {} ({})", self.channel, reason)
        # A replica is over once events flow again (the canary): ROLE may be blocked by ACL.
        if self.problem is not None and self.problem != REPLICA_PROBLEM:
            logger.warning("Redis serves this listener again (was: {})", self.problem)
            self.problem = None
        self.request_reconcile(reason)

    def _on_reconnect(self, _connection: object) -> None:
        self._gap.set()

    def _close_pubsub(self) -> None:
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

    # --- loss control -------------------------------------------------------------------------
    def _arm_sentinels(self, *, fresh: bool) -> None:
        count = self.settings.sentinel_count
        if count == 0:
            return
        interval_ms = int(self.settings.sentinel_interval_s * 1000)
        pipe = self.redis.pipeline(transaction=False)
        for i in range(1, count + 1):
            key = sentinel_key(i, self.settings.key_prefix)
            pipe.set(key, b"", px=i * interval_ms, nx=not fresh)
        pipe.execute()

    def _regenerate_sentinels_if_needed(self) -> None:
        count = self.settings.sentinel_count
        if count == 0:
            return
        pipe = self.redis.pipeline(transaction=False)
        for i in range(1, count + 1):
            pipe.exists(sentinel_key(i, self.settings.key_prefix))
        fired = sum(1 for present in pipe.execute() if not present)
        if fired * 2 > count:
            logger.info("{} of {} sentinels fired: setting a fresh batch", fired, count)
            self._arm_sentinels(fresh=True)

    def _self_check(self, now_s: float) -> None:
        """Periodic checks that need no event to trigger them.

        - leases: runs whose listener died are found within `lease_check_s`, not at the next
          sentinel; so are pending tasks overdue by `stuck_after_s` (their key or event lost);
        - canary: a key this listener expires itself must come back as an event; while it does
          not (notifications off, a demoted master, a half-open socket), due tasks are run from
          the ledger by reconciling every canary interval, and the subscription is rebuilt;
        - sentinels: if most vanished without firing (FLUSHALL, a Redis restart while we were
          connected elsewhere), reconcile and set them again.
        """
        if (
            now_s - self._last_lease_check_s >= self.settings.lease_check_s
            or not self.events_arriving
        ):
            self._last_lease_check_s = now_s
            self.reconciler.requeue_expired_leases()
            # Overdue rows while our claimer still has events queued are most likely among them
            # (every listener gets every event): re-arming them now would only swell the backlog
            # of every listener. They are repaired once it drains (or by the next full pass).
            if self.dispatcher.backlog() == 0 or not self.events_arriving:
                # Without events the ledger is the only path: run what is due now.
                self.reconciler.repair_stuck(
                    grace_ms=int(self.settings.stuck_after_s * 1000) if self.events_arriving else 0,
                    events_arriving=self.events_arriving,
                )
        if not self.subscribed.is_set():
            return
        if self._canary_sent_s is not None:
            if self._canary_seen.is_set():
                if not self.events_arriving:
                    logger.warning("expired events are arriving again")
                    if self.problem == REPLICA_PROBLEM:
                        self.problem = None
                self.events_arriving = True
                self._canary_sent_s = None
            elif (
                now_s - self._canary_sent_s > 2.0
                and self.events > self._canary_events
                and now_s - self._canary_first_sent_s < _CANARY_PATIENCE_S
            ):
                # Other expired events are being read: the canary's is queued behind a burst
                # (100k keys due at once), not lost. Give it another window, within a limit:
                # another application's steady stream of events must not hide a lost canary.
                self._canary_events = self.events
                self._canary_sent_s = now_s
            elif now_s - self._canary_sent_s > 2.0:
                if self.events_arriving:
                    logger.error(
                        "expired events are not arriving (notifications switched off, a replica, "
                        "or a dead connection?): running due tasks from the ledger until they do"
                    )
                self.events_arriving = False
                self._canary_sent_s = None
                self._reconnect_wanted = True  # a half-open socket looks exactly like this
        if self._canary_sent_s is None and (
            now_s - self._last_canary_s >= self.settings.canary_interval_s
            or not self.events_arriving
        ):
            self._last_canary_s = now_s
            self._canary_seen.clear()
            self._canary_sent_s = now_s
            self._canary_first_sent_s = now_s
            self._canary_events = self.events
            pipe = self.redis.pipeline(transaction=False)
            pipe.set(self._canary, b"", px=1)
            pipe.execute()
            self.redis.pttl(self._canary)  # a lookup: expire it now, not at the next sweep
            count = self.settings.sentinel_count
            if count:
                keys = [sentinel_key(i, self.settings.key_prefix) for i in range(1, count + 1)]
                if int(self.redis.exists(*keys)) * 2 < count:
                    logger.warning("sentinels vanished without firing: reconciling")
                    self.request_reconcile("sentinels missing")

    def _read_only(self, exc: redis.ReadOnlyError) -> None:
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
            self._reconnect_wanted = True

    def _reconcile_loop(self) -> None:
        backoff_s = self.settings.reconnect_initial_s
        self._last_lease_check_s = monotonic_s()
        self._last_canary_s = monotonic_s()
        while not self._stop.is_set():
            if not self._reconcile_wanted.wait(min(1.0, self.settings.lease_check_s)):
                self._reconcile_idle.set()
                try:
                    self._self_check(monotonic_s())
                except redis.ReadOnlyError as exc:
                    self._read_only(exc)
                except Exception as exc:
                    if not isinstance(exc, StoreError | redis.RedisError | OSError):
                        self.thread_errors.add("reconcile")
                        logger.opt(exception=exc).error("self-check failed unexpectedly")
                    elif self.subscribed.is_set():
                        logger.warning("self-check failed: {}", exc)
                    else:  # the subscriber's own line already says Redis is away
                        logger.debug("self-check failed: {}", exc)
                continue
            if self._stop.is_set():
                break
            self._reconcile_wanted.clear()
            try:
                if not self._schema_ready:
                    # A database that was down at start-up: retried here until it answers.
                    self.store.create_schema()
                    self._schema_ready = True
                report = self.reconciler.run()
                self._regenerate_sentinels_if_needed()
                backoff_s = self.settings.reconnect_initial_s
            except redis.ReadOnlyError as exc:
                # Overdue rows were handed to the claimer before the failing write; the
                # reconnect once Redis is a master again reconciles (and re-arms) in full.
                self._read_only(exc)
                self._reconcile_idle.set()
                continue
            except Exception as exc:
                if isinstance(exc, StoreError | redis.RedisError | OSError):
                    logger.error("reconciliation failed ({}); retrying in {:.1f} s", exc, backoff_s)
                else:
                    self.thread_errors.add("reconcile")
                    logger.exception("reconciliation failed; retrying in {:.1f} s", backoff_s)
                self._stop.wait(backoff_s)
                backoff_s = min(backoff_s * 2, self.settings.reconnect_max_s)
                self._reconcile_wanted.set()
                continue
            self.reconciles_done += 1
            if report.overdue or report.rearmed or report.lease_expired:
                logger.info("reconciliation: {}", report)
            if not self._reconcile_wanted.is_set():
                self._reconcile_idle.set()

    def _install_signal_handlers(self) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def handler(signum: int, _frame: FrameType | None) -> None:
            logger.info("received {}: stopping", signal.Signals(signum).name)
            self.stop()

        old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}

        def restore() -> None:
            for s, h in old.items():
                signal.signal(s, h)

        return restore
