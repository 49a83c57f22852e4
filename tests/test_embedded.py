"""The embedded default (bundled redis-server on a unix socket, SQLite): state dirs with odd
names, a listener that restarts the server it depends on, and a command to stop it. Real
redis-server processes; no server is left running."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from keyexpiry import Client, Settings
from keyexpiry.bench.servers import wait_until
from keyexpiry.cli import app
from keyexpiry.ledger.store import TaskStatus
from keyexpiry.redis.embedded import is_running, stop_embedded_redis
from tests import sample_tasks
from tests.ke import FAST, Running, wait_status


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """A state dir whose name has a space, a quote, a backslash, `%`, `?` and `#`."""
    path = tmp_path / 'state with space "q" \\ 50% a?b #c'
    yield path
    stop_embedded_redis(path)
    wait_until(lambda: not is_running(path), 10, message="embedded redis-server did not stop")


def _settings(state_dir: Path) -> Settings:
    return Settings(state_dir=state_dir, **FAST)  # type: ignore[arg-type]


def test_a_state_dir_with_spaces_and_quotes_runs_tasks(state_dir: Path) -> None:
    settings = _settings(state_dir)
    sample_tasks.reset()
    running = Running(settings)
    try:
        with Client(settings) as client:
            key = client.create("Probe.record", "odd-dir", ttl_ms=30)
            wait_status(client, key, TaskStatus.DONE)
    finally:
        running.stop()
    assert (state_dir / "redis.conf").exists() and is_running(state_dir)
    assert (state_dir / "keyexpiry.sqlite3").exists()  # the ledger is in the dir, not cut at `?`


def _gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie not yet reaped counts as exited)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_listener_restarts_the_embedded_server_it_depends_on(state_dir: Path) -> None:
    settings = _settings(state_dir)
    sample_tasks.reset()
    running = Running(settings)
    try:
        with Client(settings) as client:
            key = client.create("Probe.record", "after-kill", ttl_ms=1500)
            pid = int((state_dir / "redis.pid").read_text())
            os.kill(pid, signal.SIGKILL)
            # The killed process, not "no server answers": the listener starts a new one within
            # milliseconds of the old one's death, and a poll can miss that gap (it did in CI).
            wait_until(lambda: _gone(pid), 5, message="the killed redis-server still runs")
            # Nothing but the listener may start it again: the wait reads only the SQLite ledger.
            row = wait_status(client, key, TaskStatus.DONE, timeout_s=20)
            assert row.attempts == 1 and sample_tasks.CALLS[key] == 1
            assert int((state_dir / "redis.pid").read_text()) != pid
    finally:
        running.stop()


def test_embedded_status_and_stop(state_dir: Path) -> None:
    env = {"KEYEXPIRY_STATE_DIR": str(state_dir), "KEYEXPIRY_REDIS_URL": ""}
    runner = CliRunner()
    assert runner.invoke(app, ["init-db"], env=env).exit_code == 0  # starts nothing but SQLite
    made = runner.invoke(app, ["reconcile"], env=env)  # starts the embedded server
    assert made.exit_code == 0, made.output
    status = runner.invoke(app, ["embedded", "status"], env=env)
    assert status.exit_code == 0 and "embedded redis-server running" in status.stdout
    stopped = runner.invoke(app, ["embedded", "stop"], env=env)
    assert stopped.exit_code == 0 and stopped.stdout == "embedded redis-server stopped\n"
    wait_until(lambda: not is_running(state_dir), 10, message="still running after stop")
    again = runner.invoke(app, ["embedded", "stop"], env=env)
    assert again.stdout == "embedded redis-server was not running\n"
    elsewhere = runner.invoke(
        app, ["embedded", "status"], env={**env, "KEYEXPIRY_REDIS_URL": "redis://127.0.0.1:1/0"}
    )
    assert "no embedded redis-server in use" in elsewhere.stdout
