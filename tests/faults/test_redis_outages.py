"""Redis refusing or failing the listener: ACL lockouts, stalls, demotion to replica, eviction.

Each scenario ends with the verdict: every task done exactly once, none lost.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from loguru import logger

from keyexpiry import Client, Settings, TaskRequest
from keyexpiry.bench.servers import HAProxy, wait_until
from keyexpiry.errors import RedisUnavailableError
from keyexpiry.keys import expired_channel
from keyexpiry.ledger.store import TaskStatus
from keyexpiry.ops.doctor import run_checks
from keyexpiry.redis.server import REPLICA_PROBLEM
from keyexpiry.runner.dispatch import Dispatcher
from tests.conftest import RedisFactory
from tests.ke import Running, make_settings
from tests.reliability import Verdict
from tests.test_security import acl_user

pytestmark = pytest.mark.faults
StartListener = Callable[[Settings], Running]


@pytest.fixture
def log_lines() -> Iterator[list[str]]:
    """Every loguru line written during the test, as `LEVEL message`."""
    lines: list[str] = []
    sink = logger.add(lines.append, level="DEBUG", format="{level} {message}", diagnose=False)
    yield lines
    logger.remove(sink)


def _all_done(c: Client, keys: list[str]) -> bool:
    rows = c.store.get_many(keys)
    return len(rows) == len(keys) and all(r.status is TaskStatus.DONE for r in rows.values())


@pytest.mark.parametrize(
    ("db_url", "lockout_s"),
    [pytest.param("sqlite", 3, id="sqlite-3s"), pytest.param("mysql", 30, id="mariadb-30s")],
    indirect=["db_url"],
)
def test_acl_user_locked_out(
    redis_factory: RedisFactory,
    db_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
    log_lines: list[str],
    lockout_s: int,
) -> None:
    server = redis_factory()
    admin = server.client()
    with Client(make_settings(server.url(), db_url, tmp_path)) as c:
        running = start_listener(make_settings(acl_user(server), db_url, tmp_path))
        span_ms = lockout_s * 1000 - 1000
        # Locked out first (the creating client is another user): a stall between creating
        # and locking out could otherwise let the first task run before the lockout.
        locked_at = c.clock.now_ms()
        admin.execute_command("ACL", "SETUSER", "ke", "off")
        admin.execute_command("CLIENT", "KILL", "USER", "ke")
        keys = c.create_many(
            TaskRequest("Probe.record", (f"acl{i}",), ttl_ms=500 + span_ms * i // 9)
            for i in range(10)
        )
        wait_until(lambda: running.listener.problem is not None, 10)
        wait_until(lambda: c.clock.now_ms() >= locked_at + lockout_s * 1000, lockout_s + 5)
        assert running.thread.is_alive()
        assert not any(r.status is TaskStatus.DONE for r in c.store.get_many(keys).values())
        admin.execute_command("ACL", "SETUSER", "ke", "on")
        row = verdict.check(c, keys, since_ms=c.clock.now_ms())
    admin.close()
    assert running.thread.is_alive()
    assert row.recover_s < 5  # backoff is capped at reconnect_max_s (0.5 s here)
    refused = [line for line in log_lines if "refused the credentials" in line]
    assert refused and refused[0].startswith("ERROR"), log_lines[-20:]
    assert running.listener.problem is None  # cleared once the listener subscribed again
    # The new subscription's first connect is not mistaken for a silent redis-py reconnect.
    assert not [line for line in log_lines if "after a dropped connection" in line]


@pytest.mark.parametrize(
    ("query", "stall_s"),
    [
        pytest.param("", 2, id="within_timeout"),
        # `socket_timeout=1` in the URL (it wins over keyexpiry's 10 s) makes the stall outlast
        # the listener's reads and redis-py's retries, as a long stall does in production.
        pytest.param("?socket_timeout=1", 4, id="past_timeout"),
    ],
)
def test_redis_busy_in_debug_sleep_across_due_times(
    redis_factory: RedisFactory,
    db_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
    query: str,
    stall_s: int,
) -> None:
    server = redis_factory(args=["--enable-debug-command", "yes"])
    with Client(make_settings(server.url(), db_url, tmp_path)) as c:
        running = start_listener(make_settings(server.url() + query, db_url, tmp_path))
        keys = c.create_many(
            TaskRequest("Probe.record", (f"sleep{i}",), ttl_ms=300 + 80 * i) for i in range(20)
        )
        sleeper = server.client(socket_timeout=30)
        wait_until(lambda: c.clock.now_ms() >= c.store.get(keys[0]).due_at_ms - 100, 5)  # type: ignore[union-attr]
        started = time.monotonic()
        sleeper.execute_command("DEBUG", "SLEEP", str(stall_s))  # all due times pass meanwhile
        assert time.monotonic() - started >= stall_s - 0.1
        sleeper.close()
        verdict.check(c, keys, since_ms=c.clock.now_ms())
        assert running.thread.is_alive()


def test_a_listener_cut_off_from_redis_hands_its_share_to_its_peer(
    redis_factory: RedisFactory,
    mysql_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
    log_lines: list[str],
) -> None:
    """Found by the soak: a listener whose network to Redis stalls (TCP open, nothing flows)
    but whose ledger answers kept its share of the keys, so its share of the due tasks waited
    for the stall to end. It must notice the silence (an unanswered PING), announce no
    classes, and its peer must run that share meanwhile: within 3 s of their due times (an
    unanswered PING after 0.5 s of silence and 1 s of patience, the cut listener beats at once,
    its peer takes the share at its next beat; it took 4 s and two beats before, 5-7 s in all)."""
    server = redis_factory()
    proxy = HAProxy(tmp_path / "haproxy", servers=[("redis", server.port)], check="redis-master")
    proxy.start()
    try:
        proxy.wait_up()
        direct = start_listener(make_settings(server.url(), mysql_url, tmp_path))
        cut = start_listener(make_settings(proxy.redis_url(), mysql_url, tmp_path))
        wait_until(
            lambda: (
                direct.listener.fleet.partition.peers == 1
                and cut.listener.fleet.partition.peers == 1
            ),
            10,
            message="the two listeners never shared the keys",
        )
        with Client(make_settings(server.url(), mysql_url, tmp_path)) as c:
            stall_s = 16.0
            proxy.pause()
            stalled_at = time.monotonic()
            keys = c.create_many(
                TaskRequest("Probe.record", (f"cut{i}",), ttl_ms=500 + 200 * i) for i in range(60)
            )
            # Every task (the last due 12.3 s in) has run 2 s before the stall ends, though
            # half of them were the cut listener's share when the stall began.
            last_due_ms = max(r.due_at_ms for r in c.store.get_many(keys).values())
            wait_until(
                lambda: _all_done(c, keys),
                max(0.1, stall_s - 2 - (time.monotonic() - stalled_at)),
                message="the cut listener's share waited for the stall to end",
            )
            assert last_due_ms < c.clock.now_ms()
            rows = c.store.get_many(keys).values()
            late_ms = max(r.started_at_ms - r.due_at_ms for r in rows if r.started_at_ms)
            assert late_ms <= 3000, f"the cut listener's share ran up to {late_ms} ms late"
            assert cut.listener.fleet.away
            assert cut.listener.status()["away"] is True
            proxy.resume()
            verdict.check(c, keys, fault_at_ms=c.clock.now_ms())
            wait_until(lambda: not cut.listener.fleet.away, 20, message="it never came back")
            assert cut.listener.subscribed.is_set()
            later = c.create_many(
                TaskRequest("Probe.record", (f"back{i}",), ttl_ms=300 + 50 * i) for i in range(20)
            )
            verdict.check(c, later)
    finally:
        proxy.resume()
        proxy.stop()
    assert any("did not answer a PING" in line for line in log_lines), log_lines[-20:]
    assert any("peers take this listener's share" in line for line in log_lines)


def test_master_demoted_to_replica_while_tasks_are_due(
    redis_factory: RedisFactory,
    db_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
    log_lines: list[str],
) -> None:
    server = redis_factory()
    other = redis_factory()
    cfg = make_settings(server.url(), db_url, tmp_path)
    admin = server.client()
    with Client(cfg) as c:
        running = start_listener(cfg)
        keys = c.create_many(
            TaskRequest("Probe.record", (f"demoted{i}",), ttl_ms=600 + 100 * i) for i in range(10)
        )
        # The full sync from `other` also wipes every task key: only the ledger knows them now.
        admin.execute_command("REPLICAOF", "127.0.0.1", str(other.port))
        wait_until(lambda: _all_done(c, keys), 15, message="due tasks did not run from the ledger")
        status = running.listener.status()
        assert status["problem"] and "replica" in str(status["problem"])
        assert status["events_arriving"] is False
        assert running.thread.is_alive()
        checks = {ch.name: ch for ch in run_checks(dataclasses.replace(c.rt, redis=admin))}
        assert checks["notifications"].status == "fail"
        assert "replica" in checks["notifications"].detail
        with pytest.raises(RedisUnavailableError, match="recorded in the ledger"):
            c.create("Probe.record", "waiting", ttl_s=60)  # the replica refuses its key
        admin.execute_command("REPLICAOF", "NO", "ONE")
        wait_until(lambda: running.listener.events_arriving, 10)
        # The reconnect reconciled: the refused key is set from the ledger.
        wait_until(lambda: 55_000 < int(admin.pttl("Probe@record@waiting")) <= 60_000, 10)
        later = c.create_many(
            TaskRequest("Probe.record", (f"promoted{i}",), ttl_ms=300 + 100 * i) for i in range(5)
        )
        verdict.check(c, [*keys, *later], since_ms=c.clock.now_ms())
    admin.close()
    assert running.listener.problem is None
    errors = [line for line in log_lines if line.startswith("ERROR")]
    assert sum(REPLICA_PROBLEM in line for line in errors) == 1, errors
    # A canary in flight at the moment of demotion may be reported lost first; nothing else.
    assert all(REPLICA_PROBLEM in e or "events are not arriving" in e for e in errors), errors


def test_evicted_task_keys_are_rearmed_from_the_evicted_event(
    redis_factory: RedisFactory,
    db_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
    log_lines: list[str],
) -> None:
    server = redis_factory(args=["--maxmemory", "2mb", "--maxmemory-policy", "volatile-lru"])
    # The overdue sweep and the canary (whose degraded mode also runs overdue rows) far beyond
    # the verdict's wait: only the `evicted` path can save these tasks. configure_redis adds
    # the `e` that the server's `Ex` lacks.
    cfg = make_settings(
        server.url(),
        db_url,
        tmp_path,
        stuck_after_s=600,
        canary_interval_s=600,
        configure_redis=True,
    )
    with Client(cfg) as c:
        running = start_listener(cfg)
        keys = c.create_many(
            TaskRequest("Probe.record", (f"evict{i}",), ttl_ms=1500 + i) for i in range(200)
        )
        filler = server.client()
        pipe = filler.pipeline(transaction=False)
        for i in range(3000):
            pipe.set(f"filler:{i}", b"x" * 1000, ex=3600)
        pipe.execute(raise_on_error=False)  # past maxmemory Redis may refuse some writes
        evicted = int(filler.info("stats")["evicted_keys"])
        flags = filler.config_get("notify-keyspace-events")["notify-keyspace-events"]
        filler.close()
        assert set("Exe") <= set(flags)
        assert evicted > 0
        wait_until(lambda: running.listener.evicted > 0, 10, message="no task key was evicted")
        verdict.check(c, keys, timeout_s=20)
    # The filler keys evicted alongside are the application's business: not one line on them.
    assert not [line for line in log_lines if "filler:" in line or "ignored key" in line]


class _FallsDueDuringClaim:
    """A clock just before `due_ms` for the claim, just after it from then on."""

    def __init__(self, due_ms: int) -> None:
        self.due_ms = due_ms
        self.calls = 0

    def now_ms(self) -> int:
        self.calls += 1
        return self.due_ms - 1 if self.calls == 1 else self.due_ms + 1


def test_a_task_key_lost_as_its_task_falls_due_during_the_claim_is_rearmed(
    client: Client, settings: Settings
) -> None:
    """The eviction scenario's race, made deterministic: an evicted key is submitted, the claim
    finds the task not yet due, and by the check after it the task is due. Its key is gone, so
    unless it is set again nothing announces the task until the overdue sweep."""
    key = client.create("Probe.record", "falls-due", ttl_s=60)
    row = client.store.get(key)
    assert row is not None
    client.redis.delete(key)  # evicted
    dispatcher = Dispatcher(
        dataclasses.replace(client.rt, clock=_FallsDueDuringClaim(row.due_at_ms), owner="test")
    )
    events = client.redis.pubsub()  # type: ignore[no-untyped-call]
    events.subscribe(expired_channel(client.rt.db))
    wait_until(lambda: events.get_message(timeout=0.1) is None, 5)  # the subscribe reply
    heard: list[bytes] = []

    def announced() -> bool:
        # Set again: due by the clock that re-arms it, it is armed already expired and
        # announced at once (a listener's subscription hears it); else it waits with a TTL.
        while (msg := events.get_message(timeout=0.01)) is not None:
            if msg["type"] == "message":
                heard.append(msg["data"])
        return key.encode() in heard or int(client.redis.pttl(key)) > 0

    dispatcher.start()
    try:
        dispatcher.submit([key])
        wait_until(announced, 5, message="the key was not set again")
    finally:
        dispatcher.stop(5)
        events.close()
    assert client.store.get(key).status is TaskStatus.PENDING  # type: ignore[union-attr]
