"""A `mariadbd` child process with its own datadir, on a free loopback port."""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pymysql

from keyexpiry.bench.servers.process import (
    LOOPBACK,
    NETNS_HOSTS,
    ServerError,
    _log_tail,
    _resolve_binary,
    _ServerProcess,
)


def _current_user() -> str:
    return pwd.getpwuid(os.geteuid()).pw_name


# sockaddr_un.sun_path is 108 bytes on Linux (104 on macOS); leave some slack.
_MAX_SOCKET_PATH = 100


class MariaDBServer(_ServerProcess):
    """A ``mariadbd`` child process with its own datadir, reachable as root over TCP.

    The datadir is initialised on first start with ``mariadb-install-db`` and kept
    across stop/kill/restart, so data committed before a crash is still there.
    ``innodb_flush_log_at_trx_commit=2`` writes the redo log to the OS on every
    commit, so committed transactions survive ``kill()`` (a process crash), just not
    a machine crash, which tests do not simulate.

    Extra ``args`` are appended after the defaults and override them, e.g.
    ``args=["--innodb-lock-wait-timeout=2"]``.
    """

    _kind = "mariadb"
    _start_timeout_s = 60.0
    _stop_timeout_s = 60.0

    def __init__(
        self,
        workdir: Path,
        *,
        port: int | None = None,
        args: Sequence[str] = (),
        binary: str = "mariadbd",
        install_binary: str = "mariadb-install-db",
    ) -> None:
        super().__init__(workdir, port, args)
        self.binary = binary
        self.install_binary = install_binary
        self.datadir = self.workdir / "data"
        self.socket_path = self.workdir / "mysqld.sock"
        if len(str(self.socket_path)) > _MAX_SOCKET_PATH:
            # mariadbd refuses socket paths that do not fit in sockaddr_un; tests only
            # use TCP, so any short private directory will do.
            short_dir = Path(tempfile.mkdtemp(prefix="kx-mysql-"))
            atexit.register(shutil.rmtree, short_dir, True)
            self.socket_path = short_dir / "mysqld.sock"

    @property
    def log_path(self) -> Path:
        """MariaDB error log (``--log-error``), appended to across restarts."""
        return self.workdir / "mariadb.err"

    def url(self, db: str) -> str:
        """SQLAlchemy URL ``mysql+pymysql://root@127.0.0.1:PORT/db``."""
        return f"mysql+pymysql://root@{LOOPBACK}:{self._port}/{db}"

    def admin_connection(self, **kwargs: Any) -> pymysql.connections.Connection:
        """A new autocommit PyMySQL connection as root (no database selected).

        ``kwargs`` override the defaults (e.g. ``database=``, ``read_timeout=``).
        The caller must ``close()`` it.
        """
        params: dict[str, Any] = {
            "host": LOOPBACK,
            "port": self._port,
            "user": "root",
            "password": "",
            "autocommit": True,
            "connect_timeout": 5,
            # The server has no TLS; PyMySQL's default (TLS if offered) would still build an SSL
            # context on every connect, reading the system's CA bundle: 20-70 ms of CPU.
            "ssl_disabled": True,
        }
        params.update(kwargs)
        return pymysql.connect(**params)

    def create_database(self, name: str) -> str:
        """Create database ``name`` (utf8mb4) and return its SQLAlchemy URL."""
        self._execute(f"CREATE DATABASE `{_check_db_name(name)}` CHARACTER SET utf8mb4")
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """Drop database ``name`` if it exists, killing sessions that still use it.

        A test that leaked a connection with an open transaction would otherwise make
        DROP DATABASE wait on its metadata lock for ``lock_wait_timeout`` (a day by
        default) and the whole run would hang until pytest-timeout fires.
        """
        _check_db_name(name)
        conn = self.admin_connection()
        try:
            with conn.cursor() as cur:
                _kill_sessions(cur, name)
                cur.execute("SET SESSION lock_wait_timeout = 10")
                cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
        finally:
            conn.close()

    def end_sessions(self, name: str) -> None:
        """Kill the sessions that use database ``name`` (its transactions roll back)."""
        _check_db_name(name)
        conn = self.admin_connection()
        try:
            with conn.cursor() as cur:
                _kill_sessions(cur, name)
        finally:
            conn.close()

    def start(self) -> None:
        """Initialise the datadir if needed, start mariadbd and wait for a root login."""
        if self.running:
            raise ServerError(f"{self._kind} on port {self._port} is already running")
        fresh = not self.datadir.is_dir() or not any(self.datadir.iterdir())
        if fresh:
            self._install()
        super().start()
        if fresh:
            # A listener in a test's network namespace (`servers.netns`) connects from its
            # side of the veth pair, not from 127.0.0.1.
            self._execute(f"CREATE USER IF NOT EXISTS root@'{NETNS_HOSTS}'")
            self._execute(f"GRANT ALL ON *.* TO root@'{NETNS_HOSTS}' WITH GRANT OPTION")

    def _execute(self, sql: str) -> None:
        conn = self.admin_connection()
        try:
            with conn.cursor() as cur:
                cur.execute(sql)
        finally:
            conn.close()

    def _install(self) -> None:
        log = self.workdir / "install.log"
        cmd = [
            _resolve_binary(self.install_binary),
            "--no-defaults",
            # Root gets a normal (empty) password on every loopback account, so the
            # tests can log in over TCP; the default unix_socket auth would only
            # work through the socket.
            "--auth-root-authentication-method=normal",
            f"--datadir={self.datadir}",
            f"--user={_current_user()}",
            "--skip-test-db",
            # Unknown options are passed on to the bootstrap mariadbd: create the
            # redo log at its final (small) size instead of 96 MiB.
            *self._innodb_args(),
            # A private tmpdir: two servers bootstrapping at once in /tmp have been seen to
            # delete each other's temporary tables ("Error on delete of '/tmp/#sql-temptable…'").
            f"--tmpdir={self._tmpdir()}",
        ]
        with log.open("wb") as out:
            result = subprocess.run(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, check=False
            )
        if result.returncode != 0:
            # A half-initialised datadir would make the next start() skip the install.
            shutil.rmtree(self.datadir, ignore_errors=True)
            raise ServerError(
                f"{shlex.join(cmd)} failed with code {result.returncode}\n"
                f"--- {log} ---\n{_log_tail(log)}"
            )

    def _tmpdir(self) -> Path:
        path = self.workdir / "tmp"
        path.mkdir(parents=True, exist_ok=True)
        return path

    @staticmethod
    def _innodb_args() -> list[str]:
        return [
            "--innodb-buffer-pool-size=64M",
            "--innodb-log-file-size=16M",
        ]

    def _command(self) -> list[str]:
        cmd = [
            _resolve_binary(self.binary),
            "--no-defaults",  # must come first: ignore /etc/mysql/*.cnf
            f"--datadir={self.datadir}",
            f"--socket={self.socket_path}",
            f"--port={self._port}",
            f"--bind-address={LOOPBACK}",
            # mariadbd refuses to run as root unless told to explicitly.
            f"--user={_current_user()}",
            "--skip-name-resolve",
            *self._innodb_args(),
            f"--tmpdir={self._tmpdir()}",
            "--innodb-flush-log-at-trx-commit=2",
            "--skip-log-bin",
            f"--pid-file={self.workdir / 'mysqld.pid'}",
            f"--log-error={self.log_path}",
            "--character-set-server=utf8mb4",
            # Faster start and stop: do not dump/load the buffer pool page list.
            "--innodb-buffer-pool-dump-at-shutdown=OFF",
            "--innodb-buffer-pool-load-at-startup=OFF",
        ]
        if self._started_once:
            # On restart the old listening socket may linger for a moment; wait for
            # the port instead of failing (mariadbd's own retry, not a sleep here).
            cmd.append("--port-open-timeout=10")
        cmd.extend(self._args)
        return cmd

    def _ping(self) -> bool:
        try:
            conn = self.admin_connection(connect_timeout=1, read_timeout=2, write_timeout=2)
        except pymysql.MySQLError:
            return False
        try:
            # Ours, not another server that took the port while ours restarted.
            with conn.cursor() as cur:
                cur.execute("SELECT @@datadir")
                row = cur.fetchone()
        except pymysql.MySQLError:
            return False
        finally:
            conn.close()
        return row is not None and Path(str(row[0])).resolve() == self.datadir.resolve()


def _kill_sessions(cur: Any, name: str) -> None:
    cur.execute(
        "SELECT id FROM information_schema.PROCESSLIST WHERE db = %s AND id <> CONNECTION_ID()",
        (name,),
    )
    for (session_id,) in cur.fetchall():
        # The session may end between SELECT and KILL (1094: unknown thread).
        with contextlib.suppress(pymysql.MySQLError):
            cur.execute(f"KILL {int(session_id)}")


_DB_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")


def _check_db_name(name: str) -> str:
    """Reject names that would need quoting: they are interpolated into SQL."""
    if not _DB_NAME.fullmatch(name):
        raise ValueError(f"invalid database name {name!r} (use [A-Za-z0-9_], max 64)")
    return name


def lock_waits(conn: pymysql.connections.Connection) -> int:
    """Transactions of a MariaDB server waiting for a row lock, seen from `conn`.

    InnoDB refreshes this view only when nobody read it for 100 ms: poll it slowly.
    """
    with conn.cursor() as cur:
        cur.execute(
            "SELECT COUNT(*) FROM information_schema.INNODB_TRX WHERE trx_state = %s",
            ("LOCK WAIT",),
        )
        row = cur.fetchone()
        return int(row[0]) if row else 0
