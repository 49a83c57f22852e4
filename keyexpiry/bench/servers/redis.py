"""A `redis-server` child process on a free loopback port."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from keyexpiry.bench.servers.process import (
    LOOPBACK,
    _resolve_binary,
    _ServerProcess,
)


class RedisServer(_ServerProcess):
    """A ``redis-server`` child process with keyspace notifications for expired keys.

    Persistence is off by default (``--save '' --appendonly no``); pass e.g.
    ``args=["--appendonly", "yes"]`` or ``["--save", "900", "1"]`` to turn it on.
    Redis applies command-line options in order, so later ones override the
    defaults (``--save`` accumulates rules, except that ``--save ''`` clears them).
    """

    _kind = "redis"
    _start_timeout_s = 10.0
    _stop_timeout_s = 10.0

    def __init__(
        self,
        workdir: Path,
        *,
        port: int | None = None,
        args: Sequence[str] = (),
        binary: str = "redis-server",
    ) -> None:
        super().__init__(workdir, port, args)
        self.binary = binary
        # Read by _graceful_stop(); set only for the duration of stop(save=True).
        self._save_on_stop = False

    @property
    def log_path(self) -> Path:
        """Redis log file (``--logfile``), appended to across restarts."""
        return self.workdir / "redis.log"

    def url(self, db: int = 0) -> str:
        """``redis://127.0.0.1:PORT/db``."""
        return f"redis://{LOOPBACK}:{self._port}/{db}"

    def client(self, db: int = 0, **kwargs: Any) -> redis.Redis:
        """A new redis-py client for ``db``; the caller must ``close()`` it.

        ``kwargs`` go to :class:`redis.Redis` (e.g. ``socket_timeout``). Note that
        redis-py 8 defaults to a 5 s socket timeout and 10 retries with backoff,
        which a test against a paused or stopped server usually wants to disable:
        ``retry=Retry(NoBackoff(), 0)``.
        """
        return redis.Redis(host=LOOPBACK, port=self._port, db=db, **kwargs)

    def stop(self, *, save: bool = False) -> None:
        """Stop with ``SHUTDOWN NOSAVE`` (``SHUTDOWN SAVE`` if ``save``). Idempotent.

        NOSAVE skips the RDB snapshot but Redis still flushes and fsyncs the AOF
        when ``--appendonly yes`` is set, so AOF data survives a restart.
        """
        self._save_on_stop = save
        try:
            super().stop()
        finally:
            self._save_on_stop = False

    def restart(self, args: Sequence[str] | None = None, *, save: bool = False) -> None:
        """Stop (see :meth:`stop`) and start on the same port, optionally with new args."""
        self.stop(save=save)
        if args is not None:
            self._args = tuple(args)
        self.start()

    def _command(self) -> list[str]:
        return [
            _resolve_binary(self.binary),
            "--port", str(self._port),
            "--bind", LOOPBACK,
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "no",
            "--notify-keyspace-events", "Ex",
            "--daemonize", "no",
            "--logfile", str(self.log_path),
            "--protected-mode", "no",
            *self._args,
        ]  # fmt: skip

    def _admin_client(self, timeout_s: float) -> redis.Redis:
        # No retries: readiness polling and shutdown must see failures immediately
        # instead of sitting in redis-py 8's default backoff loop.
        return redis.Redis(
            host=LOOPBACK,
            port=self._port,
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )

    def _ping(self) -> bool:
        client = self._admin_client(0.5)
        try:
            # BusyLoadingError (dataset still loading) is a RedisError: not ready yet.
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def _graceful_stop(self, proc: subprocess.Popen[bytes]) -> None:
        client = self._admin_client(5.0)
        try:
            if self._save_on_stop:
                client.shutdown(save=True)
            else:
                client.shutdown(nosave=True)
        except redis.RedisError:
            # Server refused (e.g. busy script) or is unreachable: fall back to SIGTERM.
            proc.terminate()
        finally:
            client.close()
