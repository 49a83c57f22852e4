"""Retrying dead tasks: `Client.retry`, `retry_dead` and `keyexpiry retry`, on real servers."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

from typer.testing import CliRunner

from keyexpiry import Client, Settings
from keyexpiry.cli import app
from keyexpiry.ledger.store import TaskStatus
from keyexpiry.ledger.table import EARLIER_ERRORS
from tests import sample_tasks
from tests.ke import Running, make_settings, wait_status

StartListener = Callable[[Settings], Running]
broken = sample_tasks.Probe.broken


def make_dead(client: Client, name: str) -> str:
    sample_tasks.BROKEN.add(name)
    key = client.create(broken, name, ttl_ms=20)
    row = wait_status(client, key, TaskStatus.DEAD)
    assert row.attempts == 2 and row.last_error is not None
    return key


def test_a_dead_task_runs_again_with_attempts_reset_and_its_errors_kept(
    settings: Settings, client: Client, start_listener: StartListener
) -> None:
    start_listener(settings)
    key = make_dead(client, "a")
    dead = client.get(broken, "a")
    assert dead is not None and dead.last_error is not None
    # Two failed attempts: both errors are on the row, newest first.
    assert dead.last_error.count(EARLIER_ERRORS) == 1
    assert "attempt 2" in dead.last_error.split(EARLIER_ERRORS)[0]

    # Still broken: the retry gets a fresh schedule (two more attempts) and dies again,
    # with the errors of all four attempts kept.
    # The retry is committed when it returns (the row is pending again, attempts 0); the listener
    # may claim it within milliseconds, so the next state to wait for is dead.
    assert client.retry(broken, "a")
    again = wait_status(client, key, TaskStatus.DEAD)
    assert again.attempts == 2 and sample_tasks.CALLS[key] == 4
    assert again.last_error is not None and again.last_error.count(EARLIER_ERRORS) == 3

    sample_tasks.BROKEN.discard("a")  # the operator fixed the cause
    assert client.retry(broken, "a")
    done = wait_status(client, key, TaskStatus.DONE)
    assert done.attempts == 1 and sample_tasks.CALLS[key] == 5


def test_only_dead_or_waiting_tasks_are_retried(settings: Settings, client: Client) -> None:
    # No listener: nothing runs, so each row stays in the state the test puts it in.
    client.create(sample_tasks.Probe.record, "pending", ttl_s=60)
    assert not client.retry(sample_tasks.Probe.record, "pending")
    assert not client.retry(sample_tasks.Probe.record, "absent")
    pending = client.get(sample_tasks.Probe.record, "pending")
    assert pending is not None and pending.attempts == 0 and pending.status is TaskStatus.PENDING


def test_retry_at_a_later_time_arms_the_key_for_then(
    settings: Settings, client: Client, start_listener: StartListener
) -> None:
    running = start_listener(settings)
    key = make_dead(client, "later")
    running.stop()
    at = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=120)
    assert client.retry_keys([key], at=at) == [key]
    row = client.store.get(key)
    assert row is not None and row.status is TaskStatus.PENDING and row.attempts == 0
    assert abs(row.due_at_ms - at.timestamp() * 1000) < 5
    ttl_ms = client.ttl_ms(broken, "later")
    assert ttl_ms is not None and 115_000 < ttl_ms <= 120_000


def test_cli_retries_all_dead_tasks_of_a_class(
    redis_url: str, sqlite_url: str, tmp_path: Path, start_listener: StartListener
) -> None:
    sample_tasks.reset()
    cfg = make_settings(redis_url, sqlite_url, tmp_path, tasks=("tests.sample_tasks",))
    env = {
        "KEYEXPIRY_REDIS_URL": redis_url,
        "KEYEXPIRY_DATABASE_URL": sqlite_url,
        "KEYEXPIRY_STATE_DIR": str(tmp_path / "state"),
        "KEYEXPIRY_TASKS": "tests.sample_tasks",
    }
    runner = CliRunner()
    with Client(cfg) as c:
        start_listener(cfg)
        keys = [make_dead(c, f"n{i}") for i in range(3)]
        other = c.create(sample_tasks.Probe.final, "other", ttl_ms=10)
        wait_status(c, other, TaskStatus.DEAD)
        sample_tasks.BROKEN.clear()

        result = runner.invoke(app, ["retry", "--dead", "--class", "Nope"], env=env)
        assert result.exit_code == 0 and "requeued 0 dead task(s)" in result.stdout

        result = runner.invoke(
            app, ["retry", "--dead", "--class", "Probe", "--since", "1h"], env=env
        )
        assert result.exit_code == 0, result.output
        assert "requeued 4 dead task(s)" in result.stdout
        for key in keys:
            wait_status(c, key, TaskStatus.DONE)
        wait_status(c, other, TaskStatus.DEAD)  # DoNotRetry: dead again, on its own terms

        result = runner.invoke(app, ["retry", "Probe", "broken", "n0"], env=env)
        assert result.exit_code == 1
        assert result.stderr.strip() == (
            "error: Probe@broken@n0 is done, attempt 1: only dead or failed-and-waiting "
            "tasks are retried"
        )
        result = runner.invoke(app, ["retry", "--dead", "Probe", "broken"], env=env)
        assert result.exit_code == 1 and "not both" in result.stderr
        result = runner.invoke(app, ["retry", "--dead", "--since", "yesterday"], env=env)
        assert result.exit_code == 1 and "--since 'yesterday'" in result.stderr
