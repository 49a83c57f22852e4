"""A local Redis Cluster: `primaries` redis-server processes with `replicas` each, on loopback.

Built by hand rather than with `redis-cli --cluster create`, which waits in whole seconds: slots
are assigned with CLUSTER ADDSLOTSRANGE, nodes joined with CLUSTER MEET, replicas attached with
CLUSTER REPLICATE, and every step waits on a deadline. Each node gets a free client port and a
free cluster bus port (`cluster-port`), so no "+10000" port has to be free. The operations fault
tests need are here too: kill a primary and wait for its replica's promotion, move slots between
primaries (`redis-cli --cluster reshard`), add a primary.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from keyexpiry.bench.servers.process import LOOPBACK, ServerError, free_port, wait_until
from keyexpiry.bench.servers.redis import RedisServer

SLOTS = 16384
NODE_TIMEOUT_MS = 1500


class ClusterNode(RedisServer):
    """One node of a `LocalCluster` (a `RedisServer` with cluster mode on)."""

    def __init__(self, workdir: Path, *, args: Sequence[str] = (), binary: str) -> None:
        self.bus_port = free_port()
        cluster_args = [
            "--cluster-enabled", "yes",
            "--cluster-config-file", str(workdir / "nodes.conf"),
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
            "--cluster-port", str(self.bus_port),
            # A replica promoted after any outage, at once: the tests kill primaries on purpose.
            "--cluster-replica-validity-factor", "0",
            "--cluster-require-full-coverage", "no",
            "--notify-keyspace-events", "Exe",
            # A replica's first full sync starts at once, not after the default 5 s wait.
            "--repl-diskless-sync-delay", "0",
            *args,
        ]  # fmt: skip
        super().__init__(workdir, port=free_port(), args=cluster_args, binary=binary)

    @property
    def address(self) -> str:
        """`127.0.0.1:PORT`."""
        return f"{LOOPBACK}:{self.port}"

    def admin(self, timeout_s: float = 5.0) -> redis.Redis:
        """A plain client to this node without retries; the caller closes it."""
        return self.client(
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )

    def command(self, *args: Any) -> Any:
        """Run one command on this node (a fresh connection, closed after)."""
        client = self.admin()
        try:
            return client.execute_command(*args)  # type: ignore[no-untyped-call]
        finally:
            client.close()

    def node_id(self) -> str:
        """This node's cluster id."""
        value = self.command("CLUSTER", "MYID")
        return value.decode() if isinstance(value, bytes) else str(value)

    def info(self, section: str) -> dict[str, Any]:
        """INFO `section` of this node."""
        client = self.admin()
        try:
            return dict(client.info(section))
        finally:
            client.close()


class LocalCluster:
    """A Redis Cluster on loopback, persistence off, `Exe` notifications on every node."""

    def __init__(
        self,
        workdir: Path,
        *,
        primaries: int = 3,
        replicas: int = 1,
        binary: str = "redis-server",
        args: Sequence[str] = (),
    ) -> None:
        self.workdir = workdir
        self.binary = binary
        self._args = tuple(args)
        self._wanted = (primaries, replicas)
        self.nodes: list[ClusterNode] = []

    # --- life cycle ---------------------------------------------------------------------------
    def start(self, timeout_s: float = 30.0) -> None:
        """Start every node, assign the slots, join the nodes, attach replicas; wait until the
        cluster is ok on every node and every replica is in sync."""
        primaries, replicas = self._wanted
        self.nodes = [self._new_node() for _ in range(primaries * (1 + replicas))]
        for node in self.nodes:
            node.start()
        for epoch, node in enumerate(self.nodes, start=1):
            node.command("CLUSTER", "SET-CONFIG-EPOCH", epoch)
        step = SLOTS // primaries
        for i, node in enumerate(self.nodes[:primaries]):
            last = SLOTS - 1 if i == primaries - 1 else (i + 1) * step - 1
            node.command("CLUSTER", "ADDSLOTSRANGE", i * step, last)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            first.command("CLUSTER", "MEET", LOOPBACK, node.port, node.bus_port)
        total = len(self.nodes)
        wait_until(
            lambda: all(len(self._known(n)) == total for n in self.nodes),
            timeout_s,
            interval_s=0.02,
            message="cluster nodes did not meet",
        )
        for i, node in enumerate(self.nodes[primaries:]):
            node.command("CLUSTER", "REPLICATE", self.nodes[i % primaries].node_id())
        self.wait_healthy(timeout_s)

    def stop(self) -> None:
        """Stop every node (idempotent)."""
        for node in self.nodes:
            try:
                node.stop()
            except ServerError:
                pass

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def _new_node(self) -> ClusterNode:
        index = len(list(self.workdir.glob("node-*")))
        workdir = self.workdir / f"node-{index}"
        workdir.mkdir(parents=True)
        return ClusterNode(workdir, args=self._args, binary=self.binary)

    # --- what it looks like -------------------------------------------------------------------
    def url(self, scheme: str = "redis+cluster") -> str:
        """`redis+cluster://` with every running node as an entry point."""
        hosts = ",".join(n.address for n in self.nodes if n.running)
        return f"{scheme}://{hosts}"

    def running_nodes(self) -> list[ClusterNode]:
        """The nodes whose process is alive."""
        return [n for n in self.nodes if n.running]

    def primaries(self) -> list[ClusterNode]:
        """Running nodes that are primaries and own slots."""
        return [n for n in self.running_nodes() if self._role(n) == "master" and self._slots(n)]

    def replicas(self) -> list[ClusterNode]:
        """Running nodes that are replicas."""
        return [n for n in self.running_nodes() if self._role(n) == "slave"]

    def node_at(self, address: str) -> ClusterNode:
        """The node listening on `host:port`."""
        for node in self.nodes:
            if node.address == address:
                return node
        raise KeyError(address)

    def owner_of(self, slot: int) -> ClusterNode:
        """The primary serving `slot` now, as the cluster says."""
        for lo, hi, primary, *_ in self._slot_table():
            if lo <= slot <= hi:
                host, port = primary[0], primary[1]
                host = host.decode() if isinstance(host, bytes) else host
                return self.node_at(f"{host}:{port}")
        raise KeyError(slot)

    def flushall(self) -> None:
        """Empty every primary and put the default notifications back on every node."""
        for node in self.running_nodes():
            if self._role(node) == "master":
                node.command("FLUSHALL")
            node.command("CONFIG", "SET", "notify-keyspace-events", "Exe")

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Wait until every running node says cluster_state:ok and sees every slot served, every
        replica's link to its primary is up, and every running node sees every other in the role
        it has (gossip lags a REPLICATE or a failover: a check reading CLUSTER NODES of one node
        would race it)."""

        def healthy() -> bool:
            roles = {n.address: self._role(n) for n in self.running_nodes()}
            for node in self.running_nodes():
                if not self._views(node, roles):
                    return False
                info = self._cluster_info(node)
                if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != str(SLOTS):
                    return False
                if (
                    self._role(node) == "slave"
                    and node.info("replication").get("master_link_status") != "up"
                ):
                    return False
            return True

        wait_until(healthy, timeout_s, interval_s=0.05, message="cluster did not become healthy")

    # --- faults -------------------------------------------------------------------------------
    def kill_primary(self, node: ClusterNode, timeout_s: float = 30.0) -> ClusterNode:
        """kill -9 `node` (a primary) and wait until one of its replicas serves its slots;
        return that replica."""
        slot = self._slots(node)[0][0]
        node.kill()
        wait_until(
            lambda: self._try_owner(slot) not in (None, node),
            timeout_s,
            interval_s=0.05,
            message=f"no replica took over from {node.address}",
        )
        promoted = self._try_owner(slot)
        assert promoted is not None
        return promoted

    def reshard(self, source: ClusterNode, target: ClusterNode, slots: int) -> None:
        """Move `slots` slots (and their keys) from `source` to `target` with `redis-cli`."""
        cli = shutil.which("redis-cli") or "redis-cli"
        done = subprocess.run(
            [
                cli, "--cluster", "reshard", target.address,
                "--cluster-from", source.node_id(),
                "--cluster-to", target.node_id(),
                "--cluster-slots", str(slots),
                "--cluster-yes", "--cluster-pipeline", "1000",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )  # fmt: skip
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            raise ServerError(f"redis-cli --cluster reshard failed:\n{tail}")

    def add_primary(self, timeout_s: float = 30.0) -> ClusterNode:
        """Start a new empty node and join it as a primary (no slots yet)."""
        node = self._new_node()
        node.start()
        self.nodes.append(node)
        self.running_nodes()[0].command("CLUSTER", "MEET", LOOPBACK, node.port, node.bus_port)
        total = len(self.running_nodes())
        wait_until(
            lambda: all(len(self._known(n)) >= total for n in self.running_nodes()),
            timeout_s,
            interval_s=0.02,
            message="the new node did not join",
        )
        # redis-cli refuses to reshard until every node agrees on the configuration.
        self.wait_healthy(timeout_s)
        return node

    # --- cluster commands ---------------------------------------------------------------------
    def _slot_table(self) -> list[Any]:
        for node in self.running_nodes():
            try:
                return list(node.command("CLUSTER", "SLOTS"))
            except redis.RedisError:
                continue
        raise ServerError("no cluster node answers CLUSTER SLOTS")

    def _try_owner(self, slot: int) -> ClusterNode | None:
        try:
            owner = self.owner_of(slot)
        except (KeyError, ServerError):
            return None
        # The owner must also say it serves the slot (it was promoted, not just announced).
        if not owner.running or self._role(owner) != "master":
            return None
        return owner

    @staticmethod
    def _known(node: ClusterNode) -> list[str]:
        text = node.command("CLUSTER", "NODES")
        text = text.decode() if isinstance(text, bytes) else str(text)
        return [line for line in text.splitlines() if line.strip()]

    def _views(self, node: ClusterNode, roles: dict[str, str]) -> bool:
        """Whether `node` sees each of `roles` (address → own ROLE) with that role, not failing."""
        for line in self._known(node):
            fields = line.split()
            if len(fields) < 3:
                continue
            address = fields[1].split("@", 1)[0]
            flags = set(fields[2].split(","))
            if address not in roles:
                continue
            if flags & {"fail", "fail?", "handshake", "noaddr"} or roles[address] not in flags:
                return False
        return True

    @staticmethod
    def _cluster_info(node: ClusterNode) -> dict[str, str]:
        text = node.command("CLUSTER", "INFO")
        text = text.decode() if isinstance(text, bytes) else str(text)
        pairs = (line.split(":", 1) for line in text.splitlines() if ":" in line)
        return {k: v.strip() for k, v in pairs}

    @staticmethod
    def _role(node: ClusterNode) -> str:
        try:
            role = node.command("ROLE")[0]
        except redis.RedisError:
            return "down"
        return role.decode() if isinstance(role, bytes) else str(role)

    def slots_of(self, node: ClusterNode) -> list[tuple[int, int]]:
        """The slot ranges `node` serves now."""
        return self._slots(node)

    def _slots(self, node: ClusterNode) -> list[tuple[int, int]]:
        ranges = []
        for lo, hi, primary, *_ in self._slot_table():
            if int(primary[1]) == node.port:
                ranges.append((int(lo), int(hi)))
        return ranges
