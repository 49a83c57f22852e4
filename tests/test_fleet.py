"""Heartbeats: listeners know each other, a silent one's running tasks are taken over in
seconds, a slow but beating one keeps its runs; `keyexpiry listeners`. Real Redis + ledgers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from typer.testing import CliRunner

from keyexpiry import Client, Settings
from keyexpiry.bench.servers import wait_until
from keyexpiry.cli import app
from keyexpiry.clock import monotonic_s
from keyexpiry.ledger.heartbeats import ListenerRow
from keyexpiry.ledger.store import TaskStatus
from tests import sample_tasks
from tests.conftest import MariaDBFactory
from tests.ke import Running, make_settings, wait_status

StartListener = Callable[[Settings], Running]
# Ten beats per takeover window: a heartbeat delayed by a loaded CI machine is not a death.
QUICK = {"heartbeat_s": 0.2, "takeover_after_s": 2.0}


def test_a_listener_announces_itself_and_leaves_when_stopped(
    settings: Settings, client: Client, start_listener: StartListener, cli_env: dict[str, str]
) -> None:
    running = start_listener(settings.replace(**QUICK))
    owner = running.listener.owner
    wait_until(lambda: [r.id for r in client.store.listeners()] == [owner], 5)
    sample_tasks.gate("busy").clear()
    key = client.create(sample_tasks.Probe.wait, "busy", ttl_ms=10)
    wait_until(lambda: client.store.listeners()[0].running == 1, 5, message="running not shown")

    env = {**cli_env, "KEYEXPIRY_DATABASE_URL": settings.database_url or ""}
    result = CliRunner().invoke(app, ["listeners", "--json"], env=env)
    assert result.exit_code == 0, result.output
    (shown,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert shown["id"] == owner and shown["state"] == "live" and shown["running"] == 1
    assert shown["heartbeat_age_ms"] < 1000

    sample_tasks.gate("busy").set()
    wait_status(client, key, TaskStatus.DONE)
    running.stop()
    assert client.store.listeners() == []
    result = CliRunner().invoke(app, ["listeners"], env=env)
    assert result.stdout.strip() == "no listener is running"


def test_a_silent_listeners_runs_are_taken_over_long_before_their_lease_ends(
    settings: Settings, client: Client, start_listener: StartListener
) -> None:
    """A listener that died (its row stopped beating) with a run whose lease has a minute to
    go: a live listener requeues it within the takeover window and runs it."""
    key = client.create(sample_tasks.Probe.record, "orphan", ttl_ms=1)
    wait_until(lambda: client.clock.now_ms() > client.store.get(key).due_at_ms, 5)  # type: ignore[union-attr]
    now = client.clock.now_ms()
    # Claimed before its listener's silence began (a claim after it proves the listener alive).
    client.store.claim([key], now_ms=now, lease_until_ms=now + 60_000, token="gone:1:abc:7")
    client.store.beat(ListenerRow("gone:1:abc", "gone", 1, now - 60_000, now - 10_000, 1))
    started = monotonic_s()
    start_listener(settings.replace(**QUICK))
    done = wait_status(client, key, TaskStatus.DONE, timeout_s=15)
    took_s = monotonic_s() - started
    assert took_s < 10, took_s
    assert done.attempts == 2 and sample_tasks.CALLS[key] == 1
    assert "gone:1:abc" not in [r.id for r in client.store.listeners()]


def test_a_listener_whose_heartbeat_looks_old_but_that_claimed_since_keeps_its_runs(
    settings: Settings, client: Client, start_listener: StartListener
) -> None:
    """Found by a 27 s network partition from the ledger: the cut listener's heartbeat, held
    by the network, was written after the heal with its old time; its peer found the row silent
    and requeued a run the listener had claimed a moment before, which ran twice. A run claimed
    after its listener's silence began proves the listener alive: nothing of it is requeued
    while that claim is younger than a takeover window. (Should the listener really be gone,
    the run is requeued once it is older, and runs as a second attempt.)"""
    watcher = start_listener(settings.replace(**QUICK))
    beats = int(QUICK["takeover_after_s"] / QUICK["heartbeat_s"]) + 2
    wait_until(lambda: watcher.listener.fleet.beats >= beats, 10, interval_s=0.05)
    key = client.create(sample_tasks.Probe.record, "claimed-since", ttl_ms=2000)
    due_ms = client.store.get(key).due_at_ms  # type: ignore[union-attr]
    now = client.clock.now_ms()
    # The late heartbeat: an old time, written now; then the claim it made meanwhile (at the
    # task's due time, two seconds ahead: the watcher, hearing the key expire, finds it taken).
    client.store.beat(ListenerRow("late:1:abc", "late", 1, now - 60_000, now - 10_000, 1))
    assert client.store.claim(
        [key], now_ms=due_ms, lease_until_ms=due_ms + 60_000, token="late:1:abc:7"
    )
    claimed = monotonic_s()
    # Every beat of the watcher in the next takeover window found the row silent.
    after = watcher.listener.fleet.beats + 3
    wait_until(lambda: watcher.listener.fleet.beats >= after, 5, interval_s=0.05)
    row = client.store.get(key)
    assert monotonic_s() - claimed < QUICK["takeover_after_s"]
    assert row is not None and row.status is TaskStatus.RUNNING and row.attempts == 1, row
    assert watcher.listener.fleet.takeovers == 0
    # It never beats again: once its claim is older than the window, the run is taken over.
    done = wait_status(client, key, TaskStatus.DONE, timeout_s=15)
    assert done.attempts == 2 and sample_tasks.CALLS[key] == 1
    assert watcher.listener.fleet.takeovers == 1


def test_a_slow_listener_that_beats_keeps_its_runs(
    settings: Settings, client: Client, start_listener: StartListener
) -> None:
    """A handler running three takeover windows long, with a second listener watching: the
    run is never taken over (its listener's heartbeat thread goes on while it runs)."""
    quick = settings.replace(**QUICK)
    first = start_listener(quick)
    sample_tasks.gate("slow").clear()
    key = client.create(sample_tasks.Probe.wait, "slow", ttl_ms=10)
    wait_status(client, key, TaskStatus.RUNNING)
    second = start_listener(quick)
    wait_until(lambda: len(client.store.listeners()) == 2, 5)
    # The watcher has judged its peer on every beat of three takeover windows.
    beats = second.listener.fleet.beats + int(3 * quick.takeover_after_s / quick.heartbeat_s)
    wait_until(lambda: second.listener.fleet.beats >= beats, 15, interval_s=0.05)
    row = client.store.get(key)
    assert row is not None and row.status is TaskStatus.RUNNING and row.attempts == 1
    assert row.claimed_by is not None and row.claimed_by.startswith(first.listener.owner)
    assert second.listener.fleet.takeovers == 0
    sample_tasks.gate("slow").set()
    done = wait_status(client, key, TaskStatus.DONE)
    assert done.attempts == 1 and sample_tasks.CALLS[key] == 1


def test_a_database_outage_does_not_make_live_listeners_take_each_other_over(
    mariadb_factory: MariaDBFactory, redis_url: str, tmp_path: Path, start_listener: StartListener
) -> None:
    """While the ledger is down nobody can beat; when it is back every heartbeat is old. A
    listener must first beat a whole window itself before judging others, or the first one
    back would requeue the runs of peers that are alive (and run them twice)."""
    db = mariadb_factory()
    cfg = make_settings(redis_url, db.create_database("outage"), tmp_path, **QUICK)
    sample_tasks.reset()
    with Client(cfg) as c:
        first = start_listener(cfg)
        sample_tasks.gate("through-outage").clear()
        key = c.create(sample_tasks.Probe.stall, "through-outage", ttl_ms=10)
        wait_status(c, key, TaskStatus.RUNNING)
        watchers = [start_listener(cfg) for _ in range(2)]
        wait_until(lambda: len(c.store.listeners()) == 3, 10)
        db.stop()
        # Down for two takeover windows, so every row is older than one when it is back.
        failed = int(2 * QUICK["takeover_after_s"] / QUICK["heartbeat_s"])
        wait_until(lambda: all(r.listener.fleet.failed_beats >= failed for r in watchers), 20)
        db.start()
        # Every listener back to beating, then three takeover windows of judging each other.
        for running in [first, *watchers]:
            beats = running.listener.fleet.beats + int(
                3 * QUICK["takeover_after_s"] / QUICK["heartbeat_s"]
            )
            wait_until(lambda r=running, b=beats: r.listener.fleet.beats >= b, 20)
        assert sum(r.listener.fleet.takeovers for r in watchers) == 0
        row = c.store.get(key)
        assert row is not None and row.status is TaskStatus.RUNNING and row.attempts == 1
        sample_tasks.gate("through-outage").set()
        done = wait_status(c, key, TaskStatus.DONE)
        assert done.attempts == 1 and sample_tasks.CALLS[key] == 1
