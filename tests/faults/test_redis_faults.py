"""Redis misbehaving while tasks are due: every task still runs, exactly once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from keyexpiry import Client, Settings, TaskRequest
from keyexpiry.bench.servers import RedisServer, wait_until
from keyexpiry.ledger.store import TaskStatus
from tests.conftest import RedisFactory
from tests.ke import Running, make_settings, wait_status
from tests.reliability import Verdict

pytestmark = pytest.mark.faults
StartListener = Callable[[Settings], Running]


def _setup(
    redis_factory: RedisFactory, db_url: str, tmp_path: Path, args: Sequence[str] = (), **kw: object
) -> tuple[RedisServer, Settings]:
    server = redis_factory(args=args)
    return server, make_settings(server.url(), db_url, tmp_path, **kw)


def test_subscriber_connection_killed_while_tasks_are_due(
    redis_factory: RedisFactory,
    db_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    """Scenario 1: `CLIENT KILL TYPE pubsub` every 250 ms while 20 tasks fall due over 2 s;
    events published while the subscriber reconnects are lost."""
    server, cfg = _setup(redis_factory, db_url, tmp_path)
    with Client(cfg) as c:
        running = start_listener(cfg)
        keys = c.create_many(
            TaskRequest("Probe.record", (f"kill{i}",), ttl_ms=200 + 100 * i) for i in range(20)
        )
        last_due_ms = c.store.get(keys[-1]).due_at_ms  # type: ignore[union-attr]
        kills = 0
        while (now_ms := c.clock.now_ms()) < last_due_ms + 250:
            kills += int(c.redis.client_kill_filter(_type="pubsub"))
            wait_until(lambda n=now_ms: c.clock.now_ms() >= n + 250, 1, interval_s=0.005)
        assert kills >= 3  # a kill finds no subscriber while the listener reconnects
        verdict.check(c, keys, since_ms=c.clock.now_ms())
        assert running.listener.gaps >= 1
    assert server.running


def test_redis_restarted_empty(
    redis_factory: RedisFactory,
    db_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    """Scenario 3: Redis without persistence stopped while tasks fall due, and started empty:
    every task key is gone. The reconnect re-arms the future ones and runs the due ones."""
    server, cfg = _setup(redis_factory, db_url, tmp_path)
    with Client(cfg) as c:
        start_listener(cfg)
        keys = c.create_many(
            TaskRequest("Probe.record", (f"empty{i}",), ttl_ms=200 + 100 * i) for i in range(20)
        )
        c.redis.set("marker", b"")
        server.stop()
        wait_until(lambda: c.clock.now_ms() > c.store.get(keys[5]).due_at_ms, 5)  # type: ignore[union-attr]
        server.start()
        assert c.redis.exists("marker") == 0  # it did start empty
        verdict.check(c, keys, since_ms=c.clock.now_ms())


@pytest.mark.parametrize(
    "persistence",
    [["--appendonly", "yes"], ["--save", "1 1"]],
    ids=["aof", "rdb"],
)
def test_redis_restarted_with_persistence(
    redis_factory: RedisFactory,
    db_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
    persistence: list[str],
) -> None:
    server, cfg = _setup(redis_factory, db_url, tmp_path, persistence)
    with Client(cfg) as c:
        start_listener(cfg)
        keys = c.create_many(
            TaskRequest("Probe.record", (f"persist{i}",), ttl_ms=200 + 100 * i) for i in range(20)
        )
        server.stop(save=True)
        wait_until(lambda: c.clock.now_ms() > c.store.get(keys[5]).due_at_ms, 5)  # type: ignore[union-attr]
        # Expired keys in the file fire as Redis loads it, maybe before the listener is back.
        server.start()
        verdict.check(c, keys)


def test_redis_stalled_across_due_times(
    redis_factory: RedisFactory,
    db_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    server, cfg = _setup(redis_factory, db_url, tmp_path)
    with Client(cfg) as c:
        start_listener(cfg)
        keys = c.create_many(
            TaskRequest("Probe.record", (f"stall{i}",), ttl_ms=100 + 50 * i) for i in range(20)
        )
        server.pause()
        try:
            wait_until(lambda: c.clock.now_ms() > c.store.get(keys[-1]).due_at_ms + 500, 10)  # type: ignore[union-attr]
        finally:
            server.resume()
        verdict.check(c, keys, since_ms=c.clock.now_ms())


def test_notifications_switched_off_then_on(
    redis_factory: RedisFactory,
    db_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    server, cfg = _setup(redis_factory, db_url, tmp_path)
    admin = server.client()
    with Client(cfg) as c:
        running = start_listener(cfg)
        admin.config_set("notify-keyspace-events", "")
        keys = c.create_many(
            TaskRequest("Probe.record", (f"quiet{i}",), ttl_ms=100 + 20 * i) for i in range(10)
        )
        # The canary notices, and the ledger drives due tasks while events are off.
        for key in keys:
            wait_status(c, key, TaskStatus.DONE, timeout_s=20)
        assert running.listener.events_arriving is False
        admin.config_set("notify-keyspace-events", "Ex")
        wait_until(lambda: running.listener.events_arriving, 20)
        later = c.create("Probe.record", "after", ttl_ms=100)
        verdict.check(c, [*keys, later])
    admin.close()


def test_config_command_disabled(
    redis_factory: RedisFactory,
    db_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    _, cfg = _setup(
        redis_factory, db_url, tmp_path, ["--rename-command", "CONFIG", "CONFIG_hidden_b7"]
    )
    with Client(cfg) as c:
        start_listener(cfg)  # warns that CONFIG cannot be read, and works
        keys = [c.create("Probe.record", f"noconfig{i}", ttl_ms=100) for i in range(3)]
        verdict.check(c, keys)


def test_flushall_with_tasks_and_sentinels_pending(
    redis_factory: RedisFactory,
    db_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    _, cfg = _setup(redis_factory, db_url, tmp_path, sentinel_count=4, sentinel_interval_s=60)
    with Client(cfg) as c:
        start_listener(cfg)
        keys = c.create_many(
            TaskRequest("Probe.record", (f"flushed{i}",), ttl_ms=1500 + 10 * i) for i in range(10)
        )
        c.redis.flushall()
        verdict.check(c, keys)


@pytest.mark.parametrize("tamper", ["delete", "rename", "persist"])
def test_a_task_key_tampered_with_by_someone_else(
    client: Client,
    settings: Settings,
    start_listener: StartListener,
    verdict: Verdict,
    tamper: str,
) -> None:
    start_listener(settings)
    # Far enough off that a loaded machine still tampers with the key before it expires.
    key = client.create("Probe.record", f"tampered-{tamper}", ttl_ms=1500)
    if tamper == "delete":
        client.redis.delete(key)
    elif tamper == "rename":
        client.redis.rename(key, "someone-else")
    else:
        client.redis.persist(key)
    verdict.check(client, [key])


def test_eviction_under_volatile_lru(
    redis_factory: RedisFactory,
    db_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    server, cfg = _setup(
        redis_factory,
        db_url,
        tmp_path,
        ["--maxmemory", "2mb", "--maxmemory-policy", "volatile-lru"],
    )
    with Client(cfg) as c:
        start_listener(cfg)
        keys = c.create_many(
            TaskRequest("Probe.record", (f"evict{i}",), ttl_ms=1500 + i) for i in range(200)
        )
        filler = server.client()
        pipe = filler.pipeline(transaction=False)
        for i in range(3000):
            pipe.set(f"filler:{i}", b"x" * 1000, ex=3600)
        try:
            pipe.execute()
        except Exception:
            pass  # past maxmemory Redis may refuse writes: eviction is what matters
        filler.close()
        verdict.check(c, keys, timeout_s=30)


def test_a_flushall_is_noticed_by_every_listener_within_seconds(
    redis_factory: RedisFactory,
    db_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    # Before the marker, only a listener that happened to read the vanished sentinels (once per
    # canary interval) reconciled; every other listener's share of the flushed tasks waited for
    # its overdue check (`stuck_after_s`, then every `lease_check_s`): the soak's 15 s tail.
    # Here both are a minute, so only the marker can make the tasks run in time.
    _, cfg = _setup(
        redis_factory,
        db_url,
        tmp_path,
        sentinel_count=4,
        sentinel_interval_s=60,
        canary_interval_s=60,
        lease_check_s=60,
        stuck_after_s=60,
    )
    with Client(cfg) as c:
        listeners = [start_listener(cfg).listener for _ in range(2)]
        keys = c.create_many(
            TaskRequest("Probe.record", (f"flushed{i}",), ttl_ms=500 + 50 * i) for i in range(40)
        )
        c.redis.flushall()
        verdict.check(c, keys, timeout_s=20)
        rows = c.store.get_many(keys)
        late_ms = sorted(r.started_at_ms - r.due_at_ms for r in rows.values() if r.started_at_ms)
        assert late_ms[-1] < 10_000, late_ms[-5:]
        assert all(lst.markers_lost >= 1 for lst in listeners)
