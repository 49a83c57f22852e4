"""Redis Cluster: the `redis+cluster://` URL, the command client, and the topology as seen now.

A cluster URL names entry points, not the cluster: `redis+cluster://[user:pw@]h1:p1[,h2:p2…]`
(`rediss+cluster://` for TLS, query options as for `redis://`). Commands go through redis-py's
`RedisCluster`, which routes each key to its slot's primary and follows MOVED/ASK. Everything
that must reach one particular node (the subscription of each primary, CONFIG on every node,
the canary and sentinel keys of each primary) uses `Topology`, read with CLUSTER SLOTS/NODES
from whichever known node answers first.

Only database 0 exists in a cluster. Keys whose name holds `{…}` hash by what the braces hold:
keyexpiry's own per-node keys use that on purpose (`node_tag`), and task keys never contain a
brace (arguments escape them), so tasks spread over every slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import SSLConnection, parse_url
from redis.crc import key_slot
from redis.retry import Retry

from keyexpiry.errors import ConfigError
from keyexpiry.redis.handshake import handshake_options

SCHEMES = ("redis+cluster", "rediss+cluster")
SLOTS = 16384


def is_cluster_url(url: str | None) -> bool:
    """Whether `url` names a Redis Cluster (`redis+cluster://` or `rediss+cluster://`)."""
    return bool(url) and urlsplit(str(url)).scheme.lower() in SCHEMES


@dataclass(frozen=True)
class ClusterUrl:
    """A parsed cluster URL: entry points, and the options every node connection gets."""

    addresses: tuple[tuple[str, int], ...]
    options: dict[str, Any] = field(hash=False)
    """redis-py connection options from the URL (user, password, TLS, query arguments)."""


def parse_cluster_url(url: str) -> ClusterUrl:
    """Parse `redis+cluster://[user:pw@]host:port[,host:port…][/0][?options]`.

    Raises ConfigError for no host, a bad port, or a database other than 0.
    """
    parts = urlsplit(url)
    tls = parts.scheme.lower() == "rediss+cluster"
    userinfo, _, hosts = parts.netloc.rpartition("@")
    addresses: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not item.strip():
            continue
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"redis_url: cluster entry point {item.strip()!r} is not host:port "
                "(redis+cluster://host:port[,host:port…])"
            )
        addresses.append((host.strip("[]"), int(port)))
    if not addresses:
        raise ConfigError("redis_url: a cluster URL needs at least one host:port entry point")
    db = parts.path.strip("/")
    if db not in ("", "0"):
        raise ConfigError(
            f"redis_url: a Redis Cluster has only database 0, the URL asks for {db!r}"
        )
    # redis-py parses the credentials and query options of a one-node URL: reuse that.
    one = f"{'rediss' if tls else 'redis'}://{userinfo + '@' if userinfo else ''}localhost/0"
    if parts.query:
        one += "?" + parts.query
    try:
        options = dict(parse_url(one))  # type: ignore[no-untyped-call]
    except ValueError as exc:
        raise ConfigError(f"redis_url: {exc}") from None
    for name in ("host", "port", "db", "path"):
        options.pop(name, None)
    if options.pop("connection_class", None) is SSLConnection:
        options["ssl"] = True
    return ClusterUrl(tuple(addresses), options)


def cluster_client(parsed: ClusterUrl, options: dict[str, Any]) -> RedisCluster:
    """The command client: every key to its slot's primary, redirections followed."""
    merged = {**parsed.options, **options}
    retry = merged.pop("retry", None)
    merged.pop("health_check_interval", None)  # commands have timeouts instead
    # Options for one node's connections (`handshake_options`), which RedisCluster does not
    # take: with no health check here, its handshake has nothing to misread either.
    for name in handshake_options():
        merged.pop(name, None)
    nodes = [ClusterNode(host, port) for host, port in parsed.addresses]  # type: ignore[no-untyped-call]
    try:
        return RedisCluster(
            startup_nodes=nodes,
            retry=retry,
            require_full_coverage=False,
            # A failover takes a node timeout or two: keep asking meanwhile.
            reinitialize_steps=1,
            **merged,
        )
    except redis.RedisError as exc:
        raise redis.ConnectionError(f"no cluster entry point answered: {exc}") from None


def node_client(address: str, parsed: ClusterUrl, options: dict[str, Any]) -> redis.Redis:
    """A plain client to one node (`host:port`) with the URL's credentials and TLS."""
    host, _, port = address.rpartition(":")
    merged = {**parsed.options, **options}
    if merged.pop("ssl", False):
        merged["connection_class"] = SSLConnection
    return redis.Redis(connection_pool=redis.ConnectionPool(host=host, port=int(port), **merged))


@dataclass(frozen=True)
class Topology:
    """Who serves which slots now: primaries (by `host:port`) and every node, replicas too."""

    slots: dict[str, tuple[tuple[int, int], ...]]
    """Slot ranges of each primary that serves any."""
    nodes: tuple[str, ...]
    """Every node: CLUSTER SLOTS's (primaries, then their replicas), then the replicas only
    CLUSTER NODES names (`read_topology`)."""

    @property
    def primaries(self) -> list[str]:
        """Primaries serving at least one slot, sorted."""
        return sorted(self.slots)

    def owner(self, slot: int) -> str | None:
        """The primary serving `slot`, or None when no one does."""
        for address, ranges in self.slots.items():
            if any(lo <= slot <= hi for lo, hi in ranges):
                return address
        return None

    def moved_from(self, older: Topology) -> list[str]:
        """Primaries whose slots differ from `older` (gained, lost, new or gone)."""
        names = set(self.slots) | set(older.slots)
        return sorted(n for n in names if self.slots.get(n) != older.slots.get(n))

    def describe(self) -> str:
        """`host:port (n slots), …` for log lines."""
        return ", ".join(
            f"{a} ({sum(hi - lo + 1 for lo, hi in self.slots[a])} slots)" for a in self.primaries
        )


_NOT_A_MEMBER = frozenset({"fail", "noaddr", "handshake"})
"""CLUSTER NODES flags of a node the cluster itself does not count on now."""


def read_topology(client: redis.Redis) -> Topology:
    """CLUSTER SLOTS of the node `client` talks to, as a Topology, with every other member CLUSTER
    NODES names.

    CLUSTER SLOTS leaves out a replica that has not replicated a byte yet (Redis 7: replication
    offset 0), as every replica of a new or idle cluster is: read from it alone, the nodes'
    checks (`doctor`, a listener's start) never reached such a replica, and it would be
    promoted later without the notifications it was meant to get. The node asked may not have
    heard yet, by gossip, that a new replica replicates (it still says `master`, no slots): every
    member counts, whatever its role, as does a primary that joined for a reshard and has no
    slots yet.
    """
    table = cast(list[Any], client.execute_command("CLUSTER SLOTS"))  # type: ignore[no-untyped-call]
    slots: dict[str, list[tuple[int, int]]] = {}
    nodes: list[str] = []
    for entry in table:
        lo, hi, primary, *replicas = entry
        address = _address(primary)
        slots.setdefault(address, []).append((int(lo), int(hi)))
        for node in (primary, *replicas):
            if _address(node) not in nodes:
                nodes.append(_address(node))
    nodes += [a for a in _members_named(client) if a not in nodes]
    return Topology({a: tuple(sorted(r)) for a, r in slots.items()}, tuple(nodes))


def _members_named(client: redis.Redis) -> list[str]:
    """Nodes CLUSTER NODES names, sorted, without those the cluster counts as failed or not
    yet joined; none when the command is refused (an ACL that allows CLUSTER SLOTS alone
    must not stop the listener) or the answer is not the table redis-py parses it into."""
    try:
        table = client.execute_command("CLUSTER NODES")  # type: ignore[no-untyped-call]
    except redis.ResponseError:
        return []
    if not isinstance(table, dict):
        return []
    found = []
    for address, info in table.items():
        flags = set(str(info.get("flags", "")).split(",")) if isinstance(info, dict) else set()
        host, _, port = str(address).rpartition(":")
        member = flags & {"master", "slave"} and not flags & _NOT_A_MEMBER
        if member and host and port.isdigit():
            found.append(f"{host}:{int(port)}")
    return sorted(found)


def _address(node: Any) -> str:
    if isinstance(node, dict):  # RESP3 / parsed form
        host = node.get("host") or node.get(b"host")
        port = node.get("port") or node.get(b"port") or 0
    else:
        host, port = node[0], node[1]
    host = host.decode() if isinstance(host, bytes) else str(host)
    return f"{host}:{int(port)}"


def node_tag(ranges: tuple[tuple[int, int], ...], start: int = 0) -> str:
    """A hash tag `{…}` whose slot falls in `ranges`: a key ending with it lives on the primary
    serving those slots (the canary and the sentinels of each primary use one)."""
    for n in range(start, start + 200_000):
        tag = f"n{n}"
        slot = key_slot(tag.encode())
        if any(lo <= slot <= hi for lo, hi in ranges):
            return "{" + tag + "}"
    raise ValueError("no hash tag found for the slot ranges")  # pragma: no cover


class ClusterNodes:
    """The cluster side of a `Runtime`: the command client, and one plain client per node for
    what must reach a given node (subscriptions, CONFIG, ROLE, the topology itself)."""

    def __init__(self, parsed: ClusterUrl, options: dict[str, Any]) -> None:
        self.parsed = parsed
        self.options = options
        self.commands = cluster_client(parsed, options)
        self._admins: dict[str, redis.Redis] = {}
        self._known: list[str] = [f"{h}:{p}" for h, p in parsed.addresses]
        self.last: Topology | None = None
        self._read_from: str | None = None
        """The node that last answered CLUSTER SLOTS (read from every refresh while it does)."""
        self._unanswered: set[str] = set()
        """Nodes whose last CLUSTER SLOTS failed (timed out, refused): asked last."""

    def admin(self, address: str) -> redis.Redis:
        """A cached plain client to `address` for short commands (fails fast: no retries, which
        made a stalled node cost five seconds per command instead of two)."""
        client = self._admins.get(address)
        if client is None:
            quick = {
                **self.options,
                "socket_timeout": 2,
                "socket_connect_timeout": 1,
                "retry": Retry(NoBackoff(), 0),
            }
            client = node_client(address, self.parsed, quick)
            self._admins[address] = client
        return client

    def admin_pools(self) -> list[tuple[Any, int]]:
        """The check clients' pools for `IdleTrimmer`, each with its floor: one connection kept
        to each primary and to the node the topology is read from (every few seconds: a replica
        once its primary did not answer), none to other replicas or nodes gone (asked when the
        listener subscribes again). Untrimmed, each grew by the threads that asked at once and
        kept it (the Cluster hour: +3 per listener)."""
        kept = set(self.last.slots) if self.last else set()
        kept.add(self._read_from or "")
        return [
            (client.connection_pool, int(address in kept))
            for address, client in dict(self._admins).items()
        ]

    def subscriber(self, address: str) -> redis.Redis:
        """A client for a subscription on `address`, with a health check. Its reads wait for
        a message only once select says one is there, so the read timeout bounds a message cut
        off half-way, and a connection's handshake with a node that stopped answering (without
        it, a subscription made again to a stalled primary waited for as long as it did)."""
        return node_client(address, self.parsed, {**self.options, "socket_timeout": 10})

    def topology(self) -> Topology:
        """The slot table, from the first known node that answers (the last one that did
        first, one that failed to answer last time after every other: a stalled node costs
        its read timeout once, not at every refresh); raises redis.ConnectionError when none
        does."""
        order = list(dict.fromkeys([*(self.last.nodes if self.last else ()), *self._known]))
        order.sort(key=lambda address: address in self._unanswered)  # stable
        error: Exception | None = None
        for address in order:
            try:
                topology = read_topology(self.admin(address))
            except (redis.RedisError, OSError) as exc:
                error = exc
                self._unanswered.add(address)
                continue
            self._unanswered.discard(address)
            self._read_from = address
            if not topology.slots:
                continue
            self.last = topology
            # Nodes seen once stay entry points: the URL's may all be gone after a rebuild.
            self._known = list(dict.fromkeys([*topology.nodes, *self._known]))
            return topology
        raise redis.ConnectionError(f"no cluster node answered CLUSTER SLOTS ({error})")

    def time(self) -> tuple[int, int]:
        """TIME of one node (the command client's default node; another if it is down)."""
        seconds, micros = self.commands.time(target_nodes=RedisCluster.DEFAULT_NODE)
        return int(seconds), int(micros)

    def close(self) -> None:
        """Close every connection."""
        self.commands.close()
        for client in self._admins.values():
            client.close()
        self._admins.clear()


def by_node(client: RedisCluster, keys: list[str]) -> list[tuple[redis.Redis, list[int]]]:
    """The positions of `keys` grouped by the primary serving their slot (as the client's slot
    cache says), each with a plain client for that primary: one plain pipeline per node costs
    the client much less than a cluster pipeline (which routes command by command)."""
    nodes = client.nodes_manager
    groups: dict[str, tuple[Any, list[int]]] = {}
    for i, key in enumerate(keys):
        node = nodes.get_node_from_slot(key_slot(key.encode()))
        groups.setdefault(node.name, (node, []))[1].append(i)
    return [(client.get_redis_connection(node), idx) for node, idx in groups.values()]
