"""A Redis Sentinel group on loopback: a master, a replica and three sentinels (quorum 2).

Sentinels normally take seconds to find each other (hello messages every 2 s) and up to 10 s to
learn a replica (the master's INFO, read every 10 s). Each sentinel's config file here already
names its peers (`known-sentinel`, with fixed ids) and the replica (`known-replica`), so the group
is ready as soon as every process answers and the replica has synced; `wait_ready` still checks
on a deadline that each sentinel knows the replica and its peers before a test faults anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from keyexpiry.bench.servers.process import (
    LOOPBACK,
    ServerError,
    _resolve_binary,
    free_port,
    wait_until,
)
from keyexpiry.bench.servers.redis import RedisServer

SERVICE = "keyexpiry"
"""The service name the group's sentinels monitor."""


class SentinelServer(RedisServer):
    """`redis-server --sentinel` with its own (rewritable) config file."""

    _kind = "sentinel"

    def __init__(
        self,
        workdir: Path,
        *,
        config: str,
        port: int,
        binary: str = "redis-server",
    ) -> None:
        super().__init__(workdir, port=port, binary=binary)
        self.config_path = self.workdir / "sentinel.conf"
        # Sentinel rewrites its config as it learns; write ours only once, so a restart keeps
        # what it learned (as a real deployment would).
        if not self.config_path.exists():
            self.config_path.write_text(config)

    @property
    def log_path(self) -> Path:
        """Sentinel log file."""
        return self.workdir / "sentinel.log"

    def _command(self) -> list[str]:
        return [
            _resolve_binary(self.binary),
            str(self.config_path),
            "--sentinel",
            "--port", str(self._port),
            "--bind", LOOPBACK,
            "--dir", str(self.workdir),
            "--daemonize", "no",
            "--logfile", str(self.log_path),
            "--protected-mode", "no",
        ]  # fmt: skip

    def _graceful_stop(self, proc: Any) -> None:
        proc.terminate()  # sentinels have no SHUTDOWN NOSAVE worth waiting on


class SentinelGroup:
    """Master, replica and three sentinels monitoring them as `service` (quorum 2).

    `down_after_ms` is how long a silent master takes to be marked down, `failover_timeout_ms`
    bounds a failover. `replica_args` go to the replica only (e.g. no notifications), `args` to
    both data nodes.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        service: str = SERVICE,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
        args: Sequence[str] = (),
        replica_args: Sequence[str] = (),
        binary: str = "redis-server",
    ) -> None:
        self.workdir = Path(workdir).resolve()
        self.service = service
        # The master feeds a replica at once instead of waiting 5 s for more to join.
        args = ["--repl-diskless-sync-delay", "0", *args]
        self.master = RedisServer(self.workdir / "node-0", args=args, binary=binary)
        replica_of = ["--replicaof", LOOPBACK, str(self.master.port)]
        self.replica = RedisServer(
            self.workdir / "node-1", args=[*args, *replica_of, *replica_args], binary=binary
        )
        self.nodes = [self.master, self.replica]
        ports = [free_port() for _ in range(3)]
        ids = [hashlib.sha1(f"{self.workdir}:{p}".encode()).hexdigest() for p in ports]
        self.sentinels = []
        for i, (port, myid) in enumerate(zip(ports, ids, strict=True)):
            lines = [
                f"sentinel myid {myid}",
                f"sentinel monitor {service} {LOOPBACK} {self.master.port} 2",
                f"sentinel down-after-milliseconds {service} {down_after_ms}",
                f"sentinel failover-timeout {service} {failover_timeout_ms}",
                f"sentinel parallel-syncs {service} 1",
                f"sentinel known-replica {service} {LOOPBACK} {self.replica.port}",
            ]
            lines += [
                f"sentinel known-sentinel {service} {LOOPBACK} {p} {other}"
                for p, other in zip(ports, ids, strict=True)
                if p != port
            ]
            self.sentinels.append(
                SentinelServer(
                    self.workdir / f"sentinel-{i}",
                    config="\n".join(lines) + "\n",
                    port=port,
                    binary=binary,
                )
            )

    def url(self, db: int = 0, *, query: str = "") -> str:
        """`redis+sentinel://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3/SERVICE/db`."""
        hosts = ",".join(f"{LOOPBACK}:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}/{db}{query}"

    def start(self) -> None:
        """Start every process and wait until the group is ready (see `wait_ready`)."""
        for server in [*self.nodes, *self.sentinels]:
            server.start()
        self.wait_ready()

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        """Wait until the replica is in sync and every sentinel knows the master, the replica
        and two peers, so a failover can happen."""
        wait_until(self._replica_synced, timeout_s, interval_s=0.02, message="replica not synced")
        for sentinel in self.sentinels:
            wait_until(
                lambda s=sentinel: self._knows_group(s),  # type: ignore[misc]
                timeout_s,
                interval_s=0.02,
                message=f"sentinel {sentinel.port} does not know the group",
            )

    def master_address(self) -> tuple[str, int] | None:
        """The master's address as the first sentinel that answers names it."""
        for sentinel in self.sentinels:
            if not sentinel.running:
                continue
            client = self._admin(sentinel)
            try:
                found: Any = client.sentinel_get_master_addr_by_name(self.service)
            except redis.RedisError:
                continue
            finally:
                client.close()
            if found:
                return str(found[0]), int(found[1])
        return None

    def master_node(self) -> RedisServer:
        """The data node the sentinels name as master now."""
        address = self.master_address()
        for node in self.nodes:
            if address == (LOOPBACK, node.port):
                return node
        raise AssertionError(f"no node of the group is at {address}")

    def settled_master(self) -> int | None:
        """The master's port once the group is at rest, else None: every running sentinel names
        that master, sees it up and has no failover under way, and of the running data nodes it
        is the only one that says `role:master`, the others streaming from it.

        A failover's end as Sentinel announces it is not rest: a node demoted while alive (by a
        second failover, or `SENTINEL FAILOVER`) says `role:master` until a sentinel turns it
        into a replica, 8-10 s later, and a client routed by a `role:master` check (HAProxy)
        may stay on it all that time, hearing none of the real master's expiries.
        """
        named: set[int] = set()
        for sentinel in self.sentinels:
            if not sentinel.running:
                continue
            client = self._admin(sentinel)
            try:
                master: Any = client.sentinel_master(self.service)
            except redis.RedisError:
                return None
            finally:
                client.close()
            flags = master["flags"]
            flags = flags if isinstance(flags, set) else set(str(flags).split(","))
            if flags & {"s_down", "o_down", "failover_in_progress"}:
                return None
            named.add(int(master["port"]))
        if len(named) != 1:
            return None
        (port,) = named
        for node in self.nodes:
            if not node.running:
                continue
            info = self._replication(node)
            if info is None:
                return None
            streams = (info.get("role"), int(info.get("master_port", 0))) == ("slave", port)
            if node.port == port:
                if info.get("role") != "master":
                    return None
            elif not (streams and info.get("master_link_status") == "up"):
                return None
        return port

    def wait_settled(self, hold_s: float, timeout_s: float = 60.0) -> list[int]:
        """Wait until the group has been at rest (`settled_master`) under one master for
        `hold_s`; returns each master it settled under, in order (more than one: Sentinel
        failed over again meanwhile). Raises `ServerError` past `timeout_s`."""
        masters: list[int] = []
        since: float | None = None
        deadline = time.monotonic() + timeout_s
        while True:
            port = self.settled_master()
            now = time.monotonic()
            if port is None:
                since = None
            else:
                if not masters or masters[-1] != port:
                    masters.append(port)
                    since = now
                elif since is None:
                    since = now
                if now - since >= hold_s:
                    return masters
            if now > deadline:
                raise ServerError(f"the Sentinel group did not settle in {timeout_s:g} s")
            time.sleep(0.05)

    def failover(self) -> None:
        """`SENTINEL FAILOVER`: promote the replica without waiting for a quorum."""
        client = self._admin(self.sentinels[0])
        try:
            client.execute_command("SENTINEL", "FAILOVER", self.service)  # type: ignore[no-untyped-call]
        finally:
            client.close()

    def stop(self) -> None:
        """Stop every process (a dead one is skipped)."""
        for server in [*self.sentinels, *self.nodes]:
            with contextlib.suppress(Exception):
                server.kill()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- internals --------------------------------------------------------------------

    def _admin(self, server: RedisServer) -> redis.Redis:
        return redis.Redis(
            host=LOOPBACK,
            port=server.port,
            socket_connect_timeout=1,
            socket_timeout=2,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )

    def _replication(self, node: RedisServer) -> dict[str, Any] | None:
        """`INFO replication` of `node`, or None when it does not answer."""
        client = self._admin(node)
        try:
            info: dict[str, Any] = client.info("replication")
            return info
        except redis.RedisError:
            return None
        finally:
            client.close()

    def _replica_synced(self) -> bool:
        info = self._replication(self.replica)
        return info is not None and info.get("master_link_status") == "up"

    def _knows_group(self, sentinel: SentinelServer) -> bool:
        client = self._admin(sentinel)
        try:
            master: Any = client.sentinel_master(self.service)
            replicas: Any = client.sentinel_slaves(self.service)
        except redis.RedisError:
            return False
        finally:
            client.close()
        known = [r for r in replicas if not (r["is_sdown"] or r["is_odown"])]
        return (
            bool(known)
            and int(master.get("num-other-sentinels", 0)) >= 2
            and not (master["is_sdown"] or master["is_odown"])
        )
