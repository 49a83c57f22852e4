"""The soak's Redis, in either shape a production fleet runs: behind Sentinel (with HAProxy before
it for clients that do not speak Sentinel) or a Redis Cluster. Each starts and stops its
servers, names the URLs the listeners and the producer use, and makes the Redis faults of the
rotation its own way (`soak.SoakRun` makes the others)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

import redis
from redis.sentinel import Sentinel

from keyexpiry.bench.servers import LOOPBACK, HAProxy, wait_until
from keyexpiry.bench.servers.cluster import ClusterNode, LocalCluster
from keyexpiry.bench.servers.sentinel import SentinelGroup

SENTINEL_FAULTS = (
    "kill9", "sigstop", "failover", "pubsub_kill", "ledger_restart", "flushall", "stall",
)  # fmt: skip
"""The rotation on Sentinel, one fault per slot; FLUSHALL happens once per run."""
CLUSTER_FAULTS = (*SENTINEL_FAULTS, "reshard")
"""On a Cluster the same, and slots moved from one primary to another under load."""
SETTLE_HOLD_S = 2.0
"""A failover is over when the sentinels' view has stood still this long: twice the group's 1 s
`down-after`, in which a sentinel that lost sight of the new master starts another failover
(the Sentinel hour of 2026-12-06: one 1 s after a failover's end, and the master it demoted,
alive, answered `role:master` for 10 s more, keeping the listener behind HAProxy on it)."""
RESHARD_SLOTS = 2000
"""Slots (and their keys) the `reshard` fault moves: an eighth of the cluster."""


class SoakRedis(Protocol):
    """What the soak needs of its Redis."""

    faults: tuple[str, ...]
    description: str
    """For the report: what the Redis is and how the listeners reach it."""

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def listener_urls(self, n: int) -> list[str]: ...
    def url(self) -> str: ...
    def primaries(self) -> list[redis.Redis]:
        """A client of each primary (short timeouts); the caller closes them."""
        ...

    def ports(self) -> set[int]: ...
    def failover(self, turn: int) -> str: ...
    def stalled_slots(self, n: int) -> list[int]:
        """The listener slots (of `n`) the stall cuts off from Redis."""
        ...

    def stall(self, seconds: float, n: int) -> str:
        """Make the stall, `seconds` long; returns what it did."""
        ...

    def reshard(self, turn: int) -> str: ...


class SentinelRedis:
    """A master, a replica and three sentinels; HAProxy (a `role:master` check) before the two
    data nodes for the last listener, which is also where the stall is made (SIGSTOP)."""

    faults: tuple[str, ...] = SENTINEL_FAULTS
    description = (
        "Redis behind Sentinel (master, replica, three sentinels); two listeners speak "
        "Sentinel, one reaches Redis through HAProxy"
    )

    def __init__(self, work: Path, binary: str) -> None:
        self.work = work
        self.group = SentinelGroup(work / "redis", binary=binary)
        self.haproxy: HAProxy | None = None

    def start(self) -> None:
        """The group, then HAProxy before its data nodes."""
        self.group.start()
        self.haproxy = HAProxy(
            self.work / "haproxy",
            servers=[(f"node{i}", n.port) for i, n in enumerate(self.group.nodes)],
            check="redis-master",
            inter_ms=300,
        )
        self.haproxy.start()
        self.haproxy.wait_up(["node0"])

    def stop(self) -> None:
        """Everything started (idempotent)."""
        try:
            self.group.stop()
        finally:
            if self.haproxy is not None:
                self.haproxy.stop()

    def listener_urls(self, n: int) -> list[str]:
        """Sentinel for all but the last listener, HAProxy for the last."""
        assert self.haproxy is not None
        return [self.group.url()] * (n - 1) + [self.haproxy.redis_url()]

    def url(self) -> str:
        """The producer's: Sentinel."""
        return self.group.url()

    def primaries(self) -> list[redis.Redis]:
        """The master as the sentinels name it now."""
        hosts = [(LOOPBACK, s.port) for s in self.group.sentinels]
        factory: Any = Sentinel  # typed by redis-py from 8.2 on only
        sentinel = factory(hosts, socket_timeout=1.0, socket_connect_timeout=1.0)
        client: redis.Redis = sentinel.master_for(self.group.service, socket_timeout=2.0)
        return [client]

    def ports(self) -> set[int]:
        """The data nodes', the sentinels' and HAProxy's."""
        ports = {n.port for n in self.group.nodes} | {s.port for s in self.group.sentinels}
        if self.haproxy is not None:
            ports.add(self.haproxy.port)
        return ports

    def failover(self, turn: int) -> str:
        """kill -9 of the master; back as a replica of the one promoted."""
        old = self.group.master_node()
        old.kill()
        wait_until(
            lambda: self.group.master_address() not in (None, (LOOPBACK, old.port)),
            60,
            interval_s=0.1,
            message="no failover",
        )
        new = self.group.master_node()
        # Back as a replica of the new master, as an operator (or systemd and Sentinel) would.
        old.restart(
            args=["--repl-diskless-sync-delay", "0", "--replicaof", LOOPBACK, str(new.port)]
        )
        # Over once Sentinel is at rest, not at its announcement: the record's window must hold
        # a second failover in its wake and the two-master time that follows one.
        masters = self.group.wait_settled(SETTLE_HOLD_S)
        moves = masters[1:] if masters[0] == new.port else masters
        again = "".join(f", Sentinel failed over again to :{port}" for port in moves)
        return f"master :{old.port} killed -9, :{new.port} promoted, old one back as replica{again}"

    def stalled_slots(self, n: int) -> list[int]:
        """The last one, behind HAProxy."""
        return [n - 1]

    def stall(self, seconds: float, n: int) -> str:
        """HAProxy before the last listener frozen for `seconds`."""
        assert self.haproxy is not None
        self.haproxy.pause()
        time.sleep(seconds)  # the fault's own length
        self.haproxy.resume()
        return f"HAProxy before listener {n - 1} stopped {seconds:g} s"

    def reshard(self, turn: int) -> str:
        """Not a Sentinel fault."""
        raise ValueError("reshard is a Redis Cluster fault")


class ClusterRedis:
    """Three primaries with a replica each; every listener and the producer speak Cluster."""

    faults: tuple[str, ...] = CLUSTER_FAULTS
    description = (
        "a Redis Cluster (three primaries, a replica each, node timeout 1.5 s); every listener "
        "speaks Cluster"
    )

    def __init__(self, work: Path, binary: str) -> None:
        self.cluster = LocalCluster(work / "cluster", primaries=3, replicas=1, binary=binary)

    def start(self) -> None:
        """Every node; returns once the cluster is healthy."""
        self.cluster.start()

    def stop(self) -> None:
        """Every node (idempotent)."""
        self.cluster.stop()

    def listener_urls(self, n: int) -> list[str]:
        """`redis+cluster://` with every node, for each listener."""
        return [self.cluster.url()] * n

    def url(self) -> str:
        """The producer's: the same."""
        return self.cluster.url()

    def primaries(self) -> list[redis.Redis]:
        """Each primary serving slots now."""
        return [n.admin(timeout_s=2.0) for n in self.cluster.primaries()]

    def ports(self) -> set[int]:
        """Every node's client port (the bus is the nodes' own)."""
        return {n.port for n in self.cluster.nodes}

    def failover(self, turn: int) -> str:
        """kill -9 of a primary (each in turn); its replica is promoted; the killed node comes
        back and rejoins as that replica's replica."""
        primaries = sorted(self.cluster.primaries(), key=lambda n: n.port)
        victim = primaries[turn % len(primaries)]
        promoted = self.cluster.kill_primary(victim)
        victim.restart()
        self.cluster.wait_healthy(60)
        return f"primary :{victim.port} killed -9, :{promoted.port} promoted, old one back"

    def stalled_slots(self, n: int) -> list[int]:
        """None is cut off from the ledger: their runs are not in a documented window."""
        return []

    def stall(self, seconds: float, n: int) -> str:
        """One primary answers no one for `seconds` (CLIENT PAUSE ALL): the listeners'
        subscriptions to it fall silent, as on a stalled link."""
        primary = sorted(self.cluster.primaries(), key=lambda node: node.port)[0]
        primary.command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")
        time.sleep(seconds)  # the fault's own length
        return f"primary :{primary.port} paused {seconds:g} s (CLIENT PAUSE ALL)"

    def reshard(self, turn: int) -> str:
        """`RESHARD_SLOTS` slots and their keys moved between two primaries under load, by
        `redis-cli --cluster reshard` (MIGRATE keeps each key's expiry)."""
        primaries = sorted(self.cluster.primaries(), key=lambda n: n.port)
        source = max(primaries, key=self._slot_count)
        target = primaries[(primaries.index(source) + 1 + turn) % len(primaries)]
        if target is source:
            target = primaries[(primaries.index(source) + 1) % len(primaries)]
        self.cluster.reshard(source, target, RESHARD_SLOTS)
        self.cluster.wait_healthy(60)
        return f"{RESHARD_SLOTS} slots moved from :{source.port} to :{target.port}"

    def _slot_count(self, node: ClusterNode) -> int:
        return sum(hi - lo + 1 for lo, hi in self.cluster.slots_of(node))


def soak_redis(kind: str, work: Path, binary: str) -> SoakRedis:
    """`sentinel` or `cluster`."""
    if kind == "cluster":
        return ClusterRedis(work, binary)
    if kind == "sentinel":
        return SentinelRedis(work, binary)
    raise ValueError(f"unknown soak Redis {kind!r} (sentinel or cluster)")
