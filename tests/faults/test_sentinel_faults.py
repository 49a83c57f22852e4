"""Failovers behind Redis Sentinel while tasks are due and being created: every task still runs,
exactly once; the listener follows the new master within seconds of the sentinels' switch.

Each test has its own group (master, replica, three sentinels; down-after 1 s), so they run in
parallel under xdist.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from keyexpiry import Client, Settings, TaskRequest
from keyexpiry.bench.servers import LOOPBACK, wait_until
from keyexpiry.bench.servers.sentinel import SentinelGroup
from keyexpiry.errors import RedisUnavailableError
from keyexpiry.redis.sentinel import POOL_RECHECK_S
from tests.conftest import SentinelFactory
from tests.ke import Running, make_settings
from tests.reliability import Verdict

pytestmark = pytest.mark.faults
StartListener = Callable[[Settings], Running]

# A backoff far longer than the test allows for following the master: only the watch on the
# sentinels (not the listener's reconnect loop) can move it there in time.
SLOW_RECONNECT = {"reconnect_initial_s": 10.0, "reconnect_max_s": 30.0}
FOLLOW_WITHIN_S = 3.0


def _fault(group: SentinelGroup, how: str) -> None:
    if how == "kill":
        group.master.kill()  # SIGKILL: no goodbye to anyone
    else:
        group.failover()


@dataclass
class Creator:
    """Creates a task every few ms on a thread; remembers which creates returned and which
    raised (and why)."""

    client: Client
    prefix: str
    ttl_ms: int = 400
    created: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            key = self.client.key_for("Probe.record", f"{self.prefix}{i}")
            try:
                self.client.create("Probe.record", f"{self.prefix}{i}", ttl_ms=self.ttl_ms)
                self.created.append(key)
            except RedisUnavailableError as exc:
                self.refused.append(key)
                self.errors.append(str(exc))
            i += 1
            self._stop.wait(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def _wait_for_switch(group: SentinelGroup, old: tuple[str, int], timeout_s: float = 20) -> float:
    """Wait until the sentinels name another master; return when (monotonic)."""
    wait_until(
        lambda: group.master_address() not in (None, old),
        timeout_s,
        interval_s=0.01,
        message="the sentinels never switched",
    )
    return time.monotonic()


@pytest.mark.parametrize("how", ["kill", "failover"])
def test_sentinel_master_lost_under_load(
    sentinel_factory: SentinelFactory,
    db_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
    how: str,
) -> None:
    """300 tasks falling due over 3 s and a stream of creates; the master is killed (-9) or
    failed over by `SENTINEL FAILOVER` a second in. The listener follows the new master (faster
    than its reconnect backoff could), Client writes land there, and every task runs once."""
    group = sentinel_factory()
    cfg = make_settings(group.url(), db_url, tmp_path, **SLOW_RECONNECT)
    old = (LOOPBACK, group.master.port)
    with Client(cfg) as c:
        running = start_listener(cfg)
        listener = running.listener
        keys = c.create_many(
            TaskRequest("Probe.record", (f"{how}{i}",), ttl_ms=300 + 10 * i) for i in range(300)
        )
        creator = Creator(c, f"{how}-stream")
        wait_until(lambda: len(creator.created) >= 20, 5)
        _fault(group, how)
        switched_s = _wait_for_switch(group, old)
        new = (LOOPBACK, group.replica.port)
        wait_until(lambda: listener.subscription.node == new, 20, interval_s=0.01)
        follow_s = time.monotonic() - switched_s
        wait_until(lambda: len(creator.created) >= len(creator.refused) + 40, 10)
        creator.stop()
        # Writes land on the new master within the pool's recheck of the sentinels.
        node = group.replica.client()
        later: list[str] = []

        def lands_on_new_master() -> bool:
            later.append(c.create("Probe.record", f"{how}-later{len(later)}", ttl_s=60))
            return 55_000 < int(node.pttl(later[-1])) <= 60_250  # clock extrapolated: ms off

        wait_until(lands_on_new_master, POOL_RECHECK_S + 1, interval_s=0.05)
        node.close()
        assert all("recorded in the ledger" in e for e in creator.errors), creator.errors[:3]
        # A refused create is in the ledger all the same: reconciliation sets its key.
        tasks = [*keys, *creator.created, *creator.refused]
        verdict.check(c, tasks, timeout_s=30, fault_at_ms=None)
        assert listener.master_watch is not None and listener.master_watch.switches >= 1
    print(f"listener on the new master {follow_s:.3f} s after the sentinels' switch")
    assert follow_s < FOLLOW_WITHIN_S, f"listener on the new master {follow_s:.2f} s after switch"


def test_tasks_created_during_a_failover(
    sentinel_factory: SentinelFactory,
    db_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    """Creates every 10 ms from before a kill -9 of the master until after the switch (tasks due
    400 ms later, so most fall due while no master is named): each create returns or raises
    RedisUnavailableError saying its row is in the ledger; every one of them runs once."""
    group = sentinel_factory()
    cfg = make_settings(group.url(), db_url, tmp_path)
    old = (LOOPBACK, group.master.port)
    with Client(cfg) as c:
        start_listener(cfg)
        creator = Creator(c, "during")
        wait_until(lambda: len(creator.created) >= 20, 5)
        group.master.kill()
        _wait_for_switch(group, old)
        before = len(creator.created)
        wait_until(lambda: len(creator.created) >= before + 50, 10)
        creator.stop()
        assert creator.refused, "no create met the failover: the scenario did not happen"
        assert all("recorded in the ledger" in e for e in creator.errors), creator.errors[:3]
        verdict.check(c, [*creator.created, *creator.refused], timeout_s=30)
    print(f"{len(creator.created)} creates returned, {len(creator.refused)} raised")


def test_a_failover_of_a_live_master_is_at_rest_only_once_the_old_master_streams_from_the_new(
    sentinel_factory: SentinelFactory,
) -> None:
    """The soak's failover ends when the group is at rest (`wait_settled`), not when the
    sentinels switch: a master demoted alive answers `role:master` until a sentinel turns it
    into a replica, seconds after the switch, and a `role:master` check (HAProxy) still
    routes clients to it meanwhile."""
    group = sentinel_factory()
    old, new = group.master.port, group.replica.port
    assert group.settled_master() == old
    group.failover()  # SENTINEL FAILOVER: the old master is alive throughout
    assert group.settled_master() is None, "at rest with a failover under way"
    _wait_for_switch(group, (LOOPBACK, old))
    client = group.master.client()
    try:
        # Between the switch and the conversion, two nodes say `role:master`: not at rest.
        assert client.info("replication")["role"] == "master"
        assert group.settled_master() is None
        assert group.wait_settled(hold_s=0.5, timeout_s=40) == [new]
        info = client.info("replication")
        assert (info["role"], int(info["master_port"])) == ("slave", new)
    finally:
        client.close()
