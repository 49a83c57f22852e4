"""keyexpiry behind Redis Sentinel, on a real group (master, replica, three sentinels): tasks run
once through a `redis+sentinel://` URL, replicas get notifications, doctor checks every node.

Failovers are in tests/faults/test_sentinel_faults.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from loguru import logger

from keyexpiry import Client, Settings, TaskRequest
from keyexpiry.bench.servers import LOOPBACK, free_port, wait_until
from keyexpiry.bench.servers.sentinel import SentinelGroup, SentinelServer
from keyexpiry.ledger.store import TaskStatus
from keyexpiry.ops.doctor import run_checks
from keyexpiry.redis.sentinel import (
    SETTLE_S,
    MasterWatch,
    close_client,
    follows_sentinel,
    master_client,
    replica_addresses,
)
from tests import sample_tasks
from tests.ke import Running, live_connections, make_settings, wait_status

StartListener = Callable[[Settings], Running]


@pytest.fixture
def log_lines() -> Iterator[list[str]]:
    """Every loguru line written during the test, as `LEVEL message`."""
    lines: list[str] = []
    sink = logger.add(lines.append, level="DEBUG", format="{level} {message}", diagnose=False)
    yield lines
    logger.remove(sink)


def test_tasks_run_once_through_a_sentinel_url(
    sentinel_group: SentinelGroup, db_url: str, tmp_path: Path, start_listener: StartListener
) -> None:
    cfg = make_settings(sentinel_group.url(), db_url, tmp_path)
    sample_tasks.reset()
    with Client(cfg) as c:
        assert follows_sentinel(c.redis)
        running = start_listener(cfg)
        assert running.listener.subscription.node == (LOOPBACK, sentinel_group.master.port)
        keys = c.create_many(
            TaskRequest("Probe.record", (f"sentinel{i}",), ttl_ms=100 + 20 * i) for i in range(20)
        )
        for key in keys:
            wait_status(c, key, TaskStatus.DONE)
        assert all(sample_tasks.CALLS[k] == 1 for k in keys)
        # The key of a later task was written on the master (and replicated).
        later = c.create("Probe.record", "later", ttl_s=60)
        master = sentinel_group.master.client()
        assert 55_000 < int(master.pttl(later)) <= 60_250  # the clock is extrapolated: ms off
        master.close()


def test_a_replica_without_notifications_is_configured_with_configure_redis(
    sentinel_group: SentinelGroup,
    sqlite_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    log_lines: list[str],
) -> None:
    replica = sentinel_group.replica.client(decode_responses=True)
    replica.config_set("notify-keyspace-events", "")
    try:
        start_listener(make_settings(sentinel_group.url(), sqlite_url, tmp_path / "plain"))
        name = f"replica {LOOPBACK}:{sentinel_group.replica.port}"

        def warned() -> list[str]:
            return [line for line in log_lines if name in line]

        wait_until(lambda: bool(warned()), 10, message="no warning about the replica")
        assert warned()[0].startswith("WARNING") and "failover" in warned()[0]
        assert replica.config_get("notify-keyspace-events")["notify-keyspace-events"] == ""
        cfg = make_settings(sentinel_group.url(), sqlite_url, tmp_path, configure_redis=True)
        start_listener(cfg)

        def flags() -> str:
            return str(replica.config_get("notify-keyspace-events")["notify-keyspace-events"])

        wait_until(lambda: set("Exe") <= set(flags()), 10, message="replica not configured")
    finally:
        replica.config_set("notify-keyspace-events", "Ex")
        replica.close()


def test_doctor_checks_the_master_and_every_replica(
    sentinel_group: SentinelGroup, sqlite_url: str, tmp_path: Path
) -> None:
    replica = sentinel_group.replica.client(decode_responses=True)
    replica.config_set("notify-keyspace-events", "")
    try:
        with Client(make_settings(sentinel_group.url(), sqlite_url, tmp_path)) as c:
            checks = {ch.name: ch for ch in run_checks(c.rt)}
            name = f"replica {LOOPBACK}:{sentinel_group.replica.port}"
            assert checks["sentinel"].status == "ok"
            assert f"{LOOPBACK}:{sentinel_group.master.port}" in checks["sentinel"].detail
            assert checks["notifications"].status == "ok"
            assert checks[name].status == "fail", checks[name]
            assert "failover" in checks[name].detail
            fixed = {ch.name: ch for ch in run_checks(c.rt, fix=True)}
            assert fixed[name].status == "ok", fixed[name]
        assert "E" in str(replica.config_get("notify-keyspace-events")["notify-keyspace-events"])
    finally:
        replica.config_set("notify-keyspace-events", "Ex")
        replica.close()


def test_sentinels_know_the_replica_and_the_watch_sees_the_master(
    sentinel_group: SentinelGroup, sqlite_url: str, tmp_path: Path
) -> None:
    switches: list[int] = []
    with Client(make_settings(sentinel_group.url(), sqlite_url, tmp_path)) as c:
        assert replica_addresses(c.redis) == [(LOOPBACK, sentinel_group.replica.port)]
        node: list[tuple[str, int] | None] = [None]
        watch = MasterWatch(
            c.redis, subscribed_node=lambda: node[0], on_switch=lambda: switches.append(1)
        )
        master = (LOOPBACK, sentinel_group.master.port)
        assert watch.check() == master
        assert switches == [1]  # not subscribed anywhere yet: connect now
        node[0] = master
        assert watch.check() == master
        assert switches == [1]  # on the master: nothing to do
        node[0] = (LOOPBACK, sentinel_group.replica.port)
        watch.check()
        assert switches == [1, 1]  # on a node that is not the master: move
        assert watch.switches == 0


def test_a_switch_before_the_watch_first_asks_counts_and_brings_the_settled_reconcile(
    sentinel_group: SentinelGroup, sqlite_url: str, tmp_path: Path
) -> None:
    # A `SENTINEL FAILOVER` is over before the watch's first poll (0.5 s after start): the
    # subscription's node, not the watch's empty memory, is what the master is compared with.
    moved: list[int] = []
    settled: list[int] = []
    with Client(make_settings(sentinel_group.url(), sqlite_url, tmp_path)) as c:
        old = (LOOPBACK, sentinel_group.replica.port)  # as if the sentinels had just left it
        watch = MasterWatch(
            c.redis,
            subscribed_node=lambda: old,
            on_switch=lambda: moved.append(1),
            on_settled=lambda: settled.append(1),
        )
        assert watch.check() == (LOOPBACK, sentinel_group.master.port)
        assert (moved, watch.switches) == ([1], 1)
        wait_until(lambda: watch.check() is not None and settled == [1], SETTLE_S + 5)


def test_a_sentinel_down_is_skipped(
    sentinel_group: SentinelGroup, sqlite_url: str, tmp_path: Path
) -> None:
    hosts = ",".join(f"{LOOPBACK}:{s.port}" for s in sentinel_group.sentinels)
    # A port nothing listens on first: the client asks the next sentinel.
    dead = sentinel_group.url().replace(hosts, f"{LOOPBACK}:1,{hosts}")
    with Client(make_settings(dead, sqlite_url, tmp_path)) as c:
        key = c.create("Probe.record", "skipped", ttl_s=60)
        wait_until(lambda: c.redis.exists(key) == 1, 5)


def test_connections_to_the_sentinels_do_not_pile_up(
    sentinel_group: SentinelGroup, tmp_path: Path
) -> None:
    # After a failover every thread of a listener reconnects at once, and redis-py asked the
    # sentinels once per new connection, through a path that bypassed keyexpiry's pool: each
    # sentinel's client kept as many connections as threads had asked together, and those to
    # sentinels asked while they did not know the master stayed open for good (the soak's
    # listeners: 6 to 12 connections to Redis's ports over a few failovers).
    stray = SentinelServer(
        tmp_path / "stray", config="", port=free_port(), binary=sentinel_group.master.binary
    )
    stray.start()
    try:
        hosts = ",".join(f"{LOOPBACK}:{s.port}" for s in sentinel_group.sentinels)
        # First a sentinel that watches nothing: asked first, it names no master.
        url = sentinel_group.url().replace(hosts, f"{LOOPBACK}:{stray.port},{hosts}")
        client = master_client(url, {"socket_timeout": 5})
        try:
            pool = client.connection_pool
            barrier = threading.Barrier(8)

            def connect() -> None:
                conn = pool.get_connection()
                barrier.wait(10)  # every thread holds its own connection at once
                pool.release(conn)

            threads = [threading.Thread(target=connect) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(20)
            client.ping()
            manager = pool.sentinel_manager  # type: ignore[attr-defined]
            live = {s.connection_pool.connection_kwargs["port"]: live_connections(s.connection_pool)
                    for s in manager.sentinels}  # fmt: skip
            assert live[stray.port] == 0, live
            assert sum(live.values()) == 1, live
        finally:
            close_client(client)
    finally:
        stray.stop()
