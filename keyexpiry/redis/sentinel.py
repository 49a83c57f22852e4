"""Redis behind Sentinel: `redis+sentinel://` URLs, clients that follow the master, the replicas'
notification settings, and the watch that moves a listener to a new master after a failover.

Commands go through redis-py's `Sentinel.master_for`: each new connection asks the sentinels
where the master is, and a connection to a master demoted to replica fails (READONLY becomes a
connection error) and is retried on the new one. The subscription cannot rely on that: redis-py
re-subscribes a dropped pub/sub connection silently (to whichever node the sentinels name, with no
notification check there), and a PubSub built with health checks keeps dialling the dead master.
So a listener polls the sentinels (`MasterWatch`) and, when the master is not the node it is
subscribed to, rebuilds the subscription from a fresh client: checks the new master, subscribes,
reconciles.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import redis
from loguru import logger
from redis.backoff import NoBackoff
from redis.connection import AbstractConnection, Connection, ConnectionPool, SSLConnection
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from keyexpiry.clock import monotonic_s
from keyexpiry.errors import ConfigError, RedisConfigError
from keyexpiry.masking import mask_url
from keyexpiry.redis.server import notification_flags

SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_SENTINEL_PORT = 26379
WATCH_INTERVAL_S = 0.5
"""How often a listener asks the sentinels where the master is (see `MasterWatch`)."""
POOL_RECHECK_S = 1.0
"""How often a command pool asks again, at the next connection it hands out (`FollowingPool`)."""
SETTLE_S = 3.0
"""After a switch, when a listener reconciles once more: by then every pool has asked again, so
no client writes to the former master any longer (see `MasterWatch`)."""
_SENTINEL_TIMEOUT_S = 1.0
"""Connect and read timeout towards one sentinel: a dead one is skipped for the next quickly."""
_REPLICA_TIMEOUT_S = 2.0

Address = tuple[str, int]


@dataclass(frozen=True)
class SentinelURL:
    """A parsed `redis[s]+sentinel://[user:pw@]host:port[,host:port…]/SERVICE[/DB][?options]`."""

    sentinels: tuple[Address, ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)
    tls: bool = False
    options: tuple[tuple[str, Any], ...] = ()
    """Connection options from the query (typed as redis-py types them for redis://)."""


def is_sentinel_url(url: str | None) -> bool:
    """Whether `url` names a Sentinel group (`redis+sentinel://`, `rediss+sentinel://`)."""
    return bool(url) and urlsplit(url or "").scheme.lower() in SCHEMES


def parse_sentinel_url(url: str) -> SentinelURL:
    """Parse a Sentinel URL; raise ConfigError saying what is wrong and what is expected."""
    shown = mask_url(url)
    form = "redis+sentinel://[user:password@]host:port[,host:port…]/SERVICE[/DB]"
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ConfigError(f"redis_url {shown!r} is not a Sentinel URL ({form})")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    if not hosts:
        raise ConfigError(f"redis_url {shown!r} names no sentinel: expected {form}")
    sentinels = tuple(_host_port(item, shown) for item in hosts.split(","))
    segments = parts.path.split("/")[1:]
    if segments and segments[-1] == "":
        segments.pop()  # a trailing slash
    if not segments or not segments[0] or len(segments) > 2:
        raise ConfigError(
            f"redis_url {shown!r}: give the master's service name after the sentinels: {form}"
        )
    db = 0
    if len(segments) == 2:
        if not segments[1].isdigit():
            raise ConfigError(f"redis_url {shown!r}: the database must be a number, not "
                              f"{segments[1]!r}")  # fmt: skip
        db = int(segments[1])
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    sentinel_username = query.pop("sentinel_username", None) or None
    sentinel_password = query.pop("sentinel_password", None) or None
    if "db" in query:
        raise ConfigError(f"redis_url {shown!r}: give the database in the path (/SERVICE/DB)")
    return SentinelURL(
        sentinels=sentinels,
        service=unquote(segments[0]),
        db=db,
        username=unquote(user) or None,
        password=unquote(password) or None,
        sentinel_username=sentinel_username,
        sentinel_password=sentinel_password,
        tls=scheme == "rediss+sentinel",
        options=tuple(_options(query, shown).items()),
    )


def _host_port(item: str, shown: str) -> Address:
    host, port = item, ""
    if item.startswith("["):  # [IPv6]:port
        host, _, rest = item[1:].partition("]")
        port = rest.removeprefix(":")
    elif ":" in item:
        host, _, port = item.rpartition(":")
    if not host:
        raise ConfigError(f"redis_url {shown!r}: {item!r} is not host:port")
    if not port:
        return host, DEFAULT_SENTINEL_PORT
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"redis_url {shown!r}: port {port!r} of {host} is not a port number")
    return host, int(port)


def _allowed_options() -> set[str]:
    names: set[str] = {"max_connections"}
    for cls in (AbstractConnection, Connection, SSLConnection):
        names |= set(inspect.signature(cls.__init__).parameters)
    return names - {"self", "args", "kwargs", "host", "port", "db", "connection_pool"}


def _options(query: Mapping[str, str], shown: str) -> dict[str, Any]:
    """The query's connection options, typed exactly as redis-py does for a redis:// URL."""
    unknown = sorted(set(query) - _allowed_options())
    if unknown:
        raise ConfigError(f"redis_url {shown!r}: unknown option(s) {', '.join(unknown)}")
    try:
        options: dict[str, Any] = redis.connection.parse_url(  # type: ignore[no-untyped-call]
            "redis://localhost/?" + urlencode(query)
        )
    except ValueError as exc:
        raise ConfigError(f"redis_url {shown!r}: {exc}") from None
    options.pop("host", None)
    return options


def master_client(url: str, options: Mapping[str, Any]) -> redis.Redis:
    """A client whose connections go to the master the sentinels of `url` name now.

    `options` are keyexpiry's connection defaults; options in the URL win over them, as for a
    redis:// URL. The sentinels are asked with short timeouts and without retries, so a dead
    one costs a refused connection, not a backoff, before the next is asked.
    """
    parsed = parse_sentinel_url(url)
    sentinel_kwargs: dict[str, Any] = {
        "socket_connect_timeout": _SENTINEL_TIMEOUT_S,
        "socket_timeout": _SENTINEL_TIMEOUT_S,
        "retry": Retry(NoBackoff(), 0),
        "username": parsed.sentinel_username,
        "password": parsed.sentinel_password,
    }
    kwargs: dict[str, Any] = {
        **options,
        **dict(parsed.options),
        "db": parsed.db,
        "username": parsed.username,
        "password": parsed.password,
    }
    if parsed.tls:
        sentinel_kwargs["ssl"] = kwargs["ssl"] = True
    # Through Any: redis-py types Sentinel from 8.2 on, not before (an ignore fails either way).
    sentinel: Any = Sentinel
    client: redis.Redis = sentinel(
        list(parsed.sentinels), sentinel_kwargs=sentinel_kwargs
    ).master_for(parsed.service, connection_pool_class=FollowingPool, **kwargs)
    return client


class FollowingPool(SentinelConnectionPool):
    """redis-py's Sentinel pool, asking the sentinels again at most every `POOL_RECHECK_S`
    when it hands out a connection.

    redis-py asks only when it opens a connection; one kept open to a master that lost the role
    while alive (`SENTINEL FAILOVER`, a partition) takes writes until the sentinels demote it,
    seconds later, and those writes vanish when it resyncs as a replica. Asking again drops the
    idle connections to it (redis-py's own `get_master_address` does that on a change), so a
    client stops writing there within a second of the switch.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self._next_check_s = 0.0
        self._ask_lock = threading.Lock()
        self._answer: tuple[float, Any, BaseException | None] | None = None
        """(when, address, error) of the last time the sentinels were asked."""
        # A new connection asks through the pool's proxy, not the pool (redis-py hands the
        # proxy to its connections): both must come here.
        self._ask_sentinels = self.proxy.get_master_address
        self.proxy.get_master_address = self.get_master_address  # type: ignore[method-assign]

    def get_master_address(self) -> Any:
        """Where the sentinels say the master is: one thread asks, the threads that asked
        meanwhile share its answer (or its error).

        redis-py asks on every new connection. After a failover every thread of a listener
        reconnects at once, and each sentinel's client opened as many connections as threads
        asked together, then kept them in its pool: the soak's listeners went from 6 to 12
        connections to Redis's ports over a few failovers, and stayed there.
        """
        asked_s = monotonic_s()
        with self._ask_lock:
            answer = self._answer
            if answer is None or answer[0] < asked_s:
                try:
                    address = self._ask_sentinels()  # type: ignore[no-untyped-call]
                    answer = (monotonic_s(), address, None)
                    self._close_idle_sentinels()
                except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                    answer = (monotonic_s(), None, exc)
                self._answer = answer
        if answer[2] is not None:
            raise answer[2]
        return answer[1]

    def _close_idle_sentinels(self) -> None:
        """Close the idle connections to every sentinel but the one that answered (redis-py
        puts it first): those asked while it did not know the master yet (during a failover)
        would otherwise stay open for the process's life, a step up at each failover."""
        for sentinel in self.sentinel_manager.sentinels[1:]:
            sentinel.connection_pool.disconnect(inuse_connections=False)

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        """A connection to the master (the sentinels asked again if the last answer is old)."""
        now_s = monotonic_s()
        if now_s >= self._next_check_s:
            self._next_check_s = now_s + POOL_RECHECK_S
            try:
                self.get_master_address()
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                pass  # no master named now: the connection's own connect fails and says so
        return super().get_connection(*args, **kwargs)


def sentinel_pool(client: redis.Redis) -> SentinelConnectionPool | None:
    """The client's pool if it follows a Sentinel-managed master, else None."""
    # A RedisCluster has no pool of its own (one per node).
    pool = getattr(client, "connection_pool", None)
    return pool if isinstance(pool, SentinelConnectionPool) else None


def follows_sentinel(client: redis.Redis) -> bool:
    """Whether `client` reaches its server through Sentinel."""
    return sentinel_pool(client) is not None


def close_client(client: redis.Redis) -> None:
    """Close `client` and, behind Sentinel, its connections to the sentinels."""
    client.close()
    pool = sentinel_pool(client)
    if pool is not None:
        pool.sentinel_manager.close()


def master_address(client: redis.Redis) -> Address:
    """Where the sentinels say the master is (raises redis.ConnectionError when none does)."""
    pool = sentinel_pool(client)
    if pool is None:
        raise TypeError("not a Sentinel client")
    # The pool's own lookup: it also drops idle connections to a former master.
    host, port = pool.get_master_address()  # type: ignore[no-untyped-call]
    return str(host), int(port)


def replica_addresses(client: redis.Redis) -> list[Address]:
    """The replicas the sentinels know and do not consider down."""
    pool = sentinel_pool(client)
    if pool is None:
        return []
    return [(str(h), int(p)) for h, p in pool.sentinel_manager.discover_slaves(pool.service_name)]


@dataclass(frozen=True)
class NodeFinding:
    """What one replica's notification settings mean for a failover to it."""

    address: Address
    status: str
    """ok, warn or fail (as doctor's checks)."""
    detail: str

    @property
    def name(self) -> str:
        """`replica host:port`."""
        return f"replica {self.address[0]}:{self.address[1]}"


def prepare_replicas(client: redis.Redis, *, configure: bool) -> list[NodeFinding]:
    """Check (with `configure`: turn on) expired-key notifications on every replica the
    sentinels know: a replica promoted by a failover announces nothing without them."""
    pool = sentinel_pool(client)
    if pool is None:
        return []
    findings = []
    for address in replica_addresses(client):
        replica = _node_client(pool, address)
        where = f"replica {address[0]}:{address[1]}"
        try:
            warning = notification_flags(replica, configure=configure, where=where)
            findings.append(
                NodeFinding(address, "warn", warning)
                if warning
                else NodeFinding(address, "ok", "expired events on: a failover to it keeps them")
            )
        except RedisConfigError as exc:
            reason = str(exc).removeprefix(f"{where} ")  # the finding's name says where
            findings.append(
                NodeFinding(address, "fail", f"{reason} (a failover to it stops events)")
            )
        except (redis.RedisError, OSError) as exc:
            findings.append(NodeFinding(address, "warn", f"not reachable from here: {exc}"))
        finally:
            replica.close()
    return findings


def _node_client(pool: SentinelConnectionPool, address: Address) -> redis.Redis:
    """A plain client for one node of the group, with the master's credentials and TLS."""
    kwargs = {
        k: v
        for k, v in pool.connection_kwargs.items()
        if k not in ("connection_pool", "host", "port", "retry", "health_check_interval")
    }
    tls = issubclass(pool.connection_class, SSLConnection)
    kwargs.update(
        socket_connect_timeout=_REPLICA_TIMEOUT_S,
        socket_timeout=_REPLICA_TIMEOUT_S,
        retry=Retry(NoBackoff(), 0),
    )
    node_pool = ConnectionPool(
        connection_class=SSLConnection if tls else Connection,
        host=address[0],
        port=address[1],
        **kwargs,
    )
    return redis.Redis(connection_pool=node_pool)


class MasterWatch:
    """Asks the sentinels where the master is every `interval_s`; when it is not the node the
    subscription is on, calls `on_switch` (the subscription then rebuilds on the new master).

    Polling rather than subscribing to the sentinels' `+switch-master`: a poll heals by itself
    after a sentinel restarts or a connection to it drops (a missed pub/sub message is never
    noticed), costs one small command per interval, and finds a switch at most `interval_s`
    after it, well inside the seconds a failover itself takes (down-after-milliseconds, the
    vote, the promotion).

    `SETTLE_S` after a switch it calls `on_settled` (the listener reconciles again): a client
    may have set keys on the former master until its pool asked the sentinels again, and those
    keys are gone from the new one.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        subscribed_node: Callable[[], Address | None],
        on_switch: Callable[[], None],
        on_settled: Callable[[], None] = lambda: None,
        interval_s: float = WATCH_INTERVAL_S,
    ) -> None:
        self._client = client
        self._subscribed_node = subscribed_node
        self._on_switch = on_switch
        self._on_settled = on_settled
        self._settle_at_s: float | None = None
        self.interval_s = interval_s
        self.master: Address | None = None
        """The master the sentinels named at the last poll that got an answer."""
        self.switches = 0
        """Master changes seen since start."""
        self._unknown = False

    def check(self) -> Address | None:
        """One poll; returns the master's address, or None while no sentinel names one."""
        try:
            address = master_address(self._client)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            if not self._unknown:
                self._unknown = True
                logger.warning("no sentinel names a master now ({}); asking again", exc)
            return None
        self._unknown = False
        if self._settle_at_s is not None and monotonic_s() >= self._settle_at_s:
            self._settle_at_s = None
            self._on_settled()
        node = self._subscribed_node()
        # Before its first answer the watch knows no master, but the subscription does: a
        # switch between the subscription's connect and that answer (a `SENTINEL FAILOVER`
        # takes well under the first interval) is a switch all the same, and must bring the
        # settled reconciliation for keys set on the old master.
        known = self.master if self.master is not None else node
        if address != known:
            if known is not None:
                self.switches += 1
                self._settle_at_s = monotonic_s() + SETTLE_S
                logger.warning(
                    "the sentinels name a new master {}:{} (was {}:{}): moving the subscription",
                    *address,
                    *known,
                )
            self.master = address
            if node != address:
                self._on_switch()
        elif node is not None and node != address:
            # Subscribed to a node that is no longer the master (a switch during the connect).
            self._on_switch()
        return address

    def loop(self, stop: threading.Event) -> None:
        """Poll until `stop`."""
        while not stop.wait(self.interval_s):
            self.check()
