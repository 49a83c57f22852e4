"""Real servers for the test suite and the benchmark: the process base, free ports, waiting.

Every server runs as a child process on a free loopback port with its files in a
caller-supplied work directory, so tests (and xdist workers) never share state with
each other or with anything installed on the machine. The classes expose the
operations fault-injection tests need: stop, kill, restart on the same port, and
pause/resume (SIGSTOP/SIGCONT) to simulate a server that hangs without closing
its sockets.

Nothing here sleeps for a fixed time: all waiting goes through :func:`wait_until`,
which polls on a monotonic deadline.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

LOOPBACK = "127.0.0.1"
NETNS_NET = "10.213"
"""The /16 a test's network namespaces take their veth pairs from (`servers.netns`)."""
NETNS_SUBNET = f"{NETNS_NET}.0.0/16"
"""The same as a CIDR (pg_hba.conf)."""
NETNS_HOSTS = f"{NETNS_NET}.%"
"""The same as a MariaDB account's host."""

# Lines of a server log quoted in error messages: enough to show the real failure
# (which usually comes last) without drowning the pytest report.
_LOG_TAIL_LINES = 40

# Ports handed out by free_port() in this process. A port is only "free" until
# somebody binds it; remembering what we already returned stops two servers created
# back to back (before either has started) from being given the same port.
_handed_out_ports: set[int] = set()


class ServerError(RuntimeError):
    """A server could not be started, or exited when it should not have."""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is currently free.

    The kernel picks the port (bind to port 0). There is an unavoidable window
    between closing this probe socket and the server binding the port; the server
    classes close it by retrying with a new port if the first start fails with
    "address in use" (only when the caller did not ask for a specific port).
    On Linux >= 4.6 bind(0) hands out even ports and connect() prefers odd ones, so
    a client reconnecting to a stopped server cannot accidentally self-connect
    to the port through TCP simultaneous open.
    """
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((LOOPBACK, 0))
            port: int = sock.getsockname()[1]
        if port not in _handed_out_ports and _reserve(port):
            _handed_out_ports.add(port)
            return port
    raise ServerError("could not find a free loopback port")  # pragma: no cover


_RESERVED_DIR = Path(tempfile.gettempdir()) / "keyexpiry-ports"
_RESERVED_S = 3600.0


def _reserve(port: int) -> bool:
    """Mark `port` as handed out for an hour, for every process on the machine.

    A server restarted on its port (`restart()` keeps it) leaves it free for a moment; another
    process (a second pytest-xdist worker) asking the kernel for a free port then may get it,
    and its server answers the first one's clients (seen in CI: a test paused its MariaDB and a
    query was answered anyway, by another worker's). A marker file per port, created with
    O_EXCL, keeps processes from handing out the same port while it is in use."""
    marker = _RESERVED_DIR / str(port)
    try:
        _RESERVED_DIR.mkdir(exist_ok=True)
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        try:
            if time.time() - marker.stat().st_mtime < _RESERVED_S:
                return False
            os.utime(marker)  # an hour old: whoever had it is long done
        except OSError:
            return False
        return True
    except OSError:
        return True  # no shared directory: the per-process set alone, as before
    os.close(fd)
    return True


# wait_until's polling when no interval is given: a quick condition is seen within a few ms,
# and a long wait costs a check every 25 ms, not one every 10 ms (a 3 s wait on a ledger row
# was 300 queries competing with the listener under test for a 2-core machine). Not 50 ms: a
# test waits half an interval on average after its condition came true, several times over.
_FIRST_INTERVAL_S = 0.005
_MAX_INTERVAL_S = 0.025
_INTERVAL_GROWTH = 1.5


def wait_until(
    predicate: Callable[[], bool],
    timeout_s: float,
    interval_s: float | None = None,
    message: str = "",
) -> None:
    """Poll ``predicate`` until it returns true, or fail after ``timeout_s`` seconds.

    ``interval_s`` is the time between two checks; by default it starts at 5 ms and grows
    by half each check up to 25 ms. The deadline is measured with :func:`time.monotonic`,
    so wall-clock jumps do not shorten or stretch it. The predicate is always evaluated one
    last time at the deadline, so a slow machine does not fail a condition that has just
    become true. Exceptions raised by ``predicate`` propagate immediately (use that to abort
    the wait early, e.g. when the process being waited for has died).

    Raises:
        AssertionError: ``predicate`` did not become true in time; the text is
            ``message`` (or a generic one) plus the timeout.
    """
    deadline = time.monotonic() + timeout_s
    pause_s = _FIRST_INTERVAL_S if interval_s is None else interval_s
    while True:
        if predicate():
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        time.sleep(min(pause_s, remaining))
        if interval_s is None:
            pause_s = min(pause_s * _INTERVAL_GROWTH, _MAX_INTERVAL_S)
    if predicate():
        return
    what = message or f"condition {getattr(predicate, '__name__', predicate)!r} not met"
    raise AssertionError(f"{what} (timed out after {timeout_s:g}s)")


def _log_tail(path: Path, offset: int = 0, lines: int = _LOG_TAIL_LINES) -> str:
    """Return the last ``lines`` lines of ``path`` written after byte ``offset``."""
    try:
        with path.open("rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    text = data.decode("utf-8", errors="replace").rstrip()
    if not text:
        return f"<{path} is empty>"
    return "\n".join(text.splitlines()[-lines:])


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def find_binary(name: str) -> str | None:
    """Return the path of executable ``name``, or None if it is not installed.

    Looks on PATH first, then in the sbin directories: Debian installs mariadbd in
    /usr/sbin, which is not on a normal user's PATH.
    """
    found = shutil.which(name)
    if found is None and os.sep not in name:
        found = shutil.which(name, path=os.pathsep.join(["/usr/sbin", "/usr/local/sbin", "/sbin"]))
    return found


def _resolve_binary(name: str) -> str:
    found = find_binary(name)
    if found is None:
        raise FileNotFoundError(f"server binary {name!r} not found on PATH or in */sbin")
    return found


def _death_signal_prefix() -> list[str]:
    """Command prefix that makes the kernel SIGKILL the server if we die.

    atexit cleanup does not run when the test process is SIGKILLed (CI timeout,
    OOM killer, pytest-timeout's thread method uses os._exit), so without this a
    crashed run would leave servers behind holding ports. ``setpriv`` sets
    PR_SET_PDEATHSIG and then execs the server, so the child's pid is the server's
    pid. The signal fires when the *thread* that forked the child exits, so it is
    only used when we are on the main thread (which lives as long as the process).
    """
    if not sys.platform.startswith("linux"):
        return []
    if threading.current_thread() is not threading.main_thread():
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return []
    return [setpriv, "--pdeathsig", "KILL", "--"]


# Every started server, so the atexit hook can kill whatever a test run forgot to stop.
_live: set[_ServerProcess] = set()


@atexit.register
def _kill_leftovers() -> None:
    for server in list(_live):
        with contextlib.suppress(Exception):
            server.kill()


class _ServerProcess:
    """Process bookkeeping shared by the Redis and MariaDB wrappers."""

    #: Name used in error messages.
    _kind = "server"
    #: How long start() waits for the server to answer.
    _start_timeout_s = 10.0
    #: How long stop() waits for a graceful exit before SIGKILL.
    _stop_timeout_s = 30.0

    def __init__(self, workdir: Path, port: int | None, args: Sequence[str]) -> None:
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        # A port chosen by us may be stolen before the server binds it; only then is
        # it safe to pick another one. Once the server has run on a port, the port
        # is fixed so that restart() keeps clients' URLs valid.
        self._port_is_ours = port is None
        self._port = free_port() if port is None else port
        self._args: tuple[str, ...] = tuple(args)
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_once = False
        self._log_offset = 0

    # -- subclass hooks ---------------------------------------------------------------

    @property
    def log_path(self) -> Path:
        """The server's own log file."""
        raise NotImplementedError

    @property
    def _stderr_path(self) -> Path:
        # Errors printed before the server opens its log file (bad flags) go here.
        return self.workdir / f"{self._kind}.stderr"

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _ping(self) -> bool:
        """Return True once the server answers requests."""
        raise NotImplementedError

    def _graceful_stop(self, proc: subprocess.Popen[bytes]) -> None:
        proc.terminate()

    @property
    def _cwd(self) -> Path | None:
        """The server's working directory (None: ours). A server run as another user needs
        one it may enter: ours may be a private checkout (a fresh clone under a 0700
        `mktemp -d` directory in CI)."""
        return None

    # -- public interface -------------------------------------------------------------

    @property
    def port(self) -> int:
        """TCP port on 127.0.0.1 (stable across restarts)."""
        return self._port

    @property
    def pid(self) -> int:
        """Process id of the running server."""
        if self._proc is None or self._proc.poll() is not None:
            raise ServerError(f"{self._kind} on port {self._port} is not running")
        return self._proc.pid

    @property
    def running(self) -> bool:
        """True while the process exists (a paused server counts as running)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def args(self) -> tuple[str, ...]:
        """Extra command-line arguments appended after the defaults."""
        return self._args

    def start(self) -> None:
        """Start the server and wait until it answers; raise ServerError on failure."""
        if self.running:
            raise ServerError(f"{self._kind} on port {self._port} is already running")
        self._reap()
        attempts = 3 if self._port_is_ours and not self._started_once else 1
        for attempt in range(1, attempts + 1):
            try:
                self._spawn_and_wait()
            except _PortInUse:
                if attempt == attempts:
                    raise
                self._port = free_port()
                continue
            self._started_once = True
            self._port_is_ours = False
            return

    def stop(self) -> None:
        """Stop the server gracefully (SIGKILL if it does not exit in time). Idempotent."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            # A stopped (SIGSTOPped) process queues SIGTERM and never answers a
            # SHUTDOWN command; wake it first.
            self.resume()
            with contextlib.suppress(ProcessLookupError):
                self._graceful_stop(proc)
            try:
                proc.wait(timeout=self._stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._reap()

    def kill(self) -> None:
        """SIGKILL the server (simulates a crash) and reap it. Idempotent."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            # SIGKILL works on a stopped process too; no SIGCONT needed.
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        self._reap()

    def restart(self, args: Sequence[str] | None = None) -> None:
        """Stop and start again on the same port, optionally replacing the extra args."""
        self.stop()
        if args is not None:
            self._args = tuple(args)
        self.start()

    def pause(self) -> None:
        """Freeze the server with SIGSTOP: its sockets stay open but nothing answers. Returns
        once the process is stopped: the signal takes effect asynchronously, and a query sent
        right after it was answered by a thread not stopped yet (a CI failure)."""
        self._signal(signal.SIGSTOP)
        if self._proc is not None:
            wait_until(lambda: self._stopped(), 2, message="the server did not stop")

    def _stopped(self) -> bool:
        """Whether the process is stopped (state `T` in /proc), or gone."""
        assert self._proc is not None
        try:
            stat = Path(f"/proc/{self._proc.pid}/stat").read_text()
        except OSError:
            return True
        return stat.rpartition(")")[2].split()[0] in ("T", "t", "Z", "X")

    def resume(self) -> None:
        """Undo :meth:`pause` with SIGCONT (harmless if the server is not paused)."""
        self._signal(signal.SIGCONT)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The end of the server log written since the last start, for error messages."""
        return _log_tail(self.log_path, self._log_offset, lines)

    def __enter__(self) -> Self:
        if not self.running:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<{type(self).__name__} 127.0.0.1:{self._port} {state} in {self.workdir}>"

    # -- internals --------------------------------------------------------------------

    def _signal(self, signum: signal.Signals) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self._proc.send_signal(signum)

    def _reap(self) -> None:
        """Forget a process that has exited (waiting on it avoids a ResourceWarning)."""
        if self._proc is not None:
            self._proc.wait()
            self._proc = None
        _live.discard(self)

    def _spawn_and_wait(self) -> None:
        # Remember where this run's log output starts, so errors quote only it.
        self._log_offset = _file_size(self.log_path)
        stderr_offset = _file_size(self._stderr_path)
        cmd = [*_death_signal_prefix(), *self._command()]
        with self._stderr_path.open("ab") as stderr:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                cwd=self._cwd,
                # Own session: a Ctrl-C in the terminal goes to pytest, which then
                # stops the servers in fixture teardown instead of racing with them.
                start_new_session=True,
            )
        _live.add(self)
        proc = self._proc

        def ready() -> bool:
            if proc.poll() is not None:
                raise _Exited
            return self._ping()

        try:
            wait_until(ready, self._start_timeout_s, interval_s=0.01)
        except (_Exited, AssertionError) as exc:
            exited = isinstance(exc, _Exited)
            self.kill()
            log = self.log_tail()
            stderr_text = _log_tail(self._stderr_path, stderr_offset)
            details = (
                f"command: {shlex.join(cmd)}\n"
                f"--- {self.log_path} ---\n{log}\n"
                f"--- {self._stderr_path} ---\n{stderr_text}"
            )
            if exited and "already in use" in log + stderr_text:
                raise _PortInUse(f"port {self._port} already in use\n{details}") from None
            reason = (
                f"exited with code {proc.returncode}"
                if exited
                else f"did not answer within {self._start_timeout_s:g}s"
            )
            raise ServerError(
                f"{self._kind} on 127.0.0.1:{self._port} {reason}\n{details}"
            ) from None
        except BaseException:
            # Unexpected error or Ctrl-C while waiting: do not leave a half-started
            # server behind for the atexit hook to find.
            self.kill()
            raise


class _Exited(Exception):
    """Internal: the server process exited while we waited for it."""


class _PortInUse(ServerError):
    """The server could not bind its port."""
