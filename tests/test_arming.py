"""Setting task keys in Redis: plain pipeline for a few, one script per chunk for many."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster

from keyexpiry import Client, TaskRequest
from keyexpiry.bench.servers import wait_until
from keyexpiry.keys import MAX_KEY_BYTES, wake_channel
from keyexpiry.redis.arming import WAKE_MAX_BYTES, arm_keys, parse_wake
from keyexpiry.redis.cluster import cluster_client, parse_cluster_url
from keyexpiry.settings import Settings
from tests.ke import make_settings
from tests.sample_tasks import Probe


@pytest.mark.parametrize("n", [3, 2500], ids=["pipeline", "script"])
def test_every_key_expires_exactly_at_its_due_time(redis_url: str, n: int) -> None:
    r = redis.Redis.from_url(redis_url)
    now_ms = int(r.time()[0]) * 1000
    items = [(f"Probe@record@arm{i}", now_ms + 60_000 + i) for i in range(n)]
    arm_keys(r, items, now_ms, Settings(wake_ahead_s=120))
    pipe = r.pipeline(transaction=False)
    for key, _ in items:
        pipe.execute_command("PEXPIRETIME", key)
    assert pipe.execute() == [due for _, due in items]
    r.close()


def _missing_armed_over(client: redis.Redis | RedisCluster, n: int) -> None:
    """`arm_keys(missing=True)` over `n` keys, one in three set meanwhile at another due (a
    reschedule): those keep it, the others are armed; a past due is armed and expired too."""
    now_ms = int(client.time()[0]) * 1000  # type: ignore[index]
    prefix = f"Probe@record@miss{n}-"
    items = [(f"{prefix}{i}", now_ms + 60_000 + i) for i in range(n)]
    moved = {key: now_ms + 7_200_000 + i for i, (key, _) in enumerate(items) if i % 3 == 0}
    for key, due_ms in moved.items():
        client.set(key, "", pxat=due_ms)
    arm_keys(client, items, now_ms, Settings(wake_ahead_s=120), missing=True)  # type: ignore[arg-type]
    for key, due_ms in items:
        assert client.execute_command("PEXPIRETIME", key) == moved.get(key, due_ms), key


def _expired_total(client: redis.Redis) -> int:
    return int(client.info("stats")["expired_keys"])


@pytest.mark.parametrize("n", [1, 3], ids=["one", "pipeline"])
def test_a_key_found_missing_and_already_due_is_armed_and_expired_at_once(
    redis_url: str, n: int
) -> None:
    r = redis.Redis.from_url(redis_url)
    try:
        now_ms = int(r.time()[0]) * 1000
        items = [(f"Probe@record@missing-past{n}-{i}", now_ms - 10) for i in range(n)]
        before = _expired_total(r)
        arm_keys(r, items, now_ms, Settings(), missing=True)
        assert _expired_total(r) - before >= n  # set, then expired by its lookup
        assert not any(r.exists(k) for k, _ in items)
    finally:
        r.close()


@pytest.mark.parametrize("n", [1, 3, 2500], ids=["one", "pipeline", "script"])
def test_keys_found_missing_are_armed_unless_set_meanwhile(redis_url: str, n: int) -> None:
    r = redis.Redis.from_url(redis_url)
    try:
        _missing_armed_over(r, n)
    finally:
        r.close()


def test_keys_found_missing_are_armed_unless_set_meanwhile_on_a_cluster(cluster_url: str) -> None:
    client = cluster_client(parse_cluster_url(cluster_url), {})
    try:
        _missing_armed_over(client, 300)  # one plain pipeline per primary
    finally:
        client.close()


def test_one_key_due_beyond_the_wake_horizon_is_set_and_announces_nothing(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    sub = r.pubsub()
    sub.subscribe(wake_channel(0, ""))
    wait_until(lambda: sub.get_message(timeout=0.1) is None, 5)  # drain the subscribe reply
    now_ms = int(r.time()[0]) * 1000
    settings = Settings(wake_ahead_s=120)
    arm_keys(r, [("Probe@record@far", now_ms + 3_600_000)], now_ms, settings)
    assert r.execute_command("PEXPIRETIME", "Probe@record@far") == now_ms + 3_600_000
    # A key due soon is announced; had the far one been, its message would have come first.
    arm_keys(r, [("Probe@record@near", now_ms + 60_000)], now_ms, settings)
    messages: list[bytes] = []

    def got_one() -> bool:
        msg = sub.get_message(timeout=0.1)
        if msg and msg["type"] == "message":
            messages.append(msg["data"])
        return bool(messages)

    wait_until(got_one, 5)
    assert messages == [f"{now_ms + 60_000} Probe@record@near".encode()]
    sub.close()
    r.close()


def test_a_refused_single_set_raises_redis_s_error_and_leaves_the_pool_clean(
    redis_url: str,
) -> None:
    # The single key goes straight on a pooled connection; an error reply must surface as
    # redis-py's own error (through its ordinary path) and leave no reply behind on that
    # connection for the next command to read.
    r = redis.Redis.from_url(redis_url)
    admin = redis.Redis.from_url(redis_url)
    now_ms = int(r.time()[0]) * 1000
    settings = Settings(wake_ahead_s=120)
    arm_keys(r, [("Probe@record@before", now_ms + 3_600_000)], now_ms, settings)
    old = admin.config_get("maxmemory*")
    try:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            arm_keys(r, [("Probe@record@refused", now_ms + 3_600_000)], now_ms, settings)
    finally:
        admin.config_set("maxmemory", old["maxmemory"])
        admin.config_set("maxmemory-policy", old["maxmemory-policy"])
    arm_keys(r, [("Probe@record@after", now_ms + 3_600_001)], now_ms, settings)
    assert r.execute_command("PEXPIRETIME", "Probe@record@after") == now_ms + 3_600_001
    assert r.exists("Probe@record@refused") == 0
    assert r.get("Probe@record@after") == b""
    r.close()
    admin.close()


def test_keys_already_due_expire_at_once_as_expired_and_the_rest_wake_the_driver(
    redis_url: str,
) -> None:
    r = redis.Redis.from_url(redis_url)
    sub = r.pubsub()
    sub.subscribe("__keyevent@0__:expired", wake_channel(0, ""))
    wait_until(lambda: sub.get_message(timeout=0.1) is None, 5)  # drain subscribe replies
    now_ms = int(r.time()[0]) * 1000
    past = [(f"Probe@record@past{i}", now_ms - 1000 - i) for i in range(5)]
    future = [(f"Probe@record@soon{i}", now_ms + 60_000 + i) for i in range(100)]
    arm_keys(r, past + future, now_ms, Settings(wake_ahead_s=120))
    expired: set[str] = set()
    woken: set[str] = set()

    def got_all() -> bool:
        msg = sub.get_message(timeout=0.1)
        if msg and msg["type"] == "message":
            data = msg["data"].decode()
            if msg["channel"].startswith(b"__keyevent"):
                expired.add(data)
            else:
                woken.update(line.partition(" ")[2] for line in data.split("\n"))
        return len(expired) == len(past) and len(woken) == len(future)

    wait_until(got_all, 5)
    assert expired == {k for k, _ in past}
    assert woken == {k for k, _ in future}
    assert r.exists(*(k for k, _ in future)) == len(future)
    sub.close()
    r.close()


def test_a_wake_message_yields_its_well_formed_lines_only() -> None:
    long_key = "Probe@record@" + "x" * MAX_KEY_BYTES
    payload = "\n".join(["5 Probe@record@a", "x Probe@record@b", "² Probe@record@c", "7", "",
                         f"9 {long_key}", "11 Probe@record@d"])  # fmt: skip
    expected = [("Probe@record@a", 5), ("Probe@record@d", 11)]
    assert list(parse_wake(payload.encode())) == expected
    assert list(parse_wake(payload)) == expected  # "²" is a digit int() refuses


def test_a_wake_message_longer_than_keyexpiry_sends_is_not_read() -> None:
    line = b"5 Probe@record@a\n"
    assert list(parse_wake(line * (WAKE_MAX_BYTES // len(line)))) != []
    assert list(parse_wake(line * (WAKE_MAX_BYTES // len(line) + 1))) == []


def test_a_key_due_now_by_a_clock_ahead_of_redis_s_expires_at_once_not_at_redis_s_sweep(
    redis_url: str,
) -> None:
    # A run-now task (ttl 0) is due the very millisecond it is created, and the creator's clock
    # may be a hair ahead of Redis's: armed at its due time, its lookup found it alive and it
    # waited for Redis's sweep (up to 100 ms at the default hz; run-now p50 was 40 ms). Its
    # expiry time is set in the past instead. A sweep once a second makes a miss plain.
    r = redis.Redis.from_url(redis_url)
    hz = r.config_get("hz")["hz"]
    sub = r.pubsub()
    try:
        r.config_set("hz", 1)
        sub.subscribe("__keyevent@0__:expired")
        wait_until(lambda: sub.get_message(timeout=0.1) is None, 5)  # drain the subscribe reply
        seconds, micros = r.time()
        # The creator's clock far ahead, so that a key armed at its due time could not expire
        # before the deadline below by any means (the real skew is a millisecond or less).
        ahead_ms = seconds * 1000 + micros // 1000 + 2_000
        keys = [f"Probe@record@now{i}" for i in range(20)]
        for key in keys:  # one at a time, as single creates arm them
            arm_keys(r, [(key, ahead_ms)], ahead_ms, Settings(wake_ahead_s=120))
        expired: set[str] = set()

        def all_expired() -> bool:
            while (msg := sub.get_message(timeout=0.01)) is not None:
                if msg["type"] == "message":
                    expired.add(msg["data"].decode())
            return expired == set(keys)

        # Well before the keys' due time on Redis's clock: only the lookup beside each SET can
        # have expired them.
        wait_until(all_expired, 1.0)
    finally:
        r.config_set("hz", hz)
        sub.close()
        r.close()


@pytest.mark.parametrize("many", [False, True], ids=["create", "create_many"])
def test_a_task_falling_due_while_its_row_is_written_expires_when_the_create_returns(
    redis_url: str, sqlite_url: str, tmp_path: Path, many: bool
) -> None:
    with Client(make_settings(redis_url, sqlite_url, tmp_path)) as client:
        write = client.store.upsert_streamed if many else client.store.upsert_pending

        def slow_write(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.1)  # a ledger that answers slowly (after a restart, say)
            return write(*args, **kwargs)

        r = redis.Redis.from_url(redis_url)
        try:
            setattr(client.store, write.__name__, slow_write)
            before = _expired_total(r)
            if many:
                client.create_many(
                    [TaskRequest(Probe.record, (f"slow{i}",), ttl_ms=20) for i in range(3)]
                )
            else:
                client.create(Probe.record, "slow", ttl_ms=20)
            # Expired by the create's own lookup, before anything looked the key up: no wait
            # for a wake message to reach a driver, or for Redis's sweep.
            assert _expired_total(r) - before == (3 if many else 1)
        finally:
            r.close()
