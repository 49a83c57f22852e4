"""The expiry driver: prompt events among many far-future keys, bulk paths, bursts, races."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from keyexpiry import Client, Settings, TaskRequest
from keyexpiry.bench.servers import wait_until
from keyexpiry.ledger.store import TaskStatus
from tests import sample_tasks
from tests.conftest import RedisFactory
from tests.ke import Running, make_settings, wait_status
from tests.test_security import acl_user

StartListener = Callable[[Settings], Running]

_FILL = """
for i = 1, tonumber(ARGV[1]) do
  redis.call('set', 'other:' .. i, '', 'EX', 86400)
end
return 1
"""


def _fill_far_future_keys(client: redis.Redis, count: int) -> None:
    """Keys of another application with TTLs a day away: Redis's sweep samples these."""
    client.eval(_FILL, 0, count)  # type: ignore[no-untyped-call]


def _lateness_ms(c: Client, keys: list[str]) -> list[int]:
    rows = c.store.get_many(keys)
    return [rows[k].started_at_ms - rows[k].due_at_ms for k in keys]  # type: ignore[operator]


def test_a_task_hidden_among_far_future_keys_fires_promptly_with_the_driver(
    redis_factory: RedisFactory, db_url: str, tmp_path: Path, start_listener: StartListener
) -> None:
    server = redis_factory()
    cfg = make_settings(server.url(), db_url, tmp_path)
    with Client(cfg) as c:
        _fill_far_future_keys(c.redis, 100_000)
        running = start_listener(cfg)
        # Created after the listener read its window: they reach the driver by the wake channel.
        keys = [c.create("Probe.record", f"hidden{i}", ttl_ms=300 + 20 * i) for i in range(10)]
        for key in keys:
            wait_status(c, key, TaskStatus.DONE, timeout_s=10)
        # Redis alone finds these among 100k keys in minutes (next test); 3 s leaves room for
        # a stalled machine.
        assert max(_lateness_ms(c, keys)) < 3000
        assert running.listener.driver.lookups >= 10


def test_without_the_driver_redis_alone_announces_hidden_keys_late(
    redis_factory: RedisFactory, db_url: str, tmp_path: Path, start_listener: StartListener
) -> None:
    server = redis_factory()
    # No driver, and the overdue safety net pushed out of the way: Redis alone.
    cfg = make_settings(server.url(), db_url, tmp_path, driver=False, stuck_after_s=60)
    with Client(cfg) as c:
        _fill_far_future_keys(c.redis, 100_000)
        start_listener(cfg)
        keys = [c.create("Probe.record", f"hidden{i}", ttl_ms=200) for i in range(10)]
        control = c.create("Probe.record", "control", ttl_ms=1500)
        wait_until(lambda: c.clock.now_ms() > c.store.get(control).due_at_ms, 5)  # type: ignore[union-attr]
        c.redis.exists(control)  # a lookup forces this one, as the driver would
        wait_status(c, control, TaskStatus.DONE)
        # 1.3 s after their due time, Redis's sampling sweep has found few or none of them.
        rows = c.store.get_many(keys)
        assert sum(r.status is TaskStatus.DONE for r in rows.values()) < len(keys)


def test_tasks_created_before_the_listener_starts_fire_on_time(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    # Due after the listener is surely up (a start under load took over a second): on time
    # means by the driver's start-up window, not by start-up reconciliation.
    keys = client.create_many(
        TaskRequest("Probe.record", (f"early{i}",), ttl_ms=3_000 + i) for i in range(20)
    )
    start_listener(settings)
    for key in keys:
        wait_status(client, key, TaskStatus.DONE)
    assert max(_lateness_ms(client, keys)) < 500


def test_bulk_create_and_bulk_cancel(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    keys = client.create_many(
        TaskRequest("Probe.record", (f"bulk{i}",), ttl_ms=4000) for i in range(2000)
    )
    assert len(keys) == 2000 and client.store.count_pending() == 2000
    assert client.redis.exists(*keys) == 2000
    cancelled = client.cancel_keys(keys[::2])
    assert sorted(cancelled) == sorted(keys[::2])
    assert client.redis.exists(*keys[::2]) == 0
    start_listener(settings)
    wait_until(lambda: client.store.counts().get("done", 0) == 1000, 20)
    assert sum(sample_tasks.CALLS.values()) == 1000
    assert all(sample_tasks.CALLS[k] == 0 for k in keys[::2])


def test_driver_lookups_racing_a_fast_sweep_never_run_a_task_twice(
    redis_factory: RedisFactory, db_url: str, tmp_path: Path, start_listener: StartListener
) -> None:
    server = redis_factory(args=["--hz", "500"])  # Redis sweeps as hard as it can
    cfg = make_settings(server.url(), db_url, tmp_path)
    with Client(cfg) as c:
        first, second = start_listener(cfg), start_listener(cfg)
        keys = c.create_many(
            TaskRequest("Probe.record", (f"race{i}",), ttl_ms=200 + i % 300) for i in range(1500)
        )
        wait_until(lambda: c.store.counts().get("done", 0) == 1500, 30)
        assert all(sample_tasks.CALLS[k] == 1 for k in keys)
        # One listener drives; the other does not repeat its lookups.
        drivers = [first.listener.driver, second.listener.driver]
        assert sum(d.is_leader for d in drivers) == 1


def test_a_burst_due_in_the_same_instant_all_runs_once(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    start_listener(settings.replace(concurrency=16))
    keys = client.create_many(
        TaskRequest("Probe.record", (f"burst{i}",), ttl_ms=300) for i in range(5000)
    )
    wait_until(lambda: client.store.counts().get("done", 0) == 5000, 60)
    assert len(sample_tasks.CALLS) == 5000 and set(sample_tasks.CALLS.values()) == {1}
    assert set(keys) == set(sample_tasks.CALLS)


def test_tasks_whose_wake_was_lost_in_a_subscription_gap_fire_on_time(
    redis_factory: RedisFactory, db_url: str, tmp_path: Path, start_listener: StartListener
) -> None:
    """Found by the soak: a task created while the driving listener was not subscribed (its
    pub/sub connection killed, a failover) and due inside the window the driver had read had no
    wake message to reach the driver, and waited for Redis's own sweep or the overdue check
    (up to 25 s in the soak). After a gap the driver reads its window again."""
    server = redis_factory()
    admin = server.client()
    # The overdue safety net pushed out of the way: only the driver can make them prompt.
    cfg = make_settings(acl_user(server), db_url, tmp_path, stuck_after_s=60)
    with Client(make_settings(server.url(), db_url, tmp_path)) as c:
        _fill_far_future_keys(c.redis, 100_000)
        running = start_listener(cfg)
        wait_until(lambda: running.listener.driver.is_leader, 10, message="never drove")
        admin.execute_command("ACL", "SETUSER", "ke", "off")
        admin.execute_command("CLIENT", "KILL", "USER", "ke")
        wait_until(lambda: not running.listener.subscribed.is_set(), 5)
        keys = [c.create("Probe.record", f"gap{i}", ttl_ms=1500 + 100 * i) for i in range(10)]
        admin.execute_command("ACL", "SETUSER", "ke", "on")
        wait_until(lambda: running.listener.subscribed.is_set(), 10)
        for key in keys:
            wait_status(c, key, TaskStatus.DONE, timeout_s=15)
        assert max(_lateness_ms(c, keys)) < 1000
    admin.close()


def test_a_task_committed_while_the_driver_reads_its_window_fires_on_time(
    redis_factory: RedisFactory, db_url: str, tmp_path: Path, start_listener: StartListener
) -> None:
    """Found by the soak: a task committed after a window read took its snapshot, with its wake
    arriving before the read ended, was in neither: the wake was dropped as beyond the old
    horizon ("the read finds it"), and the next read starts at the new one. Tasks created as a
    new driver took over (its first read covers everything) waited up to 25 s."""
    server = redis_factory()
    cfg = make_settings(server.url(), db_url, tmp_path, stuck_after_s=60, lease_check_s=60)
    with Client(cfg) as c:
        _fill_far_future_keys(c.redis, 100_000)
        running = start_listener(cfg)
        driver = running.listener.driver
        wait_until(lambda: driver.is_leader, 10, message="never drove")
        store, note = driver.store, driver.note
        noted = threading.Event()
        raced: list[str] = []

        def noting(items: Any) -> None:
            note(items)
            noted.set()

        class Racing:
            """The real ledger, a task committed (and its wake heard) inside one window read."""

            def __getattr__(self, name: str) -> Any:
                return getattr(store, name)

            def upcoming(self, **kw: Any) -> Any:
                rows = store.upcoming(**kw)  # the read's snapshot: before the task
                if not raced:
                    noted.clear()
                    raced.append(c.create("Probe.record", "raced", ttl_ms=1500))
                    assert noted.wait(5), "the wake never reached the driver"
                return rows

        running.listener.router._note_due = noting  # where the subscription's wakes go
        driver.store = Racing()  # type: ignore[assignment]
        driver.reread()
        wait_until(lambda: bool(raced), 5, message="no window read")
        wait_status(c, raced[0], TaskStatus.DONE, timeout_s=15)
        assert max(_lateness_ms(c, raced)) < 1000
