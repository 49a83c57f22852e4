"""Idle Redis connections a burst or a recovery opened, closed again once they stay unused.

redis-py's pools never shrink: after a failover or a stall every thread of a listener that was
waiting reconnects at once, the pool opens as many connections as threads asked together, and
keeps them for the process's life. Over months of faults the steps add up (the soak: a listener
behind HAProxy went from 3 to 7 connections over a failover and a stall, and stayed there). A
connection closed here is only disconnected: it stays in its pool and connects again if ever
needed, so nothing that uses the pool notices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loguru import logger
from redis import Redis
from redis.cluster import PRIMARY, RedisCluster

TRIM_EVERY_S = 20.0
"""How long a connection must have stayed unneeded (at every sample) before it is closed. The
trim works in windows of this length, so a burst's connections close 20-40 s after it: within
the minute issue 42 asks. At 60 s (up to two minutes) the hour-long soak caught a listener 50 s
after a stall still holding 6 Redis connections where it had 3 (its growth check failed)."""


Watched = tuple[Any, int]
"""A connection pool, and how many connections it keeps at least when it was not needed (1 for
a pool in use, 0 for one nothing routes to any more)."""


def pools_of(client: Redis | RedisCluster) -> list[Watched]:
    """The connection pools behind `client`: its own, or each Cluster node's. A Cluster node
    that is not a primary keeps none: commands go to primaries only, and a replica a failover
    demoted kept the connection it had as a primary for good (the Cluster hour: 12 -> 15
    connections after three failovers)."""
    if isinstance(client, RedisCluster):
        nodes = client.get_nodes()  # type: ignore[no-untyped-call]
        return [
            (n.redis_connection.connection_pool, int(n.server_type == PRIMARY))
            for n in nodes
            if n.redis_connection
        ]
    pool = getattr(client, "connection_pool", None)
    return [] if pool is None else [(pool, 1)]


def _idle_connected(pool: Any) -> list[Any]:
    """The pool's idle connections that hold a socket, least recently used first (a pool hands
    out the last one released)."""
    idle = getattr(pool, "_available_connections", None)
    if not isinstance(idle, list):
        return []  # a pool of another shape: left as it is
    return [c for c in list(idle) if getattr(c, "_sock", None) is not None]


def _in_use(pool: Any) -> int:
    used = getattr(pool, "_in_use_connections", None)
    return len(used) if isinstance(used, (set, list)) else 0


class IdleTrimmer:
    """Samples each pool's connections at every `tick`; every `every_s`, closes those that were
    idle at every sample since (the pool never needed them), keeping as many as were ever in
    use at once at a sample, and at least the pool's own floor (a pool in steady use keeps its
    connections: its commands are too short to be caught in use by a sample)."""

    def __init__(self, pools: Callable[[], list[Watched]], every_s: float = TRIM_EVERY_S) -> None:
        """`pools()` names the pools to watch at each tick, each with its floor (a Cluster's
        change)."""
        self._pools = pools
        self.every_s = every_s
        self._least: dict[int, int] = {}
        self._peak: dict[int, int] = {}
        self._since_s: float | None = None
        self.closed_total = 0
        """Idle connections closed since start."""

    def tick(self, now_s: float) -> int:
        """Sample (and, once per `every_s`, close); returns how many were closed now."""
        pools = self._pools()
        for pool, _ in pools:
            idle, used = len(_idle_connected(pool)), _in_use(pool)
            self._least[id(pool)] = min(self._least.get(id(pool), idle), idle)
            self._peak[id(pool)] = max(self._peak.get(id(pool), used), used)
        if self._since_s is None:
            self._since_s = now_s
        if now_s - self._since_s < self.every_s:
            return 0
        closed = sum(
            self._close(pool, self._least.get(id(pool), 0), max(floor, self._peak.get(id(pool), 0)))
            for pool, floor in pools
        )
        self._least.clear()
        self._peak.clear()
        self._since_s = now_s
        if closed:
            self.closed_total += closed
            logger.debug("closed {} Redis connection(s) unused for {:g} s", closed, self.every_s)
        return closed

    @staticmethod
    def _close(pool: Any, count: int, keep: int) -> int:
        lock = getattr(pool, "_lock", None)
        if count <= 0 or lock is None:
            return 0
        with lock:  # not handed out while it closes
            idle = _idle_connected(pool)
            spare = len(idle) + _in_use(pool) - keep
            victims = idle[: max(0, min(count, spare))]
            for connection in victims:
                connection.disconnect()
        return len(victims)
