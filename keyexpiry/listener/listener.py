"""The long-running listener: expired events in, dispatched tasks out, forever.

Long because it wires every part together and starts and stops their threads in order; the
parts themselves live in their own modules (below).

It only composes and runs the parts: the subscription (`subscription`), what each message means
(`routing`), claim-run-record (`dispatch`), the expiry driver (`driver`), loss control (`health`)
and the maintenance thread (`maintenance`). `step()` handles one batch of messages, so tests can
drive the listener by hand.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

import redis
from loguru import logger

from keyexpiry import malloc
from keyexpiry.clock import monotonic_s
from keyexpiry.errors import KeyExpiryError, StoreError
from keyexpiry.flow.pauses import PAUSE_WAKE
from keyexpiry.keys import task_class_of
from keyexpiry.ledger.store import Store
from keyexpiry.listener.cluster_subscription import ClusterSubscription
from keyexpiry.listener.driver import ExpiryDriver
from keyexpiry.listener.fleet import Fleet
from keyexpiry.listener.health import Health
from keyexpiry.listener.maintenance import Maintenance
from keyexpiry.listener.reconcile import Reconciler
from keyexpiry.listener.routing import Router
from keyexpiry.listener.subscription import Handlers, Subscription
from keyexpiry.masking import mask_url
from keyexpiry.redis.pools import IdleTrimmer, pools_of
from keyexpiry.redis.sentinel import MasterWatch, follows_sentinel
from keyexpiry.registry import Registry
from keyexpiry.runner.dispatch import Dispatcher
from keyexpiry.runtime import Runtime
from keyexpiry.schedules import operate
from keyexpiry.settings import Settings
from keyexpiry.threads import ThreadErrors, spawn

if TYPE_CHECKING:
    from keyexpiry.ops.endpoints import Endpoints

_LEDGER_THREADS = 8
_PAUSE_WAKE = PAUSE_WAKE.encode()
"""Threads of a listener that may each hold a ledger connection at the same moment: claimer,
recorder, heartbeat, reconciliation, driver, lease extension, the unknown-key lookup and the
metrics scrape."""


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
        self.rt = rt = Runtime.open(settings, registry, store=store, owner=owner)
        self.settings, self.registry, self.store = settings, rt.registry, rt.store
        self.redis, self.clock, self.owner = rt.redis, rt.clock, rt.owner
        self.run_metrics = rt.metrics
        """What the workers observe of each run (`/metrics` serves it)."""
        self.idle_redis = IdleTrimmer(
            lambda: pools_of(rt.redis) + (rt.cluster.admin_pools() if rt.cluster else [])
        )
        """Closes the Redis connections a burst or a recovery opened once they stay unused."""
        self.freed_memory = malloc.Trimmer()
        """Hands what the allocator's arenas freed back to the kernel (`keyexpiry.malloc`)."""
        self._stop = threading.Event()
        self.warmed = threading.Event()
        """Set once the ledger connections are open and the claims compiled (`_warm_up`)."""
        self.dispatcher = Dispatcher(rt)
        self.reconciler = Reconciler.of(
            rt,
            submit=self.dispatcher.submit,
            mine=lambda key: self.fleet.partition.owns_key(key, rt.settings.key_prefix),
        )
        # One account of malformed task rows: one the walk reported is not said again when a
        # claim meets it.
        self.dispatcher.executor.malformed = self.reconciler.malformed
        self.driver = ExpiryDriver(
            store=rt.store,
            redis=rt.redis,
            clock=rt.clock,
            settings=settings,
            owner=rt.owner,
            on_cluster=rt.cluster is not None,
        )
        self.fleet = Fleet(
            store=rt.store,
            clock=rt.clock,
            settings=settings,
            registry=rt.registry,
            owner=rt.owner,
            reconciler=self.reconciler,
            running=lambda: self.dispatcher.inflight.count,
            submit=self.dispatcher.submit,
            hearing=lambda: self.health.subscribed.is_set(),
            silent_link=lambda: self.health.silent_link,
        )
        self._fleet_stop = threading.Event()
        # Looked up at call time (lambdas), so a test or a subclass may wrap these methods.
        self.health = Health(
            redis=rt.redis,
            redis_url=rt.redis_url,
            settings=settings,
            owner=rt.owner,
            node_tags=rt.node_tags,
            on_cluster=rt.cluster is not None,
            reconciler=self.reconciler,
            events=lambda: self.router.events,
            backlog=self.dispatcher.backlog,
            request_reconcile=lambda reason: self.request_reconcile(reason),
            # A task held back by flow control (or paused) is not stuck: left alone.
            mine=lambda key: (
                self.fleet.partition.owns_key(key, rt.settings.key_prefix)
                and not self.dispatcher.gate.holds(key)
            ),
        )
        self.health.on_silent_link = self.fleet.poke
        self.router = Router(
            self.health,
            key_prefix=settings.key_prefix,
            db=rt.db,
            registry=rt.registry,
            submit=self.dispatcher.submit,
            note_due=self.driver.note,
            request_reconcile=lambda reason: self.request_reconcile(reason),
            owns=self.fleet.partition.owns,
            leads=self.fleet.partition.leads,
        )
        self.dispatcher.claimer.find_due = self._due_keys
        self.dispatcher.claimer.deaf = lambda: self.health.deaf
        self.maintenance = Maintenance(
            self.reconciler,
            self.health,
            store=rt.store,
            clock=rt.clock,
            settings=settings,
            declare_schedules=lambda: operate.declare_exposed(rt),
            restore_schedules=lambda: operate.restore_missing(rt),
            self_check=lambda now_s: self._self_check(now_s),
            stop=self._stop,
            errors=self.thread_errors,
            backlog=self.dispatcher.backlog,
        )
        handlers = Handlers(
            key=lambda raw: self.handle_key(raw),
            evicted=lambda raw: self.handle_evicted(raw),
            wake=lambda raw: self.handle_wake(raw),
        )
        # One set of parts for either kind (a Cluster's subscription also takes its nodes).
        parts: dict[str, Any] = {
            "redis": rt.redis,
            "subscriber": rt.subscriber,
            "reset_subscriber": rt.reset_subscriber,
            "clock": rt.clock,
            "settings": settings,
            "db": rt.db,
            "stop": self._stop,
            "request_reconcile": lambda reason: self.request_reconcile(reason),
            "errors": self.thread_errors,
        }
        self.subscription: Subscription = (
            Subscription(self.health, handlers, **parts)
            if rt.cluster is None
            else ClusterSubscription(self.health, handlers, cluster=rt.cluster, **parts)
        )
        if isinstance(self.subscription, ClusterSubscription):
            self.health.unheard_primaries = self.subscription.unheard
        self.channel = self.subscription.channel
        self.wake_channel = self.subscription.wake_channel
        self.subscribed = self.health.subscribed
        self.endpoints: Endpoints | None = None
        self.master_watch: MasterWatch | None = None
        if follows_sentinel(rt.redis):
            self.master_watch = MasterWatch(
                rt.redis,
                subscribed_node=lambda: self.subscription.node,
                on_switch=self.subscription.master_switched,
                on_settled=lambda: self.request_reconcile("master switch settled"),
            )

    # --- run ----------------------------------------------------------------------------------
    def run(self) -> None:
        """Listen until `stop()`; then shut down gracefully."""
        restore = self._install_signal_handlers()
        logger.info(
            "listener {} starting: redis {}, ledger {}, {} task method(s), concurrency {}",
            self.owner,
            mask_url(self.rt.redis_url),
            mask_url(self.store.engine.url.render_as_string(hide_password=True)),
            len(self.registry.specs()),
            self.settings.concurrency,
        )
        try:
            # Before the threads start: they would each get an arena of their own.
            malloc.limit_arenas()
            # Before anything is written (schema, schedules, sentinels) or started: a listener
            # that cannot start must leave nothing behind and stop at once.
            self.subscription.check_at_start()
        except BaseException:
            self.rt.close()
            restore()
            raise
        self.maintenance.ensure_schema()
        # Beside the start, not before it: it took 0.15-0.3 s, and every task due in a
        # restart's window waited that much longer for the subscription.
        warm_up = spawn("warm-up", self._warm_up, stopped=self._stop, errors=self.thread_errors)
        # Before the first claim: a paused method must stay paused across a restart.
        self.dispatcher.gate.read_pauses()
        self._declare_schedules()
        endpoints = self.serve_http() if self.settings.http else None
        self.dispatcher.start()
        if self.settings.driver:
            self.driver.start(self.thread_errors)
        maintenance = spawn(
            "reconcile", self.maintenance.loop, stopped=self._stop, errors=self.thread_errors
        )
        # Beats on through the graceful stop: handlers still running are not a death.
        fleet = spawn(
            "heartbeat",
            lambda: self.fleet.loop(self._fleet_stop),
            stopped=self._fleet_stop,
            errors=self.thread_errors,
        )
        flow = spawn(
            "flow",
            lambda: self.dispatcher.gate.loop(self._fleet_stop),
            stopped=self._fleet_stop,
            errors=self.thread_errors,
        )
        # Its own thread: a primary that stops answering holds it, not the repairs.
        spawn(
            "marker",
            lambda: self.health.marker_loop(self._stop),
            stopped=self._stop,
            errors=self.thread_errors,
        )
        if self.health.on_cluster:
            # Never talks to Redis: a paused primary's due tasks run while other threads wait.
            spawn(
                "unheard",
                lambda: self.health.unheard_loop(self._stop),
                stopped=self._stop,
                errors=self.thread_errors,
            )
        if self.master_watch is not None:
            spawn(
                "sentinel",
                lambda: self.master_watch.loop(self._stop),  # type: ignore[union-attr]
                stopped=self._stop,
                errors=self.thread_errors,
            )
        try:
            self.subscription.serve()
            self._hand_over()
        finally:
            # `serve` also returns on an error at its first connect: the threads that stop on
            # `_stop` must stop then too, not be waited for and go on working.
            self._stop.set()
            self.subscribed.clear()
            logger.info(
                "listener stopping: finishing running handlers (up to {:g} s)",
                self.settings.shutdown_timeout_s,
            )
            self.driver.stop()
            self.dispatcher.stop(self.settings.shutdown_timeout_s)
            self._fleet_stop.set()
            self.fleet.poke()
            self.dispatcher.gate.interrupt()
            fleet.join(timeout=5)
            flow.join(timeout=5)
            self.subscription.close()
            self.maintenance.wake()
            maintenance.join(timeout=5)
            warm_up.join(timeout=5)
            if endpoints is not None:
                endpoints.stop()
            self.rt.close()
            restore()
            logger.info("listener stopped")

    def _warm_up(self) -> None:
        """While the subscription is made: open a pooled connection for each of the threads
        that use the ledger at once, and compile the claim and outcome statements, so neither
        happens while due tasks wait (each showed up as a 10-90 ms stall of a wave right after a
        start); `warmed` is set when done. A ledger out of reach now is the threads' to retry."""
        try:
            self.store.open_connections(_LEDGER_THREADS)
            self.store.prepare_claims(self.settings.claim_batch)
        except StoreError as exc:
            logger.debug("warm-up skipped: {}", exc)
        finally:
            self.warmed.set()

    def _declare_schedules(self) -> None:
        """Declare the `@exposed(cron=…)` schedules now; out of reach, the self-check does."""
        try:
            self.maintenance.keep_schedules()
        except (StoreError, redis.RedisError, KeyExpiryError) as exc:
            logger.error("schedules not declared yet ({}); retrying", exc)

    def _hand_over(self) -> None:
        """A graceful stop with peers: mark this listener stopping, then go on hearing and
        claiming its share until they have read that and taken it (no gap for its keys)."""
        if not self.fleet.stopping():
            return
        logger.info("handing this listener's share of the keys to its peers")
        until_s = monotonic_s() + self.fleet.partition.hold_s
        try:
            while monotonic_s() < until_s:
                self.subscription.step(timeout_s=0.1)
        except Exception as exc:  # the stop goes on; a missed event is the catch-up's
            logger.warning("stopped handing over early: {}", exc)

    def serve_http(self) -> Endpoints:
        """Start serving /metrics, /healthz and /readyz on `settings.http` (see `endpoints`)."""
        # Here, not at the top: a listener without --http does not pay for importing it.
        from keyexpiry.ops.endpoints import Endpoints

        self.endpoints = Endpoints(self, self.settings.http)
        self.endpoints.start()
        return self.endpoints

    def stop(self) -> None:
        """Ask `run()` to finish (safe from any thread or a signal handler)."""
        self._stop.set()
        self.maintenance.wake()
        self.subscription.wake()

    def status(self) -> dict[str, object]:
        """What the listener sees now: subscription, event flow, the current Redis problem."""
        return {
            "owner": self.owner,
            "subscribed": self.subscribed.is_set(),
            "events_arriving": self.events_arriving,
            "problem": self.problem,
            "events": self.events,
            "gaps": self.gaps,
            "away": self.fleet.away,
            "evicted": self.evicted,
            "done": self.dispatcher.stats.done,
            "thread_errors": self.thread_errors.count,
            "malformed_rows": (
                self.reconciler.malformed.count + self.dispatcher.gate.malformed.count
            ),
            "failing": self.failing(),
        }

    def failing(self) -> list[str]:
        """The loops that keep failing (empty while every one does its job): the maintenance
        thread's reconciliation or self-check failing `FAILING_AFTER` times in a row, and any
        thread raising unexpectedly again and again. Threads that live on are not enough:
        readiness (`/readyz`) is false while this is not empty."""
        repeating = [
            f"thread keyexpiry-{name} keeps raising unexpected errors (see the log)"
            for name in self.thread_errors.repeating()
        ]
        return self.maintenance.failing() + repeating

    # --- what the parts do, by their old names ------------------------------------------------
    def request_reconcile(self, reason: str) -> None:
        """Run a reconciliation soon on the maintenance thread (coalesced)."""
        # Whatever makes a reconciliation necessary (a gap in the subscription above all) may
        # have lost wake messages too: the driver reads its window again.
        self.driver.reread()
        self.maintenance.request(reason)

    def wait_reconciled(self, timeout_s: float) -> bool:
        """Wait until no reconciliation is requested or running (a test sync point)."""
        return self.maintenance.wait_idle(timeout_s)

    def step(self, timeout_s: float) -> int:
        """Handle the messages that arrive within `timeout_s`; return how many were read."""
        return self.subscription.step(timeout_s)

    def handle_key(self, raw: bytes | str) -> None:
        """Route one expired key (see `Router.handle_key`)."""
        self.router.handle_key(raw)

    def handle_evicted(self, raw: bytes | str) -> None:
        """Route one evicted key (see `Router.handle_evicted`)."""
        self.router.handle_evicted(raw)

    def handle_wake(self, data: bytes) -> None:
        """Hand a wake message to the driver (see `Router.handle_wake`); a pause's or a
        resume's has the pauses read again at once."""
        if data == _PAUSE_WAKE:
            self.dispatcher.gate.reread_pauses()
            return
        self.router.handle_wake(data)

    def _due_keys(self, limit: int) -> list[str]:
        """Up to `limit` keys of due tasks this listener runs (its share, classes it
        registers, not held back by flow control), from the ledger: the claimer takes these
        first while a flood of events is dropped or holds the queue up."""
        prefix = self.settings.key_prefix
        partition, gate = self.fleet.partition, self.dispatcher.gate

        def runs_here(key: str) -> bool:
            name = task_class_of(key.encode(), prefix.encode())
            return (
                name is not None
                and self.registry.has_class(name)
                and partition.owns_key(key, prefix)
                and not gate.holds(key)
            )

        due = self.reconciler.overdue_keys(self.clock.now_ms(), limit, runs_here)
        return [key for key, _ in due]

    def _self_check(self, now_s: float) -> None:
        self.health.self_check(now_s)
        self.idle_redis.tick(now_s)
        self.freed_memory.tick(now_s)

    def _connect(self) -> None:
        self.subscription.connect()

    def _close_pubsub(self) -> None:
        self.subscription.close()

    @property
    def thread_errors(self) -> ThreadErrors:
        """Unexpected exceptions the listener's threads survived (each logged with its key)."""
        return self.dispatcher.thread_errors

    @property
    def ignored(self) -> int:
        """Expired keys that claimed to be tasks but were not runnable ones (logged once each)."""
        return self.router.refused + self.dispatcher.stats.ignored

    @property
    def events(self) -> int:
        """Expired events heard."""
        return self.router.events

    @property
    def foreign(self) -> int:
        """Expired keys of other applications, dropped without a word."""
        return self.router.foreign

    @property
    def evicted(self) -> int:
        """Task keys Redis evicted (maxmemory) that were handed back to the ledger."""
        return self.router.evicted

    @property
    def wakes_refused(self) -> int:
        """Wake messages too long to be keyexpiry's, dropped undecoded."""
        return self.router.wakes_refused

    @property
    def wakes_dropped(self) -> int:
        """Wake messages the driver dropped (all or part) because its window was full."""
        return self.driver.wakes_dropped

    @property
    def canaries_seen(self) -> int:
        """Our canary's events heard."""
        return self.health.canaries_seen

    @property
    def markers_lost(self) -> int:
        """Times Redis's marker key was found gone or replaced (Redis lost keys)."""
        return self.health.markers_lost

    @property
    def events_arriving(self) -> bool:
        """False while the canary's event does not come back."""
        return self.health.events_arriving

    @property
    def problem(self) -> str | None:
        """Why Redis cannot serve this listener right now (a replica, refused credentials)."""
        return self.health.problem

    @property
    def gaps(self) -> int:
        """Dropped or rebuilt subscriptions since start."""
        return self.subscription.gaps

    @property
    def reconciles_done(self) -> int:
        """Full reconciliations completed."""
        return self.maintenance.reconciles_done

    def _install_signal_handlers(self) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def stopping(name: str) -> None:
            logger.info("received {}: stopping", name)
            self.stop()

        def handler(signum: int, _frame: FrameType | None) -> None:
            # Not here: the signal may land while this thread holds a lock the stop takes (an
            # Event's, loguru's), and taking it again would hang the listener for good.
            name = signal.Signals(signum).name
            spawned = threading.Thread(target=stopping, args=(name,), name="keyexpiry-stop")
            spawned.daemon = True
            spawned.start()

        old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}

        def restore() -> None:
            for s, h in old.items():
                signal.signal(s, h)

        return restore
