"""PostgreSQL as teams run it highly available: a primary and a streaming standby managed by
Patroni, a three-member etcd as Patroni's store, HAProxy routing to whichever node Patroni's REST
API calls the primary.

Every process is a child on free loopback ports with its files in the caller's work directory,
as the other servers here. When we are root, Patroni (and the PostgreSQL it starts) runs as the
PostgreSQL server account, as `PostgresServer` does. Timings are short so that faults resolve in
seconds: a leader key of `TTL_S`, Patroni's loop every `LOOP_WAIT_S`.

Faults, each returning a one-line account of what happened:
- `kill_primary`: the primary's Patroni and PostgreSQL killed -9 (a machine lost); its leader
  key expires and the standby is promoted; the node is started again and rejoins as a standby
  (`pg_rewind`).
- `switchover`: a planned switchover through the REST API (the primary demoted cleanly).
- `etcd_leader_lost`: the etcd leader killed -9, the others elect a new one, it rejoins.

Long because it is one topology: etcd's members, Patroni's nodes and the cluster that starts,
waits on and breaks them share the REST helpers and the timings; apart, each file would only
be imported by the next.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from keyexpiry.bench.servers.haproxy import HAProxy
from keyexpiry.bench.servers.postgres import SUPERUSER, as_owner, find_bindir, server_user
from keyexpiry.bench.servers.process import (
    LOOPBACK,
    NETNS_SUBNET,
    ServerError,
    _ServerProcess,
    free_port,
    wait_until,
)
from keyexpiry.clock import monotonic_s

TTL_S = 10
"""Patroni's leader key lifetime: a lost primary's standby is promoted this long after."""
LOOP_WAIT_S = 1
RETRY_TIMEOUT_S = 4
"""Patroni demotes a primary that cannot reach etcd for this long (ttl >= loop + 2 * retry)."""
SCOPE = "soak"


def _http(url: str, body: dict[str, Any] | None = None, timeout_s: float = 2.0) -> Any:
    """GET (or POST `body` as JSON) and the decoded JSON answer; HTTP errors carry it too."""
    return _request(url, body, timeout_s)[1]


def _request(url: str, body: dict[str, Any] | None, timeout_s: float) -> tuple[int, Any]:
    """(HTTP status, the answer decoded from JSON when it is JSON)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            status, text = answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:  # Patroni answers 503 with the same JSON
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


class EtcdMember(_ServerProcess):
    """One `etcd` member of a static three-member cluster."""

    _kind = "etcd"
    _start_timeout_s = 30.0
    _stop_timeout_s = 10.0

    def __init__(self, workdir: Path, name: str, peer_port: int) -> None:
        super().__init__(workdir, None, ())
        self.name = name
        self.peer_port = peer_port
        self.initial_cluster = ""  # set by Etcd before the first start

    @property
    def log_path(self) -> Path:
        """etcd logs to stderr."""
        return self._stderr_path

    @property
    def client_url(self) -> str:
        """`http://127.0.0.1:PORT` of its client API."""
        return f"http://{LOOPBACK}:{self._port}"

    def _command(self) -> list[str]:
        binary = shutil.which("etcd")
        if binary is None:
            raise FileNotFoundError("etcd not found (Debian: apt-get install etcd-server)")
        peer = f"http://{LOOPBACK}:{self.peer_port}"
        return [
            binary,
            f"--name={self.name}",
            f"--data-dir={self.workdir / 'data'}",
            f"--listen-client-urls={self.client_url}",
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={self.initial_cluster}",
            "--initial-cluster-state=new",
            f"--initial-cluster-token={SCOPE}",
            # Loopback: a leader lost is noticed in a second, not the default's five.
            "--heartbeat-interval=100",
            "--election-timeout=1000",
            "--log-level=warn",
        ]

    def _ping(self) -> bool:
        # The client port listens as soon as the member runs but answers only once the
        # cluster has a leader, which a first member alone never has: ready is
        # `Etcd.wait_healthy`'s question.
        try:
            socket.create_connection((LOOPBACK, self._port), timeout=0.5).close()
        except OSError:
            return False
        return True

    def is_leader(self) -> bool:
        """Whether this member is the etcd leader now."""
        status = _http(f"{self.client_url}/v3/maintenance/status", {}, timeout_s=1.0)
        return bool(status.get("leader")) and status.get("leader") == status.get("header", {}).get(
            "member_id"
        )


class Etcd:
    """Three etcd members on loopback."""

    def __init__(self, workdir: Path, members: int = 3) -> None:
        self.members = [
            EtcdMember(workdir / f"etcd{i}", f"etcd{i}", free_port()) for i in range(members)
        ]
        cluster = ",".join(f"{m.name}=http://{LOOPBACK}:{m.peer_port}" for m in self.members)
        for m in self.members:
            m.initial_cluster = cluster

    @property
    def hosts(self) -> str:
        """`127.0.0.1:P1,127.0.0.1:P2,…`: the client endpoints, for Patroni's `etcd3.hosts`."""
        return ",".join(f"{LOOPBACK}:{m.port}" for m in self.members)

    def start(self) -> None:
        """Start every member, then wait until they agree on a leader."""
        for m in self.members:
            m.start()
        self.wait_healthy()

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Until a leader is elected and every running member answers `/health` true."""

        def healthy() -> bool:
            try:
                return all(
                    _http(f"{m.client_url}/health", timeout_s=1.0).get("health") == "true"
                    for m in self.members
                    if m.running
                )
            except (OSError, AttributeError):
                return False

        wait_until(healthy, timeout_s, interval_s=0.1, message="etcd has no leader")

    def leader(self) -> EtcdMember:
        """The member that leads now."""
        found = self.leader_or_none()
        if found is None:
            raise ServerError("no etcd member says it leads")
        return found

    def leader_or_none(self) -> EtcdMember | None:
        """The member that leads now, or None while they elect one."""
        for m in self.members:
            try:
                if m.running and m.is_leader():
                    return m
            except (OSError, AttributeError):
                continue
        return None

    def stop(self) -> None:
        """Stop every member."""
        for m in self.members:
            m.stop()


class PatroniNode(_ServerProcess):
    """One Patroni process and the PostgreSQL it runs; `port` is its REST API's."""

    _kind = "patroni"
    _start_timeout_s = 60.0
    _stop_timeout_s = 60.0

    def __init__(
        self, workdir: Path, name: str, etcd: Etcd, *, synchronous: bool, bindir: Path | None
    ) -> None:
        super().__init__(workdir, None, ())
        found = bindir or find_bindir()
        if found is None:
            raise FileNotFoundError("PostgreSQL server binaries not found")
        self.bindir = found
        self.name = name
        self.etcd = etcd
        self.synchronous = synchronous
        self.pg_port = free_port()
        self._owner = server_user()
        # Short and private, owned by the server account: the data directory and the socket.
        self.private_dir = Path(tempfile.mkdtemp(prefix="kx-pat-"))
        if self._owner is not None:
            os.chown(self.private_dir, self._owner.pw_uid, self._owner.pw_gid)
        self.config_path = self.private_dir / "patroni.yml"

    @property
    def log_path(self) -> Path:
        """Patroni's log and PostgreSQL's (which it forwards) on stderr."""
        return self._stderr_path

    @property
    def _cwd(self) -> Path | None:
        # initdb and pg_ctl, run by Patroni as the server account, go back to the directory
        # they started in: ours was refused in CI's fresh clone ("could not change directory").
        return self.private_dir

    @property
    def rest_url(self) -> str:
        """`http://127.0.0.1:PORT` of its REST API."""
        return f"http://{LOOPBACK}:{self._port}"

    def config(self) -> dict[str, Any]:
        """Patroni's configuration for this node."""
        rest = f"{LOOPBACK}:{self._port}"
        pg = f"{LOOPBACK}:{self.pg_port}"
        # The second network: a listener in a test's network namespace (`servers.netns`).
        trust = [
            "local all all trust",
            "host all all 127.0.0.1/32 trust",
            f"host all all {NETNS_SUBNET} trust",
        ]
        return {
            "scope": SCOPE,
            "name": self.name,
            "restapi": {"listen": rest, "connect_address": rest},
            "etcd3": {"hosts": self.etcd.hosts},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL_S,
                    "loop_wait": LOOP_WAIT_S,
                    "retry_timeout": RETRY_TIMEOUT_S,
                    "maximum_lag_on_failover": 16 * 1024 * 1024,
                    "synchronous_mode": self.synchronous,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "parameters": {"wal_log_hints": "on", "max_connections": 200},
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}],
                "pg_hba": [*trust, "host replication all 127.0.0.1/32 trust"],
            },
            "postgresql": {
                "listen": pg,
                "connect_address": pg,
                "data_dir": str(self.private_dir / "data"),
                "bin_dir": str(self.bindir),
                "pgpass": str(self.private_dir / "pgpass"),
                "authentication": {
                    "superuser": {"username": SUPERUSER, "password": "soak"},
                    "replication": {"username": "replicator", "password": "soak"},
                    "rewind": {"username": SUPERUSER, "password": "soak"},
                },
                "parameters": {
                    "unix_socket_directories": str(self.private_dir),
                    "fsync": "off",  # a test server: speed over a host crash's durability
                    # Each autovacuum and autoanalyze in the log, as PostgresServer's: what the
                    # server did in a slow stretch (the Patroni hour's first minute, 2026-12-06).
                    "log_autovacuum_min_duration": 0,
                },
                "pg_hba": [*trust, "host replication all 127.0.0.1/32 trust"],
            },
        }

    def _command(self) -> list[str]:
        binary = shutil.which("patroni")
        if binary is None:
            raise FileNotFoundError("patroni not found (Debian: apt-get install patroni)")
        self.config_path.write_text(json.dumps(self.config(), indent=1))  # JSON is YAML
        if self._owner is not None:
            os.chown(self.config_path, self._owner.pw_uid, self._owner.pw_gid)
        return as_owner(self._owner, [binary, str(self.config_path)], death_signal=True)

    def _ping(self) -> bool:
        try:
            _http(f"{self.rest_url}/patroni", timeout_s=0.5)
        except OSError:
            return False
        return True

    def state(self) -> dict[str, Any]:
        """Patroni's `/patroni` answer: `role` (`master`/`primary`, `replica`), `state`…"""
        try:
            got = _http(f"{self.rest_url}/patroni", timeout_s=1.0)
        except OSError:
            return {}
        return got if isinstance(got, dict) else {}

    def is_primary(self) -> bool:
        """Whether it runs a PostgreSQL that takes writes."""
        s = self.state()
        return s.get("role") in ("master", "primary") and s.get("state") == "running"

    def is_streaming_replica(self) -> bool:
        """Whether it runs a standby that streams from the primary."""
        s = self.state()
        return s.get("role") == "replica" and s.get("state") == "running"

    def _graceful_stop(self, proc: Any) -> None:
        proc.send_signal(signal.SIGTERM)  # Patroni stops PostgreSQL, then exits

    def kill(self) -> None:
        """SIGKILL Patroni and the PostgreSQL it runs (a machine lost)."""
        if self._proc is not None and self._proc.poll() is None:
            with _suppress_gone():
                children = psutil.Process(self._proc.pid).children(recursive=True)
                for child in children:
                    with _suppress_gone():
                        child.kill()
        super().kill()
        # The postmaster's backends outlive it for a moment; the next start must not find them.
        for proc in psutil.process_iter(["cmdline"]):
            with _suppress_gone():
                if str(self.private_dir) in " ".join(proc.info["cmdline"] or ()):
                    proc.kill()


def _suppress_gone() -> contextlib.suppress:
    return contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied)


class PatroniCluster:
    """etcd, two Patroni nodes and HAProxy; `synchronous` runs Patroni's synchronous mode."""

    def __init__(self, workdir: Path, *, synchronous: bool = False, nodes: int = 2) -> None:
        self.workdir = Path(workdir)
        self.synchronous = synchronous
        self.etcd = Etcd(self.workdir / "etcd")
        bindir = find_bindir()
        self.nodes = [
            PatroniNode(
                self.workdir / f"pg{i}", f"pg{i}", self.etcd, synchronous=synchronous, bindir=bindir
            )
            for i in range(nodes)
        ]
        self.proxy = HAProxy(
            self.workdir / "haproxy",
            servers=[(n.name, n.pg_port) for n in self.nodes],
            check="patroni",
            check_ports=[n.port for n in self.nodes],
        )

    # -- life ----------------------------------------------------------------------------

    def start(self) -> None:
        """etcd, the first node (it bootstraps, becomes primary), the others (standbys), and
        HAProxy once it holds the primary up."""
        self.etcd.start()
        first, *rest = self.nodes
        first.start()
        wait_until(first.is_primary, 60, interval_s=0.2, message="patroni: no primary")
        for node in rest:
            node.start()
        self.wait_replicas()
        self.proxy.start()
        self.proxy.wait_up([self.primary().name], timeout_s=20)

    def wait_replicas(self, timeout_s: float = 90.0) -> None:
        """Until every node but the primary streams from it (synchronously when so configured),
        as the primary's `pg_stat_replication` says. Patroni calls a rejoined standby `running`
        before it streams (still replaying after `pg_rewind`), and a switchover onto one that
        does not stream yet, under asynchronous replication, loses what the old primary wrote
        since the failover: a soak saw 2,000 tasks go that way."""
        import psycopg

        query = "SELECT state, sync_state FROM pg_stat_replication"

        def ready() -> bool:
            try:
                node = self.primary()
                with psycopg.connect(
                    host=LOOPBACK,
                    port=node.pg_port,
                    user=SUPERUSER,
                    dbname="postgres",
                    autocommit=True,
                    connect_timeout=2,
                ) as conn:
                    rows = conn.execute(query).fetchall()
                streaming = [sync for state, sync in rows if state == "streaming"]
                if len(streaming) < len(self.nodes) - 1:
                    return False
                if not self.synchronous:
                    return True
                # Patroni's own view too: it names the synchronous standby a moment later.
                members = _http(f"{node.rest_url}/cluster", timeout_s=1.0).get("members", [])
                return "sync" in streaming and any(m.get("role") == "sync_standby" for m in members)
            except (ServerError, psycopg.Error, OSError, AttributeError):
                return False

        wait_until(ready, timeout_s, interval_s=0.2, message="patroni: standbys not streaming")

    def stop(self) -> None:
        """HAProxy, the nodes (their data directories removed), etcd."""
        self.proxy.stop()
        for node in self.nodes:
            node.stop()
            shutil.rmtree(node.private_dir, ignore_errors=True)
        self.etcd.stop()

    # -- where to connect ------------------------------------------------------------------

    def url(self, db: str) -> str:
        """SQLAlchemy URL naming every node, libpq choosing the one that takes writes."""
        hosts = "&".join(f"host={LOOPBACK}:{n.pg_port}" for n in self.nodes)
        return (
            f"postgresql+psycopg://{SUPERUSER}@/{db}?{hosts}"
            "&target_session_attrs=read-write&connect_timeout=2"
        )

    def proxy_url(self, db: str) -> str:
        """SQLAlchemy URL through HAProxy (which routes to Patroni's primary)."""
        return (
            f"postgresql+psycopg://{SUPERUSER}@{LOOPBACK}:{self.proxy.port}/{db}?connect_timeout=2"
        )

    @property
    def ports(self) -> set[int]:
        """Every port a ledger connection can go to (the nodes' and HAProxy's)."""
        return {self.proxy.port, *(n.pg_port for n in self.nodes)}

    def primary(self) -> PatroniNode:
        """The node whose PostgreSQL takes writes now."""
        for node in self.nodes:
            if node.running and node.is_primary():
                return node
        raise ServerError("no Patroni node is primary")

    def create_database(self, name: str) -> str:
        """Create database `name` on the primary; its multi-host URL."""
        import psycopg

        node = self.primary()
        with psycopg.connect(
            host=LOOPBACK, port=node.pg_port, user=SUPERUSER, dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    # -- faults ----------------------------------------------------------------------------

    def _wait_primary(self, other_than: PatroniNode | None, timeout_s: float) -> PatroniNode:
        found: list[PatroniNode] = []

        def promoted() -> bool:
            for node in self.nodes:
                if node is not other_than and node.running and node.is_primary():
                    found.append(node)
                    return True
            return False

        wait_until(promoted, timeout_s, interval_s=0.1, message="patroni: no new primary")
        return found[0]

    def kill_primary(self) -> str:
        """Kill -9 the primary's Patroni and PostgreSQL; wait for the standby's promotion;
        start the node again (it rejoins as a standby)."""
        old = self.primary()
        old.kill()
        new = self._wait_primary(old, TTL_S * 3)
        old.start()
        self.wait_replicas()
        return f"primary {old.name} killed -9, {new.name} promoted, {old.name} rejoined"

    def switchover(self) -> str:
        """A planned switchover to the standby, asked again while Patroni refuses it (a standby
        that just rejoined is synchronous in PostgreSQL's view a moment before it is in
        Patroni's, which refuses a candidate that is not: CI saw that)."""
        old = self.primary()
        candidate = next(n for n in self.nodes if n is not old)
        deadline_s = monotonic_s() + 60
        while True:
            status, answer = _request(
                f"{old.rest_url}/switchover",
                {"leader": old.name, "candidate": candidate.name},
                timeout_s=30,
            )
            if status == 200:
                break
            if monotonic_s() > deadline_s:
                raise ServerError(f"patroni refused the switchover: {status} {answer}")
            time.sleep(0.5)
        new = self._wait_primary(old, TTL_S * 3)
        self.wait_replicas()
        return f"switchover {old.name} -> {new.name} ({str(answer)[:80]})"

    def etcd_leader_lost(self) -> str:
        """Kill -9 the etcd leader; wait for a new one; start the member again."""
        old = self.etcd.leader()
        old.kill()
        wait_until(
            lambda: self.etcd.leader_or_none() not in (None, old),
            30,
            interval_s=0.1,
            message="etcd: no new leader",
        )
        new = self.etcd.leader()
        old.start()
        self.etcd.wait_healthy()
        return f"etcd leader {old.name} killed -9, {new.name} elected, {old.name} rejoined"
