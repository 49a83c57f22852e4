"""The one place settings become connections: Redis, the ledger, the clock, the registry and the
listener's identity, closed together.

Nothing builds or fetches its own connections: the client, the listener and the dispatcher take
a `Runtime` and hand each of their parts what it uses of it (the store, the commands client, the
clock, the settings, the registry, the owner), so a part's constructor says what it touches and a
test builds one with only that. Its Redis side is two clients, one for commands and one for the
subscription; a Sentinel-followed master or one connection per Cluster primary goes behind
`redis` / `subscriber()` without the dispatch code noticing.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from redis import Redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from sqlalchemy import URL

from keyexpiry.clock import RedisClock
from keyexpiry.errors import ConfigError, RedisUnavailableError
from keyexpiry.ledger.store import Store, make_engine
from keyexpiry.masking import mask_url, redact
from keyexpiry.redis.arming import arm_keys, redis_db
from keyexpiry.redis.cluster import ClusterNodes, is_cluster_url, node_tag, parse_cluster_url
from keyexpiry.redis.embedded import RestartingRetry, ensure_embedded_redis
from keyexpiry.redis.handshake import handshake_options
from keyexpiry.redis.sentinel import close_client, is_sentinel_url, master_client
from keyexpiry.registry import Registry, default_registry
from keyexpiry.run_metrics import RunMetrics
from keyexpiry.settings import Settings


@dataclass(eq=False)
class Runtime:
    """Connections and identity shared by every part of one client or listener."""

    settings: Settings
    registry: Registry
    store: Store
    redis_url: str
    redis: Redis
    """Commands (SET, PTTL, pipelines): short timeouts, fail fast."""
    clock: RedisClock
    owner: str
    """This process's identity in claims and logs: host:pid:random."""
    metrics: RunMetrics = field(default_factory=RunMetrics, repr=False)
    """Runs, lateness and handler time, for `/metrics` (one registry per runtime)."""
    _subscriber: Redis | None = field(default=None, repr=False)
    cluster: ClusterNodes | None = field(default=None, repr=False)
    """The cluster's nodes (`redis+cluster://`); None on a single server. `redis` is then a
    `RedisCluster`, which speaks the same commands key by key."""

    @classmethod
    def open(
        cls,
        settings: Settings,
        registry: Registry | None = None,
        *,
        store: Store | None = None,
        owner: str | None = None,
    ) -> Runtime:
        """Connect to what `settings` name (starting the embedded Redis if it is the default).

        A `store` given reads keys under its own `key_prefix`: the settings' one, or a
        ConfigError (a row's class is its key's after the prefix)."""
        if store is not None and store.key_prefix != settings.key_prefix:
            raise ConfigError(
                f"the store's key_prefix {store.key_prefix!r} is not the settings' "
                f"{settings.key_prefix!r}: make it with Store(engine, key_prefix=...)"
            )
        url = resolve_redis_url(settings)
        cluster = None
        if is_cluster_url(url):
            cluster = ClusterNodes(parse_cluster_url(url), redis_options(url, settings))
            # Typed as Redis: RedisCluster has the same command methods (not a subclass).
            client = cast(Redis, cluster.commands)
            clock = RedisClock(cast(Redis, cluster))
        else:
            client = redis_client(url, settings)
            clock = RedisClock(client)
        return cls(
            settings=settings,
            registry=registry or default_registry,
            store=store or open_store(settings),
            redis_url=url,
            redis=client,
            clock=clock,
            owner=owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}",
            cluster=cluster,
        )

    @property
    def db(self) -> int:
        """The Redis database number (for the keyevent channel names)."""
        return redis_db(self.redis)

    def subscriber(self) -> Redis:
        """The client subscriptions are made on: no read timeout, a health check instead."""
        if self._subscriber is None:
            self._subscriber = redis_client(self.redis_url, self.settings, pubsub=True)
        return self._subscriber

    def reset_subscriber(self) -> None:
        """Drop the subscription client: the next `subscriber()` builds a fresh one (after a
        Sentinel switch, so nothing of the old master's connection is reused)."""
        if self._subscriber is not None:
            close_client(self._subscriber)
            self._subscriber = None

    def node_tags(self) -> list[str]:
        """One hash tag per primary serving slots (`[""]` on a single server): a key ending
        with one lives on that primary (canaries and sentinels are kept per primary)."""
        if self.cluster is None:
            return [""]
        topology = self.cluster.topology()
        return [node_tag(topology.slots[a]) for a in topology.primaries]

    def arm(self, items: Sequence[tuple[str, int]], now_ms: int | None = None) -> None:
        """Set task keys to expire at their due times (and announce those due soon)."""
        now = self.clock.now_ms() if now_ms is None else now_ms
        arm_keys(self.redis, items, now, self.settings)

    def close(self) -> None:
        """Release every connection."""
        self.clock.close()
        close_client(self.redis)
        if self.cluster is not None:
            self.cluster.close()
        self.reset_subscriber()
        self.store.engine.dispose()


def resolve_redis_url(settings: Settings) -> str:
    """The Redis URL to use: the configured one, or the embedded server (started if needed)."""
    if settings.redis_url:
        return settings.redis_url
    return ensure_embedded_redis(settings.state_dir)


def resolve_database_url(settings: Settings) -> str:
    """The ledger URL: the configured one, or a SQLite file under the state dir."""
    if settings.database_url:
        return settings.database_url
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    # Built, not formatted: a `?`, `#` or `%` in the state dir would otherwise end the path.
    path = settings.state_dir.resolve() / "keyexpiry.sqlite3"
    return URL.create("sqlite", database=str(path)).render_as_string(hide_password=False)


def open_store(settings: Settings) -> Store:
    """The ledger for `settings`."""
    return Store(make_engine(resolve_database_url(settings)), key_prefix=settings.key_prefix)


def redis_client(url: str, settings: Settings, *, pubsub: bool = False) -> Redis:
    """A client for `url`; raw bytes (keys are decoded per message, never by the connection).

    The subscriber gets no read timeout (it waits for events) but a health check, so a half-open
    socket is noticed.
    """
    options = redis_options(url, settings, pubsub=pubsub)
    try:
        if is_sentinel_url(url):
            return master_client(url, options)
        return Redis.from_url(url, **options)
    except ValueError as exc:
        raise RedisUnavailableError(
            f"bad Redis URL {mask_url(url)}: {redact(str(exc), url)}"
        ) from None


def redis_options(url: str, settings: Settings, *, pubsub: bool = False) -> dict[str, Any]:
    """Connection options for `url` besides what the URL says (timeouts, retries, checks)."""
    # redis-py's default retries back off for up to a minute; callers here retry themselves
    # (the listener with its own logged backoff), so fail fast and say so.
    backoff = ExponentialBackoff(cap=0.5, base=0.05)
    retry = (
        Retry(backoff, 2) if settings.redis_url else RestartingRetry(settings.state_dir, backoff, 2)
    )
    options: dict[str, Any] = {
        "retry": retry,
        "socket_connect_timeout": 5,
        "socket_timeout": None if pubsub else 10,
        # As given: redis-py compares it with monotonic time (int() made 0.5 s into 0, off).
        "health_check_interval": settings.health_check_interval_s,
        "decode_responses": False,
        # Nothing in a connect that a health check falling due mid-handshake could misread.
        **handshake_options(),
    }
    if not url.startswith("unix:"):
        options["socket_keepalive"] = True  # unix sockets have no keepalive
    return options
