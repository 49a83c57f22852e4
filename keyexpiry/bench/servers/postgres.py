"""A PostgreSQL `postgres` child process with its own data directory, on a free loopback port.

The data directory is created with `initdb` on first start (trust authentication, superuser
`postgres`, UTF8, locale C) and kept across stop/kill/restart, so data committed before a crash
is still there: a commit writes its WAL to the operating system before it returns
(`synchronous_commit` on), which survives a crash of the server (kill -9), as MariaDBServer's
`innodb_flush_log_at_trx_commit=2` does; it is not synced to disk (`fsync=off`: a crash of the
machine, which tests do not simulate, could lose it), so a commit costs what it costs MariaDB
here and the benchmarks compare the two engines, not two disk policies. A replica is cloned
from a running primary with `pg_basebackup -R -X stream` and runs as a hot standby until
:meth:`PostgresServer.promote`.

PostgreSQL refuses to run as root. When this process is root the server and its tools run as
the `postgres` system user (Debian's `postgresql` package creates it; `nobody` otherwise) through
``setpriv``, which execs the binary, so the child's pid is still the server's. That user cannot
enter pytest's temporary directories (0700, owned by root), so the data directory then lives in
a private directory under the system temp dir that the user owns, removed at exit (or by
:meth:`PostgresServer.destroy`); ``workdir/data`` is a symlink to it. The server log is the
server's stderr, opened by this process, so it stays in ``workdir`` whoever the server runs as.

Long because the server, its standby cloning and the run-as-owner plumbing (`server_user`,
`as_owner`, which Patroni's nodes reuse) are one concern: who runs PostgreSQL, and where.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from keyexpiry.bench.servers.process import (
    LOOPBACK,
    NETNS_SUBNET,
    ServerError,
    _death_signal_prefix,
    _log_tail,
    _ServerProcess,
    wait_until,
)

if TYPE_CHECKING:
    # psycopg is imported where it is used: it comes with the `test` and `postgres` extras,
    # and the benchmark imports this package whatever its backend.
    import psycopg
    from psycopg.rows import TupleRow

#: The superuser `initdb` creates; every connection logs in as it (trust authentication).
SUPERUSER = "postgres"

# Users the server runs as when we are root, in order of preference.
_SERVER_USERS = ("postgres", "nobody")

# Debian and Ubuntu install each major version's binaries here, off PATH.
_DEBIAN_BINDIRS = "/usr/lib/postgresql/*/bin"


def find_bindir() -> Path | None:
    """The directory holding PostgreSQL's server binaries (`postgres`, `initdb`), or None.

    Looks on PATH first, then in Debian's ``/usr/lib/postgresql/<major>/bin`` (newest major
    first), then at ``pg_config --bindir``.
    """
    candidates: list[Path] = []
    on_path = shutil.which("postgres")
    if on_path is not None:
        candidates.append(Path(on_path).resolve().parent)
    debian = sorted(
        Path("/").glob(_DEBIAN_BINDIRS.lstrip("/")),
        key=lambda p: [int(n) for n in re.findall(r"\d+", p.parent.name)],
        reverse=True,
    )
    candidates.extend(debian)
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
            if out:
                candidates.append(Path(out))
    for bindir in candidates:
        if all(os.access(bindir / name, os.X_OK) for name in ("postgres", "initdb")):
            return bindir
    return None


def server_user() -> pwd.struct_passwd | None:
    """The account the server runs as when we are root; None when we are not root."""
    if os.geteuid() != 0:
        return None
    for name in _SERVER_USERS:
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise ServerError(f"running as root and none of the users {_SERVER_USERS} exists")


def as_owner(
    owner: pwd.struct_passwd | None, cmd: list[str], *, death_signal: bool = False
) -> list[str]:
    """``cmd`` run as ``owner`` (from :func:`server_user`; None: as we are), ``setpriv``
    exec'ing it in place."""
    if owner is None:
        return cmd
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise ServerError("running as root needs setpriv (util-linux) to drop privileges")
    # Changing the uid clears PR_SET_PDEATHSIG, so the outer prefix of the base class is lost:
    # ask this setpriv to set it again after the switch.
    pdeathsig = ["--pdeathsig", "KILL"] if death_signal and _death_signal_prefix() else []
    return [
        setpriv,
        f"--reuid={owner.pw_uid}",
        f"--regid={owner.pw_gid}",
        "--init-groups",
        *pdeathsig,
        "--",
        *cmd,
    ]


def _clean_env() -> dict[str, str]:
    """This process's environment without libpq's PG* variables (PGOPTIONS, PGSSLMODE, …)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PG")}


class PostgresServer(_ServerProcess):
    """A ``postgres`` child process with its own data directory, superuser ``postgres`` over TCP
    without a password.

    ``primary``: clone this running server with ``pg_basebackup`` on first start, instead of
    running ``initdb``, and run as its hot standby (see :meth:`replica_of`). ``bindir``: where
    ``postgres``, ``initdb`` and ``pg_basebackup`` are (default :func:`find_bindir`).

    Extra ``args`` are appended after the defaults and override them, e.g.
    ``args=["-c", "statement_timeout=2s"]``.

    :meth:`kill` SIGKILLs the postmaster and every backend it forked (a crash of the whole
    server, so it restarts at once on the same data: orphaned backends would keep its shared
    memory attached), and :meth:`pause` freezes them all.
    """

    _kind = "postgres"
    _start_timeout_s = 60.0
    _stop_timeout_s = 60.0

    def __init__(
        self,
        workdir: Path,
        *,
        port: int | None = None,
        args: Sequence[str] = (),
        bindir: Path | str | None = None,
        primary: PostgresServer | None = None,
    ) -> None:
        super().__init__(workdir, port, args)
        found = Path(bindir) if bindir is not None else find_bindir()
        if found is None:
            raise FileNotFoundError(
                "PostgreSQL server binaries not found (PATH, /usr/lib/postgresql/*/bin, pg_config)"
            )
        self.bindir = found
        self.primary = primary
        self._owner = server_user()
        self._destroyed = False
        # A short private directory: the socket path must fit in sockaddr_un (and when we are
        # root it also holds the data directory, see the module docstring).
        self.private_dir = Path(tempfile.mkdtemp(prefix="kx-pg-"))
        atexit.register(self._cleanup_at_exit)
        if self._owner is None:
            self.datadir = self.workdir / "data"
        else:
            os.chown(self.private_dir, self._owner.pw_uid, self._owner.pw_gid)
            self.datadir = self.private_dir / "data"
            link = self.workdir / "data"
            if link.is_symlink():  # left by an earlier server in this workdir
                link.unlink()
            if not link.exists():
                link.symlink_to(self.datadir)
        self.socket_dir = self.private_dir

    @classmethod
    def replica_of(
        cls,
        primary: PostgresServer,
        workdir: Path,
        *,
        port: int | None = None,
        args: Sequence[str] = (),
    ) -> PostgresServer:
        """A (not yet started) hot standby of the running ``primary``, with the same binaries
        and extra args unless ``args`` are given."""
        return cls(
            workdir,
            port=port,
            args=args or primary.args,
            bindir=primary.bindir,
            primary=primary,
        )

    @staticmethod
    def find_binary() -> str | None:
        """Path of the ``postgres`` binary :func:`find_bindir` finds, or None."""
        bindir = find_bindir()
        return None if bindir is None else str(bindir / "postgres")

    @property
    def log_path(self) -> Path:
        """The server's stderr (it logs there: no logging collector), appended to."""
        return self.workdir / "postgres.log"

    @property
    def _stderr_path(self) -> Path:
        return self.log_path

    @property
    def run_as(self) -> str | None:
        """The user the server runs as when this process is root; None otherwise."""
        return None if self._owner is None else self._owner.pw_name

    def url(self, db: str) -> str:
        """SQLAlchemy URL ``postgresql+psycopg://postgres@127.0.0.1:PORT/db``."""
        return f"postgresql+psycopg://{SUPERUSER}@{LOOPBACK}:{self._port}/{db}"

    def conninfo(self, db: str = "postgres") -> str:
        """libpq connection string of database ``db``."""
        return f"host={LOOPBACK} port={self._port} user={SUPERUSER} dbname={db}"

    def admin_connection(self, **kwargs: Any) -> psycopg.Connection[TupleRow]:
        """A new autocommit psycopg connection as ``postgres`` to database ``postgres``.

        ``kwargs`` override the defaults (e.g. ``dbname=``, ``connect_timeout=``). The caller
        must ``close()`` it (or use it as a context manager).
        """
        params: dict[str, Any] = {
            "host": LOOPBACK,
            "port": self._port,
            "user": SUPERUSER,
            "dbname": "postgres",
            "autocommit": True,
            "connect_timeout": 5,
        }
        params.update(kwargs)
        import psycopg

        return psycopg.connect(**params)

    def create_database(self, name: str) -> str:
        """Create database ``name`` and return its SQLAlchemy URL."""
        # The name is checked: quoting it is enough (and keeps its case, as the URL does).
        self._execute(f'CREATE DATABASE "{_check_db_name(name)}"')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """Drop database ``name`` if it exists, terminating sessions that still use it.

        A test that leaked a connection would otherwise make DROP DATABASE fail ("is being
        accessed by other users").
        """
        self._execute(f'DROP DATABASE IF EXISTS "{_check_db_name(name)}" WITH (FORCE)')

    def end_sessions(self, name: str) -> None:
        """Terminate the sessions that use database ``name`` (their transactions roll back)."""
        with self.admin_connection() as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = %s AND pid <> pg_backend_pid()",
                (_check_db_name(name),),
            )

    def is_primary(self) -> bool:
        """True if the server accepts writes (is not in recovery as a standby)."""
        with self.admin_connection() as conn:
            row = conn.execute("SELECT NOT pg_is_in_recovery()").fetchone()
        return bool(row and row[0])

    def promote(self, timeout_s: float = 60.0) -> None:
        """Promote this standby to a primary and wait until it accepts writes."""
        with self.admin_connection() as conn:
            row = conn.execute("SELECT pg_promote(true, %s)", (max(1, int(timeout_s)),)).fetchone()
        if not (row and row[0]):
            raise ServerError(
                f"{self._kind} on port {self._port} was not promoted within {timeout_s:g}s\n"
                f"--- {self.log_path} ---\n{self.log_tail()}"
            )

    def start(self) -> None:
        """Create the data directory if needed (initdb or a base backup of the primary), start
        postgres and wait until it accepts connections."""
        if self._destroyed:
            raise ServerError(f"{self!r} was destroyed")
        if self.running:
            raise ServerError(f"{self._kind} on port {self._port} is already running")
        if not (self.datadir / "PG_VERSION").is_file():
            # A half-created data directory (an earlier failed attempt) would stop both tools.
            shutil.rmtree(self.datadir, ignore_errors=True)
            if self.primary is None:
                self._initdb()
                # A listener in a test's network namespace (`servers.netns`) connects from its
                # side of the veth pair, not from 127.0.0.1.
                with (self.datadir / "pg_hba.conf").open("a") as hba:
                    hba.write(f"host all all {NETNS_SUBNET} trust\n")
            else:
                self._basebackup(self.primary)
        super().start()

    def kill(self) -> None:
        """SIGKILL the postmaster and all its backends (a crash) and reap it. Idempotent."""
        proc = self._proc
        backends: list[psutil.Process] = []
        if proc is not None and proc.poll() is None:
            # Freeze the postmaster first so that it forks no backend we would miss.
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGSTOP)
            backends = _children(proc.pid, wait_stopped=True)
        super().kill()
        for backend in backends:
            with contextlib.suppress(psutil.Error):
                backend.kill()
        wait_until(
            lambda: all(_gone(b) for b in backends),
            10.0,
            message=f"backends of the killed {self._kind} on port {self._port} still running",
        )

    def destroy(self) -> None:
        """Kill the server and delete its private directory (with the data directory when we
        are root). The object cannot be started again."""
        self.kill()
        self._destroyed = True
        atexit.unregister(self._cleanup_at_exit)
        shutil.rmtree(self.private_dir, ignore_errors=True)

    # -- internals --------------------------------------------------------------------

    def _cleanup_at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self.kill()
        shutil.rmtree(self.private_dir, ignore_errors=True)

    def _binary(self, name: str) -> str:
        path = self.bindir / name
        if not os.access(path, os.X_OK):
            raise FileNotFoundError(f"PostgreSQL binary {str(path)!r} not found")
        return str(path)

    def _as_owner(self, cmd: list[str], *, death_signal: bool = False) -> list[str]:
        return as_owner(self._owner, cmd, death_signal=death_signal)

    def _run_tool(self, cmd: list[str], log: Path) -> None:
        """Run ``initdb``/``pg_basebackup`` (as the server user), output to ``log``."""
        full = self._as_owner(cmd)
        with log.open("ab") as out:
            try:
                result = subprocess.run(
                    full,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=_clean_env(),
                    # The user may not be allowed into our working directory.
                    cwd=self.private_dir,
                    timeout=300,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                shutil.rmtree(self.datadir, ignore_errors=True)
                raise ServerError(f"{shlex.join(full)} timed out\n{_log_tail(log)}") from None
        if result.returncode != 0:
            shutil.rmtree(self.datadir, ignore_errors=True)
            raise ServerError(
                f"{shlex.join(full)} failed with code {result.returncode}\n"
                f"--- {log} ---\n{_log_tail(log)}"
            )

    def _initdb(self) -> None:
        self._run_tool(
            [
                self._binary("initdb"),
                f"--pgdata={self.datadir}",
                f"--username={SUPERUSER}",
                "--auth=trust",  # local and 127.0.0.1, replication connections included
                "--encoding=UTF8",
                "--locale=C",
                # Only a machine crash could lose unsynced files; tests crash processes.
                "--no-sync",
                "--no-instructions",
            ],
            self.workdir / "initdb.log",
        )

    def _basebackup(self, primary: PostgresServer) -> None:
        self._run_tool(
            [
                self._binary("pg_basebackup"),
                f"--host={LOOPBACK}",
                f"--port={primary.port}",
                f"--username={SUPERUSER}",
                "--no-password",
                f"--pgdata={self.datadir}",
                "--write-recovery-conf",  # standby.signal + primary_conninfo
                "--wal-method=stream",
                "--checkpoint=fast",  # a spread checkpoint could take minutes
                "--no-sync",
            ],
            self.workdir / "basebackup.log",
        )

    def _command(self) -> list[str]:
        cmd = [
            self._binary("postgres"),
            "-D",
            str(self.datadir),
            "-p",
            str(self._port),
            "-k",
            str(self.socket_dir),
        ]
        for setting in (
            f"listen_addresses={LOOPBACK}",
            "logging_collector=off",  # log to stderr, i.e. log_path
            "fsync=off",  # see the module docstring: as MariaDBServer's commit policy
            "shared_buffers=64MB",  # MariaDBServer's buffer pool
            "max_connections=200",
            "wal_level=replica",
            "max_wal_senders=5",
            "hot_standby=on",
            # The server's own account of a slow stretch (issue 41's stalls): each checkpoint,
            # and each autovacuum and autoanalyze with what it did, in the log.
            "log_checkpoints=on",
            "log_autovacuum_min_duration=0",
        ):
            cmd.extend(["-c", setting])
        cmd.extend(self._args)
        return self._as_owner(cmd, death_signal=True)

    def _graceful_stop(self, proc: subprocess.Popen[bytes]) -> None:
        # SIGTERM is a "smart" shutdown, which waits for every client to disconnect; SIGINT
        # rolls back open transactions and disconnects them.
        proc.send_signal(signal.SIGINT)

    def _signal(self, signum: signal.Signals) -> None:
        # pause()/resume(): the backends serve their connections without the postmaster.
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)
        for backend in _children(proc.pid, wait_stopped=signum == signal.SIGSTOP):
            with contextlib.suppress(psutil.Error):
                backend.send_signal(signum)

    def _execute(self, statement: str) -> None:
        with self.admin_connection() as conn:
            conn.execute(statement)

    def _ping(self) -> bool:
        import psycopg

        try:
            conn = self.admin_connection(connect_timeout=1)
        except psycopg.Error:
            return False
        conn.close()
        return True


def _children(pid: int, *, wait_stopped: bool) -> list[psutil.Process]:
    """The processes the postmaster ``pid`` forked (each backend is its own session leader,
    so a process-group signal would miss them)."""
    try:
        postmaster = psutil.Process(pid)
        if wait_stopped:
            # SIGSTOP takes effect asynchronously; once stopped, it forks no more.
            with contextlib.suppress(AssertionError):
                wait_until(
                    lambda: postmaster.status() == psutil.STATUS_STOPPED, 2.0, interval_s=0.001
                )
        children: list[psutil.Process] = postmaster.children(recursive=True)
    except psutil.Error:
        return []
    return children


def _gone(proc: psutil.Process) -> bool:
    """True once ``proc`` has exited (a zombie counts: not every PID 1 reaps orphans)."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


_DB_NAME = re.compile(r"[A-Za-z0-9_]{1,63}")


def _check_db_name(name: str) -> str:
    """Reject names that would need care: they end up in URLs and SQL."""
    if not _DB_NAME.fullmatch(name):
        raise ValueError(f"invalid database name {name!r} (use [A-Za-z0-9_], max 63)")
    return name
