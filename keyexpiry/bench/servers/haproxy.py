"""An `haproxy` child process in front of MySQL servers: one takes the connections, the others
are backups, as a Galera cluster is usually fronted (a single writer, no certification
conflicts between nodes). With `check="redis-master"` it fronts Redis servers instead and sends
connections to whichever answers `role:master` (the usual HAProxy set-up before a Sentinel group,
for clients that do not speak Sentinel).

The configuration is generated in the caller's work dir: TCP mode on a free loopback port,
`option mysql-check` logging in as a password-less user (a plain TCP check would count as an
aborted connection on the server, and enough of them block the client host), a check every
`inter_ms` with `fall` failures to mark a server down and `rise` successes to mark it up.
Sessions on a server marked down are cut, and sessions on backups are cut when the primary
comes back, so clients never write to two nodes for long. With `check="patroni"` it fronts
PostgreSQL nodes managed by Patroni, checking each one's REST API (`check_ports`): only the
primary answers `GET /primary` with 200. A stats socket on another free
loopback port tells which servers HAProxy holds up (`states()`).
"""

from __future__ import annotations

import csv
import io
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from keyexpiry.bench.servers.process import (
    LOOPBACK,
    _resolve_binary,
    _ServerProcess,
    free_port,
    wait_until,
)

BACKEND = "ledger"
"""The name of the proxied backend in HAProxy's stats."""


class HAProxy(_ServerProcess):
    """`haproxy -db` in front of `servers` (`(name, port)` on 127.0.0.1; the first takes the
    connections, the rest are `backup`)."""

    _kind = "haproxy"
    _start_timeout_s = 10.0
    _stop_timeout_s = 10.0

    def __init__(
        self,
        workdir: Path,
        *,
        servers: Sequence[tuple[str, int]],
        check_user: str = "",
        check: Literal["mysql", "redis-master", "patroni"] = "mysql",
        check_ports: Sequence[int] = (),
        inter_ms: int = 300,
        fall: int = 2,
        rise: int = 1,
        binary: str = "haproxy",
    ) -> None:
        super().__init__(workdir, None, ())
        if not servers:
            raise ValueError("haproxy needs at least one server")
        self.servers = list(servers)
        self.check_user = check_user
        self.check = check
        self.check_ports = list(check_ports)
        if check == "patroni" and len(self.check_ports) != len(self.servers):
            raise ValueError("check='patroni' needs each server's REST API port")
        self.inter_ms = inter_ms
        self.fall = fall
        self.rise = rise
        self.binary = binary
        self.stats_port = free_port()
        self.config_path = self.workdir / "haproxy.cfg"

    @property
    def log_path(self) -> Path:
        """HAProxy logs to stderr in the foreground (`log stderr`): health changes, sessions."""
        return self._stderr_path

    def url(self, db: str) -> str:
        """SQLAlchemy URL `mysql+pymysql://root@127.0.0.1:PORT/db` through the proxy."""
        return f"mysql+pymysql://root@{LOOPBACK}:{self._port}/{db}"

    def redis_url(self, db: int = 0) -> str:
        """`redis://127.0.0.1:PORT/db` through the proxy (with `check="redis-master"`)."""
        return f"redis://{LOOPBACK}:{self._port}/{db}"

    def config(self) -> str:
        """The generated `haproxy.cfg`."""
        lines = [
            "global",
            "    log stderr format raw local0 info",
            f"    stats socket ipv4@{LOOPBACK}:{self.stats_port} level admin",
            "    maxconn 2000",
            "",
            "defaults",
            "    mode tcp",
            "    log global",
            "    option dontlognull",
            "    timeout connect 1s",
            # Pooled connections sit idle for long: only the servers' timeouts close them.
            "    timeout client 1h",
            "    timeout server 1h",
            "    retries 2",
            "",
            f"listen {BACKEND}",
            f"    bind {LOOPBACK}:{self._port}",
            *self._check_lines(),
            f"    default-server inter {self.inter_ms} fall {self.fall} rise {self.rise}"
            " on-marked-down shutdown-sessions on-marked-up shutdown-backup-sessions",
        ]
        for i, (name, port) in enumerate(self.servers):
            # Redis, Patroni: only the primary passes the check, so none needs to be a backup.
            backup = " backup" if i and self.check == "mysql" else ""
            check_port = f" port {self.check_ports[i]}" if self.check == "patroni" else ""
            lines.append(f"    server {name} {LOOPBACK}:{port} check{check_port}{backup}")
        return "\n".join(lines) + "\n"

    def _check_lines(self) -> list[str]:
        if self.check == "mysql":
            return [f"    option mysql-check user {self.check_user} post-41"]
        if self.check == "patroni":
            # Patroni's REST API answers 200 on /primary only on the node that holds the
            # leader key and runs a PostgreSQL taking writes.
            return ["    option httpchk GET /primary", "    http-check expect status 200"]
        # A replica answers PING too: only `role:master` in INFO replication passes.
        return [
            "    option tcp-check",
            "    tcp-check connect",
            "    tcp-check send PING\\r\\n",
            "    tcp-check expect string +PONG",
            "    tcp-check send info\\ replication\\r\\n",
            "    tcp-check expect string role:master",
            "    tcp-check send QUIT\\r\\n",
            "    tcp-check expect string +OK",
        ]

    def states(self) -> dict[str, str]:
        """Each server's status as HAProxy holds it (`UP`, `DOWN`, `UP 1/2`…), by name."""
        with socket.create_connection((LOOPBACK, self.stats_port), timeout=2) as sock:
            sock.sendall(b"show stat\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        text = b"".join(chunks).decode().lstrip("# ")
        return {
            row["svname"]: row["status"]
            for row in csv.DictReader(io.StringIO(text))
            if row.get("pxname") == BACKEND and row.get("svname") not in ("FRONTEND", "BACKEND")
        }

    def wait_up(self, names: Sequence[str] | None = None, timeout_s: float = 10.0) -> None:
        """Wait until HAProxy holds `names` (default: every server) `UP`."""
        wanted = [n for n, _ in self.servers] if names is None else list(names)

        def up() -> bool:
            states = self.states()
            return all(states.get(n) == "UP" for n in wanted)

        wait_until(up, timeout_s, interval_s=0.05, message=f"haproxy: {wanted} not all UP")

    def _command(self) -> list[str]:
        self.config_path.write_text(self.config())
        # -db: stay in the foreground; the process is the proxy, so kill() kills it.
        return [_resolve_binary(self.binary), "-db", "-f", str(self.config_path)]

    def _ping(self) -> bool:
        try:
            self.states()
        except OSError:
            return False
        return True
