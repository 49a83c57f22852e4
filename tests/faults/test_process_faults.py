"""The listener killed, the database down, races at the due instant."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from keyexpiry import Client, Settings, TaskRequest
from keyexpiry.errors import StoreError
from keyexpiry.store import TaskStatus
from tests import sample_tasks
from tests.conftest import MariaDBFactory
from tests.ke import FAST, Running, make_settings, wait_status
from tests.reliability import Verdict
from tests.servers import wait_until

pytestmark = pytest.mark.faults
StartListener = Callable[[Settings], Running]
ROOT = Path(__file__).resolve().parents[2]


def _env(settings: Settings) -> dict[str, str]:
    env = {**os.environ, "KEYEXPIRY_TASKS": "tests.sample_tasks"}
    env["KEYEXPIRY_REDIS_URL"] = settings.redis_url or ""
    env["KEYEXPIRY_DATABASE_URL"] = settings.database_url or ""
    for name, value in FAST.items():
        env[f"KEYEXPIRY_{name.upper()}"] = (
            ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        )
    return env


def test_listener_killed_mid_handler_is_run_again_elsewhere(
    client: Client, settings: Settings, start_listener: StartListener, verdict: Verdict
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "keyexpiry", "listen"],
        cwd=ROOT,
        env=_env(settings),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # hang_first blocks on its first attempt (in that process): kill it right there.
        key = client.create("Probe.hang_first", "crash", ttl_ms=100)
        wait_status(client, key, TaskStatus.RUNNING, timeout_s=20)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    start_listener(settings)
    row = wait_status(client, key, TaskStatus.DONE, timeout_s=20)
    assert row.attempts == 2  # the first attempt died with its listener
    assert sample_tasks.CALLS[key] == 1  # the second ran here
    # The handler started twice (the documented crash window): at least once.
    verdict.check(client, [key], at_least_once=True, calls={key: row.attempts})


def test_database_down_during_create_is_a_clear_error_and_leaves_no_key(
    mariadb_factory: MariaDBFactory, redis_url: str, tmp_path: Path
) -> None:
    server = mariadb_factory()
    cfg = make_settings(redis_url, server.create_database("faults"), tmp_path)
    with Client(cfg) as c:
        server.stop()
        with pytest.raises(StoreError, match="database"):
            c.create("Probe.record", "no-db", ttl_s=60)
        assert c.redis.exists("Probe@record@no-db") == 0
        server.start()
        assert c.create("Probe.record", "no-db", ttl_s=60) == "Probe@record@no-db"


def test_database_down_while_tasks_are_due(
    mariadb_factory: MariaDBFactory,
    redis_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    server = mariadb_factory()
    cfg = make_settings(redis_url, server.create_database("faults"), tmp_path)
    with Client(cfg) as c:
        start_listener(cfg)
        keys = c.create_many(
            TaskRequest("Probe.record", (f"nodb{i}",), ttl_ms=300 + 20 * i) for i in range(20)
        )
        server.stop()
        wait_until(lambda: _all_due(c, keys), 10)
        server.start()
        verdict.check(c, keys, since_ms=c.clock.now_ms())


def _all_due(c: Client, keys: list[str]) -> bool:
    # The ledger is down, so Redis says when they are due: every key has expired.
    return int(c.redis.exists(*keys)) == 0


def test_cancel_racing_expiry_is_truthful(
    client: Client, settings: Settings, start_listener: StartListener, verdict: Verdict
) -> None:
    start_listener(settings)
    rng = random.Random(7)
    answers: dict[str, bool] = {}
    for i in range(300):
        key = client.create("Probe.record", f"race{i}", ttl_ms=rng.randint(0, 8))
        answers[key] = client.cancel("Probe.record", f"race{i}")
    cancelled = [k for k, c in answers.items() if c]
    for key in cancelled:
        row = client.store.get(key)
        assert row is not None and row.status is TaskStatus.CANCELLED
    # Never both: a task cancel said it cancelled never ran; the others ran once.
    assert all(sample_tasks.CALLS[k] == 0 for k in cancelled)
    verdict.check(client, [k for k, c in answers.items() if not c])


def test_three_listeners_share_a_load_without_double_runs(
    client: Client, settings: Settings, start_listener: StartListener, verdict: Verdict
) -> None:
    listeners = [start_listener(settings) for _ in range(3)]
    keys = client.create_many(
        TaskRequest("Probe.record", (f"three{i}",), ttl_ms=200 + i % 500) for i in range(3000)
    )
    verdict.check(client, keys, timeout_s=60)
    # Stats count after the ledger write, so wait for them rather than read them at once.
    wait_until(lambda: sum(r.listener.dispatcher.stats.done for r in listeners) == 3000, 10)
