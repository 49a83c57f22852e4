"""A local MariaDB Galera cluster: three `mariadbd` nodes replicating on loopback.

Node 1 is initialised with `mariadb-install-db` and bootstraps the cluster
(`--wsrep-new-cluster`); the others start with an empty datadir and receive it by state
snapshot transfer (SST, method `rsync`), then stay in sync through Galera. Each node has its
own client port, Galera port (`gmcast.listen_addr`), IST port (`ist.recv_addr`) and SST port
(`wsrep_sst_receive_address`), all free ports on 127.0.0.1. A node killed and started again
rejoins with an incremental transfer (IST) from a peer's write-set cache.

The SST script starts an rsync daemon on the joiner; started by root, rsyncd switches to the
`nobody` user by default, which can neither enter a private (0700) work dir nor write a
root-owned datadir. So, when run as root, the nodes get a private `--basedir` whose `bin/`
(which mariadbd puts first on the SST script's PATH) holds an `rsync` wrapper that keeps the
daemon as root (`--dparam=uid=root`).

The failure detector is tuned down from Galera's defaults (5 s suspect, 15 s inactive) so that
the survivors of a killed node form a new primary component in about 2 s: the tests kill nodes
on purpose and must not wait longer than a real deployment tuned for fast failover would.
Nothing here sleeps for a fixed time: every wait goes through `wait_until`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import pymysql

from keyexpiry.bench.servers.mariadb import MariaDBServer, _check_db_name
from keyexpiry.bench.servers.process import (
    LOOPBACK,
    ServerError,
    _resolve_binary,
    _ServerProcess,
    free_port,
    wait_until,
)

PROVIDER = "/usr/lib/galera/libgalera_smm.so"
"""Where Debian's `galera-4` package installs the wsrep provider."""

CLUSTER_NAME = "keyexpiry"

_PROVIDER_OPTIONS = (
    "gcache.size=32M",
    # Failure detection: a peer silent for 1 s is suspected, evicted after 2 s.
    "evs.keepalive_period=PT0.2S",
    "evs.inactive_check_period=PT0.3S",
    "evs.suspect_timeout=PT1S",
    "evs.inactive_timeout=PT2S",
    "evs.install_timeout=PT2S",
)

_RSYNC_WRAPPER = """#!/bin/sh
# Written by keyexpiry.bench.servers.galera: the SST daemon stays root (see the module docstring).
case " $* " in
  *" --daemon "*) exec {rsync} "$@" --dparam=uid=root --dparam=gid=root ;;
  *) exec {rsync} "$@" ;;
esac
"""


def find_provider(path: str | None = None) -> str | None:
    """The wsrep provider library (`path`, else `PROVIDER`), or None when it is not there."""
    candidate = path or PROVIDER
    return candidate if Path(candidate).is_file() else None


class GaleraNode(MariaDBServer):
    """One node of a `LocalGalera` (a `MariaDBServer` with wsrep on)."""

    _kind = "galera"
    # A joiner answers only once its SST is done.
    _start_timeout_s = 120.0

    def __init__(
        self,
        workdir: Path,
        *,
        name: str,
        provider: str,
        binary: str,
        install_binary: str,
        args: Sequence[str] = (),
    ) -> None:
        super().__init__(workdir, args=args, binary=binary, install_binary=install_binary)
        self.name = name
        self.provider = provider
        self.wsrep_port = free_port()
        self.ist_port = free_port()
        self.sst_port = free_port()
        self.peers: list[GaleraNode] = []
        """Every node of the cluster (this one included): its `gcomm://` address."""
        self._bootstrap = False

    @property
    def address(self) -> str:
        """`127.0.0.1:PORT` of the client port."""
        return f"{LOOPBACK}:{self.port}"

    def start(self, *, bootstrap: bool = False) -> None:
        """Start the node: with `bootstrap`, a new cluster from a freshly installed datadir;
        otherwise it joins its peers (an empty datadir is filled by SST)."""
        if self.running:
            raise ServerError(f"{self._kind} {self.name} is already running")
        self._bootstrap = bootstrap
        try:
            if bootstrap:
                super().start()  # installs the datadir first if it is empty
            else:
                self.datadir.mkdir(parents=True, exist_ok=True)
                _ServerProcess.start(self)
        finally:
            self._bootstrap = False

    def status(self, name: str) -> str | None:
        """`SHOW GLOBAL STATUS` value `name` (e.g. `wsrep_cluster_size`), None if absent."""
        conn = self.admin_connection(connect_timeout=2, read_timeout=5, write_timeout=5)
        try:
            with conn.cursor() as cur:
                cur.execute("SHOW GLOBAL STATUS LIKE %s", (name,))
                row = cur.fetchone()
        finally:
            conn.close()
        return None if row is None else str(row[1])

    def synced(self, size: int) -> bool:
        """True when this node answers, is Synced, and sees a primary component of `size`."""
        if not self.running:
            return False
        try:
            return (
                self.status("wsrep_local_state_comment") == "Synced"
                and self.status("wsrep_cluster_status") == "Primary"
                and self.status("wsrep_cluster_size") == str(size)
                and self.status("wsrep_ready") == "ON"
            )
        except pymysql.MySQLError:
            return False

    def _basedir(self) -> Path | None:
        if os.geteuid() != 0:
            return None
        basedir = self.workdir / "base"
        wrapper = basedir / "bin" / "rsync"
        if not wrapper.exists():
            wrapper.parent.mkdir(parents=True, exist_ok=True)
            wrapper.write_text(_RSYNC_WRAPPER.format(rsync=_resolve_binary("rsync")))
            wrapper.chmod(0o755)
        return basedir

    def _command(self) -> list[str]:
        cluster = ",".join(f"{LOOPBACK}:{p.wsrep_port}" for p in self.peers)
        options = [
            f"gmcast.listen_addr=tcp://{LOOPBACK}:{self.wsrep_port}",
            f"ist.recv_addr={LOOPBACK}:{self.ist_port}",
            *_PROVIDER_OPTIONS,
        ]
        basedir = self._basedir()
        wsrep = [
            "--wsrep-on=ON",
            f"--wsrep-provider={self.provider}",
            f"--wsrep-cluster-name={CLUSTER_NAME}",
            f"--wsrep-cluster-address=gcomm://{cluster}",
            f"--wsrep-node-name={self.name}",
            f"--wsrep-node-address={LOOPBACK}:{self.wsrep_port}",
            f"--wsrep-node-incoming-address={LOOPBACK}:{self.port}",
            f"--wsrep-provider-options={';'.join(options)}",
            "--wsrep-sst-method=rsync",
            f"--wsrep-sst-receive-address={LOOPBACK}:{self.sst_port}",
            # What Galera requires of the server.
            "--binlog-format=ROW",
            "--default-storage-engine=InnoDB",
            "--innodb-autoinc-lock-mode=2",
            *([f"--basedir={basedir}"] if basedir is not None else []),
            *(["--wsrep-new-cluster"] if self._bootstrap else []),
        ]
        cmd = super()._command()
        # Before the caller's args, which stay last so they can override these.
        cut = len(cmd) - len(self._args)
        return [*cmd[:cut], *wsrep, *cmd[cut:]]


class LocalGalera:
    """A MariaDB Galera cluster of `nodes` nodes on loopback, root without password on each."""

    def __init__(
        self,
        workdir: Path,
        *,
        nodes: int = 3,
        binary: str = "mariadbd",
        install_binary: str = "mariadb-install-db",
        provider: str = PROVIDER,
        args: Sequence[str] = (),
    ) -> None:
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        self.workdir = Path(workdir)
        self.nodes: list[GaleraNode] = []
        for i in range(1, nodes + 1):
            node_dir = self.workdir / f"node-{i}"
            node_dir.mkdir(parents=True, exist_ok=True)
            self.nodes.append(
                GaleraNode(
                    node_dir,
                    name=f"node{i}",
                    provider=provider,
                    binary=binary,
                    install_binary=install_binary,
                    args=args,
                )
            )
        for node in self.nodes:
            node.peers = self.nodes

    # --- life cycle ---------------------------------------------------------------------------
    def start(self, timeout_s: float = 120.0) -> None:
        """Bootstrap the first node, join the others one by one (each by SST from a synced
        peer), then wait until every node is Synced in one primary component."""
        _resolve_binary("rsync")  # the joiners' SST needs it: fail here, not in a node's log
        first, *others = self.nodes
        try:
            first.start(bootstrap=True)
            for node in others:
                node.start()
            self.wait_synced(timeout_s)
        except BaseException:
            self.kill()
            raise

    def stop(self) -> None:
        """Stop every node, joiners first (idempotent)."""
        for node in reversed(self.nodes):
            with contextlib.suppress(ServerError):
                node.stop()

    def kill(self) -> None:
        """SIGKILL every node (idempotent)."""
        for node in self.nodes:
            node.kill()

    def heal(self, timeout_s: float = 120.0) -> None:
        """Start every node that is down (it rejoins, by IST when a peer's cache still holds what
        it missed) and wait until all are Synced. One node at least must still be running."""
        if not self.running:
            raise ServerError("no galera node is running: nothing to rejoin")
        for node in self.nodes:
            node.resume()
            if not node.running:
                node.start()
        self.wait_synced(timeout_s)

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

    # --- what it looks like -------------------------------------------------------------------
    @property
    def running(self) -> list[GaleraNode]:
        """The nodes whose process is alive."""
        return [n for n in self.nodes if n.running]

    def synced(self) -> bool:
        """True when every running node is Synced in one primary component of all of them."""
        running = self.running
        return bool(running) and all(n.synced(len(running)) for n in running)

    def wait_synced(self, timeout_s: float = 60.0) -> None:
        """Wait until `synced()`; the failure names each node's state and log tail."""
        try:
            wait_until(self.synced, timeout_s, interval_s=0.1)
        except AssertionError:
            raise ServerError(
                f"galera cluster not synced in {timeout_s:g}s\n{self._describe()}"
            ) from None

    def _describe(self) -> str:
        parts = []
        for node in self.nodes:
            state = "down"
            if node.running:
                try:
                    state = str(node.status("wsrep_local_state_comment"))
                except pymysql.MySQLError as exc:
                    state = f"not answering ({exc})"
            parts.append(f"--- {node.name} {node.address}: {state} ---\n{node.log_tail(15)}")
        return "\n".join(parts)

    # --- using it -----------------------------------------------------------------------------
    def any_node(self) -> GaleraNode:
        """A running node (the first)."""
        for node in self.nodes:
            if node.running:
                return node
        raise ServerError("no galera node is running")

    def admin_connection(self, **kwargs: Any) -> pymysql.connections.Connection:
        """An autocommit root connection to a running node; the caller closes it."""
        return self.any_node().admin_connection(**kwargs)

    def execute(self, sql: str, args: Sequence[Any] = ()) -> None:
        """Run one statement on a running node (DDL and users replicate to every node)."""
        conn = self.admin_connection()
        try:
            with conn.cursor() as cur:
                cur.execute(sql, tuple(args) or None)
        finally:
            conn.close()

    def create_database(self, name: str) -> None:
        """Create database `name` (utf8mb4) on the cluster."""
        self.execute(f"CREATE DATABASE `{_check_db_name(name)}` CHARACTER SET utf8mb4")

    def drop_database(self, name: str) -> None:
        """Drop database `name` if it exists."""
        self.any_node().drop_database(name)

    def create_check_user(self, user: str) -> None:
        """A password-less user from 127.0.0.1 with no privileges: what a proxy's MySQL health
        check logs in as."""
        _check_db_name(user)
        self.execute(f"CREATE USER IF NOT EXISTS '{user}'@'{LOOPBACK}'")
