"""Retention: finished rows past their retention are deleted in batches, by the listener and by
`keyexpiry prune`; pending, running and recent rows never are. Real ledgers (SQLite, MariaDB)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import insert
from typer.testing import CliRunner

from keyexpiry import Client, Settings
from keyexpiry.bench.servers import wait_until
from keyexpiry.cli import app
from keyexpiry.ledger.retention import BATCH_ROWS, cutoffs, prune
from keyexpiry.ledger.store import T, TaskStatus
from keyexpiry.listener import maintenance
from tests import sample_tasks
from tests.ke import Running, wait_status

StartListener = Callable[[Settings], Running]
DAY_MS = 86_400_000


def add_rows(client: Client, prefix: str, status: str, finished_ms: int | None, n: int) -> None:
    rows: list[dict[str, Any]] = [
        {
            "task_key": f"Probe@record@{prefix}{i}", "class_name": "Probe", "method": "record",
            "args": f'["{prefix}{i}"]', "status": status, "attempts": 1,
            "due_at_ms": (finished_ms or client.clock.now_ms()) - 1000,
            "created_at_ms": 0, "updated_at_ms": 0, "finished_at_ms": finished_ms,
        }
        for i in range(n)
    ]  # fmt: skip
    with client.store.engine.begin() as conn:
        conn.execute(insert(T), rows)


def statuses(client: Client) -> dict[str, int]:
    return client.store.counts()


def test_prune_deletes_only_finished_rows_past_their_retention(client: Client) -> None:
    now = client.clock.now_ms()
    add_rows(client, "old-done", "done", now - 8 * DAY_MS, BATCH_ROWS * 2 + 500)
    add_rows(client, "new-done", "done", now - 1 * DAY_MS, 10)
    add_rows(client, "old-cancel", "cancelled", now - 8 * DAY_MS, 5)
    add_rows(client, "old-dead", "dead", now - 8 * DAY_MS, 7)
    add_rows(client, "very-old-dead", "dead", now - 100 * DAY_MS, 3)
    client.create(sample_tasks.Probe.record, "pending", ttl_s=60)
    retain = {
        TaskStatus.DONE: 7 * 86400,
        TaskStatus.CANCELLED: 7 * 86400,
        TaskStatus.DEAD: 90 * 86400,
    }

    dry = prune(client.store, cutoffs(now, retain), dry_run=True)
    assert dry.deleted == {"done": 2500, "cancelled": 5, "dead": 3}
    assert statuses(client)["done"] == 2510  # a dry run deletes nothing

    first = prune(client.store, cutoffs(now, retain), max_batches=2)
    assert first.total == 2 * BATCH_ROWS  # bounded: the listener's rounds stay short
    rest = prune(client.store, cutoffs(now, retain))
    assert rest.deleted == {"done": 500, "cancelled": 5, "dead": 3}
    assert statuses(client) == {"done": 10, "dead": 7, "pending": 1}

    keep_dead = prune(client.store, cutoffs(now, {TaskStatus.DEAD: 0}))  # 0 keeps forever
    assert keep_dead.total == 0 and statuses(client)["dead"] == 7


def test_the_listener_prunes_what_it_finished(
    settings: Settings, client: Client, start_listener: StartListener
) -> None:
    cfg = settings.replace(retain_done_s=0.5, retain_dead_s=0, prune_every_s=0.2)
    start_listener(cfg)
    done = client.create(sample_tasks.Probe.record, "short-lived", ttl_ms=10)
    dead = client.create(sample_tasks.Probe.final, "kept", ttl_ms=10)
    wait_status(client, done, TaskStatus.DONE)
    wait_status(client, dead, TaskStatus.DEAD)
    wait_until(lambda: client.store.get(done) is None, 10, message="the done row was kept")
    row = client.store.get(dead)
    assert row is not None and row.status is TaskStatus.DEAD  # retain_dead_s=0: forever


def test_a_listener_works_off_a_backlog_of_finished_rows_round_after_round(
    settings: Settings,
    client: Client,
    start_listener: StartListener,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More finished rows than one round may delete: the next round follows at the next check,
    not `prune_every_s` later (one round a minute deleted fewer rows than a listener finishes at
    170 tasks/s, and the ledger grew for as long as such a load lasted). The first round runs
    at start: a listener back from downtime begins on the backlog at once."""
    monkeypatch.setattr(maintenance, "_PRUNE_BATCHES", 1)  # rounds of 1,000 rows
    now = client.clock.now_ms()
    add_rows(client, "old-done", "done", now - 8 * DAY_MS, BATCH_ROWS * 3 + 200)
    start_listener(settings.replace(prune_every_s=3600))
    wait_until(
        lambda: statuses(client).get("done", 0) == 0,
        30,
        message="an hour's prune interval held the backlog back after its first round",
    )


def test_keyexpiry_prune_command(client: Client, cli_env: dict[str, str]) -> None:
    now = client.clock.now_ms()
    add_rows(client, "a", "done", now - 3 * 3_600_000, 30)
    add_rows(client, "b", "dead", now - 3 * 3_600_000, 4)
    env = {
        **cli_env,
        "KEYEXPIRY_DATABASE_URL": str(client.store.engine.url.render_as_string(False)),
    }
    runner = CliRunner()
    result = runner.invoke(app, ["prune", "--older-than", "2h", "--dry-run"], env=env)
    assert result.exit_code == 0 and "would delete 34 row(s): 30 done, 4 dead" in result.stdout
    result = runner.invoke(app, ["prune"], env=env)  # the defaults: 7 and 90 days
    assert result.exit_code == 0 and "deleted 0 row(s)" in result.stdout
    result = runner.invoke(app, ["prune", "--older-than", "2h", "--status", "done"], env=env)
    assert result.exit_code == 0 and "deleted 30 row(s): 30 done" in result.stdout, result.output
    assert statuses(client) == {"dead": 4}
    result = runner.invoke(app, ["prune", "--status", "pending"], env=env)
    assert result.exit_code == 1 and "only done, cancelled and dead" in result.stderr
