"""Redis Cluster faults under load: a primary killed, slots resharded, a node added, a primary
whose notifications are switched off. Every task still runs, exactly once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from redis.crc import key_slot

from keyexpiry import Client, Settings, TaskRequest
from keyexpiry.bench.servers import ServerError, wait_until
from keyexpiry.bench.servers.cluster import ClusterNode, LocalCluster
from keyexpiry.clock import monotonic_s
from keyexpiry.errors import RedisUnavailableError
from keyexpiry.keys import format_key, wake_channel
from keyexpiry.ledger.store import TaskStatus
from keyexpiry.listener.cluster_subscription import ClusterSubscription
from tests.ke import Running, make_settings, wait_status
from tests.reliability import Verdict

pytestmark = pytest.mark.faults
StartListener = Callable[[Settings], Running]
ClusterFactory = Callable[..., LocalCluster]


def _subscription(running: Running) -> ClusterSubscription:
    subscription = running.listener.subscription
    assert isinstance(subscription, ClusterSubscription)
    return subscription


def _tasks(c: Client, name: str, count: int, spread_ms: int, first_ms: int = 300) -> list[str]:
    return c.create_many(
        TaskRequest("Probe.record", (f"{name}{i}",), ttl_ms=first_ms + spread_ms * i // count)
        for i in range(count)
    )


def _on(node: ClusterNode, keys: list[str], cluster: LocalCluster) -> int:
    """How many of `keys` live on `node` now."""
    slots = cluster.slots_of(node)
    return sum(1 for k in keys if any(lo <= key_slot(k.encode()) <= hi for lo, hi in slots))


def test_cluster_primary_killed_under_load(
    cluster_factory: ClusterFactory,
    db_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    """kill -9 of a primary while 600 tasks fall due over 4 s; its replica is promoted
    (node timeout 1.5 s) and subscribed, and the moved slots are reconciled from the ledger."""
    cluster = cluster_factory()
    cfg = make_settings(cluster.url(), db_url, tmp_path)
    with Client(cfg) as c:
        running = start_listener(cfg)
        keys = _tasks(c, "killed", 600, 4000)
        victim = cluster.primaries()[0]
        assert _on(victim, keys, cluster) > 100
        wait_until(lambda: wait_done(c, keys[len(keys) // 5]), 10)  # under way
        fault_ms = c.clock.now_ms()
        promoted = cluster.kill_primary(victim)
        promoted_s = monotonic_s()
        wait_until(lambda: promoted.address in _subscription(running).addresses, 10)
        # Subscribed within ~5 s of the cluster announcing the new primary.
        assert monotonic_s() - promoted_s < 5.0
        verdict.check(c, keys, timeout_s=60, fault_at_ms=fault_ms)
        assert victim.address not in _subscription(running).addresses


def test_cluster_tasks_created_during_a_failover(
    cluster_factory: ClusterFactory,
    sqlite_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    """Tasks created one by one from the kill -9 of a primary until a second after its replica
    took over: a create whose key could not be set says so (the row is in the ledger) and
    reconciliation arms it; every task runs once."""
    cluster = cluster_factory()
    cfg = make_settings(cluster.url(), sqlite_url, tmp_path)
    with Client(cfg) as c:
        running = start_listener(cfg)
        victim = cluster.primaries()[0]
        first_slot = cluster.slots_of(victim)[0][0]
        fault_ms = c.clock.now_ms()
        victim.kill()
        keys: list[str] = []
        refused = 0
        promoted_at_s: float | None = None
        while promoted_at_s is None or monotonic_s() < promoted_at_s + 1.0:
            name = f"failover{len(keys)}"
            keys.append(c.key_for("Probe.record", name))
            try:
                c.create("Probe.record", name, ttl_ms=300)
            except RedisUnavailableError:
                refused += 1
            if promoted_at_s is None and _owner(cluster, first_slot) not in (None, victim):
                promoted_at_s = monotonic_s()
            assert len(keys) < 2000, "no replica took over"
        wait_until(lambda: len(_subscription(running).addresses) == 3, 10)
        verdict.check(c, keys, timeout_s=60, fault_at_ms=fault_ms)
        print(f"{len(keys)} created during the failover, {refused} said their key was not set")
        assert len(keys) > 20


def _owner(cluster: LocalCluster, slot: int) -> ClusterNode | None:
    try:
        return cluster.owner_of(slot)
    except (KeyError, ServerError):
        return None


def test_cluster_slots_resharded_under_load(
    cluster_factory: ClusterFactory,
    sqlite_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    """1,500 slots (and their keys) moved between primaries with `redis-cli --cluster reshard`
    while 1,000 tasks fall due over 5 s."""
    cluster = cluster_factory(replicas=0)
    cfg = make_settings(cluster.url(), sqlite_url, tmp_path)
    with Client(cfg) as c:
        running = start_listener(cfg)
        keys = _tasks(c, "resharded", 1000, 5000, first_ms=500)
        source, target = cluster.primaries()[:2]
        before = _on(target, keys, cluster)
        fault_ms = c.clock.now_ms()
        cluster.reshard(source, target, 1500)
        assert _on(target, keys, cluster) > before  # keys did move
        wait_until(lambda: _subscription(running).topology == _topology(running), 5)
        verdict.check(c, keys, timeout_s=60, fault_at_ms=fault_ms)


def test_cluster_node_added_and_given_slots(
    cluster_factory: ClusterFactory,
    sqlite_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    """A fourth primary joins and receives 1,000 slots while tasks fall due: it is subscribed
    within ~5 s and the tasks on its slots are announced by it."""
    cluster = cluster_factory(replicas=0)
    cfg = make_settings(cluster.url(), sqlite_url, tmp_path)
    with Client(cfg) as c:
        running = start_listener(cfg)
        keys = _tasks(c, "joined", 600, 6000, first_ms=1000)
        fault_ms = c.clock.now_ms()
        node = cluster.add_primary()
        cluster.reshard(cluster.primaries()[0], node, 1000)
        moved_s = monotonic_s()
        wait_until(lambda: node.address in _subscription(running).addresses, 10)
        assert monotonic_s() - moved_s < 5.0
        assert _on(node, keys, cluster) > 10
        verdict.check(c, keys, timeout_s=60, fault_at_ms=fault_ms)
        # Tasks created now on the new node's slots are heard from it.
        events = running.listener.events
        later = _tasks(c, "joined-later", 200, 500)
        assert _on(node, later, cluster) > 0
        for key in later:
            wait_status(c, key, TaskStatus.DONE, timeout_s=20)
        assert running.listener.events - events >= len(later)


def test_cluster_primary_with_notifications_switched_off(
    cluster_factory: ClusterFactory,
    sqlite_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    """One primary stops announcing expiries: its canary does not come back, the listener says
    which node, runs due tasks from the ledger meanwhile, and recovers once it is fixed."""
    cluster = cluster_factory(replicas=0)
    cfg = make_settings(cluster.url(), sqlite_url, tmp_path)
    quiet = cluster.primaries()[1]
    with Client(cfg) as c:
        running = start_listener(cfg)
        quiet.command("CONFIG", "SET", "notify-keyspace-events", "")
        keys = _tasks(c, "quiet", 60, 1000, first_ms=100)
        assert _on(quiet, keys, cluster) > 5
        for key in keys:
            wait_status(c, key, TaskStatus.DONE, timeout_s=20)
        wait_until(lambda: running.listener.events_arriving is False, 10)
        wait_until(lambda: quiet.address in (running.listener.problem or ""), 10)
        quiet.command("CONFIG", "SET", "notify-keyspace-events", "Exe")
        wait_until(lambda: running.listener.events_arriving, 20)
        later = _tasks(c, "quiet-after", 30, 300, first_ms=100)
        verdict.check(c, [*keys, *later], timeout_s=30)


def wait_done(c: Client, key: str) -> bool:
    row = c.store.get(key)
    return row is not None and row.status is TaskStatus.DONE


def _topology(running: Running) -> object:
    cluster = running.listener.rt.cluster
    assert cluster is not None
    return cluster.topology()


def test_arming_and_lookups_follow_slots_the_client_has_not_seen_move(
    cluster_factory: ClusterFactory, sqlite_url: str, tmp_path: Path
) -> None:
    """A client whose slot map is stale (slots moved by someone else): bulk arming and the
    driver's lookups get MOVED from the per-node pipelines and go again through the cluster
    pipeline, which follows the redirection."""
    from keyexpiry.listener.driver import ExpiryDriver
    from keyexpiry.runtime import Runtime

    cluster = cluster_factory(replicas=0)
    rt = Runtime.open(make_settings(cluster.url(), sqlite_url, tmp_path))
    try:
        source, target = cluster.primaries()[:2]
        lo, _ = cluster.slots_of(source)[0]
        keys = [f"Probe@record@stale{i}" for i in range(20_000)]
        moved = [k for k in keys if lo <= key_slot(k.encode()) < lo + 100]
        assert len(moved) >= 64  # enough for the bulk (per-node) path
        rt.redis.set(moved[0], b"")  # the client learns the map before the move
        cluster.reshard(source, target, 100)
        due_ms = rt.clock.now_ms() + 60_000
        rt.arm([(k, due_ms) for k in moved])
        assert all(int(target.command("EXISTS", k)) == 1 for k in moved)
        pttls = ExpiryDriver(
            store=rt.store,
            redis=rt.redis,
            clock=rt.clock,
            settings=rt.settings,
            owner=rt.owner,
            on_cluster=True,
        )._pttl_each(moved)
        assert all(50_000 < p <= 60_000 for p in pttls)
    finally:
        rt.close()


def test_a_flushall_on_one_primary_is_noticed_within_seconds(
    cluster_factory: ClusterFactory,
    sqlite_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    # One primary loses its keys (FLUSHALL there alone): its marker, one per primary, says so,
    # where the overdue check (a minute here) would have been the only way back.
    cluster = cluster_factory()
    cfg = _without_quick_repairs(cluster, sqlite_url, tmp_path)
    with Client(cfg) as c:
        running = start_listener(cfg)
        keys = _tasks(c, "flushed", 60, 1500, first_ms=500)
        victim = cluster.primaries()[0]
        assert _on(victim, keys, cluster) > 5
        victim.command("FLUSHALL")
        verdict.check(c, keys, timeout_s=20)
        assert running.listener.markers_lost == 1


def test_a_paused_primarys_due_tasks_run_from_the_ledger_before_it_answers_again(
    cluster_factory: ClusterFactory,
    sqlite_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    # Found by the Cluster soak: a primary paused for 10 s (its connections open, nothing
    # answered) held the tasks of its slots for the whole pause. Its subscription's PING finds
    # it silent; from then on its due tasks run from the ledger, as when no event arrives.
    cluster = cluster_factory()
    cfg = _without_quick_repairs(cluster, sqlite_url, tmp_path)
    with Client(cfg) as c:
        start_listener(cfg)
        victim = cluster.primaries()[0]
        keys = _tasks(c, "paused", 60, 1000, first_ms=1000)
        assert _on(victim, keys, cluster) > 5
        _paused_then_judged(
            victim,
            c,
            keys,
            verdict,
            pause_s=12.0,
            slack_s=2,
            message="the paused primary's tasks waited",
        )


def test_a_paused_primary_holds_back_no_outcome_of_the_other_primaries_tasks(
    cluster_factory: ClusterFactory,
    mysql_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    # Found by the Cluster soak (530f112): the retry key of a task on a paused primary, armed
    # by the recorder after its outcome, held the recorder for the socket timeout, and with it
    # the outcome of every task: tasks of the healthy primaries ran but stayed `running`, the
    # listener's room for claims ran out, and throughput fell to a quarter until the pause
    # ended. Keys are armed on a thread of their own now.
    cluster = cluster_factory()
    cfg = _without_quick_repairs(cluster, mysql_url, tmp_path)
    with Client(cfg) as c:
        start_listener(cfg)
        # Not the wake channel's primary: a create publishes there and would wait for it.
        wake_slot = key_slot(wake_channel(0, cfg.key_prefix).encode())
        victim = next(
            node
            for node in cluster.primaries()
            if not any(lo <= wake_slot <= hi for lo, hi in cluster.slots_of(node))
        )
        # Read before the pause: the slot table is asked of the nodes.
        victim_slots = cluster.slots_of(victim)

        def on_victim(key: str) -> bool:
            return any(lo <= key_slot(key.encode()) <= hi for lo, hi in victim_slots)

        failing = c.create_many(
            TaskRequest("Probe.fail_once", (f"retried{i}",), ttl_ms=800) for i in range(30)
        )
        assert _on(victim, failing, cluster) > 3
        # Created while the victim is paused: only keys the other primaries hold.
        healthy_args = [
            (f"healthy{i}",)
            for i in range(400)
            if not on_victim(format_key("Probe", "record", (f"healthy{i}",), prefix=cfg.key_prefix))
        ][:40]
        pause_s = 12.0
        victim.command("CLIENT", "PAUSE", int(pause_s * 1000), "ALL")
        paused_at = monotonic_s()
        healthy = c.create_many(
            TaskRequest("Probe.record", args, ttl_ms=3000 + 50 * i)
            for i, args in enumerate(healthy_args)
        )
        assert not any(on_victim(k) for k in healthy)
        assert monotonic_s() - paused_at < 2, "creating on the healthy primaries waited"
        _done_within(c, healthy, paused_at + pause_s - 3, "the healthy primaries' outcomes waited")
        # Run on their events, not by the ledger's once-a-second fallback: the thread reading
        # every primary's events goes on while the paused one is being subscribed again.
        late_ms = sorted(r.started_at_ms - r.due_at_ms for r in c.store.get_many(healthy).values())
        assert late_ms[len(late_ms) // 2] < 250, f"healthy tasks late (ms): {late_ms}"
        verdict.check(c, healthy, timeout_s=30)
        # Each failing task runs twice by design; every one ends done once its retry's key is
        # armed on the primary that answers again.
        wait_until(lambda: all(s is TaskStatus.DONE for s in _statuses(c, failing)), 30)


def test_a_paused_primary_holding_the_canary_stops_no_ledger_run(
    cluster_factory: ClusterFactory,
    mysql_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    # Found by the Cluster soak (4956a02): the periodic check that runs a paused primary's due
    # tasks from the ledger sent the canary, which lives on that primary, in the first second
    # of the pause (before the primary was found unheard), and waited out the socket timeout
    # in a new connection's handshake; the ledger runs stopped with it. The canary is the
    # marker thread's on a Cluster now.
    cluster = cluster_factory()
    cfg = make_settings(
        cluster.url(), mysql_url, tmp_path, lease_check_s=60, stuck_after_s=60, canary_interval_s=1
    )
    with Client(cfg) as c:
        running = start_listener(cfg)
        canary_slot = key_slot(running.listener.health.canary.encode())
        victim = next(
            node
            for node in cluster.primaries()
            if any(lo <= canary_slot <= hi for lo, hi in cluster.slots_of(node))
        )
        keys = _tasks(c, "canary", 90, 5000, first_ms=3000)
        assert _on(victim, keys, cluster) > 10
        _paused_then_judged(
            victim,
            c,
            keys,
            verdict,
            pause_s=14.0,
            slack_s=3,
            message="the ledger runs waited for the pause",
        )


def test_a_paused_primary_met_by_a_reconciliation_walk_stops_no_ledger_run(
    cluster_factory: ClusterFactory,
    mysql_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
) -> None:
    # The Cluster soak on 18a0256: one listener of three ran its share of a paused primary's
    # tasks only at the pause's end, the others every second. A reconciliation's walk over rows
    # due later (one was running after the FLUSHALL a minute before) reads their keys on every
    # primary, between the periodic checks on the same thread.
    cluster = cluster_factory()
    cfg = _without_quick_repairs(cluster, mysql_url, tmp_path)
    with Client(cfg) as c:
        c.create_many(
            TaskRequest("Probe.record", (f"later{i}",), ttl_ms=600_000 + i) for i in range(60_000)
        )
        running = start_listener(cfg)
        maintenance = running.listener.maintenance
        victim = cluster.primaries()[0]
        keys = _tasks(c, "walked", 90, 5000, first_ms=3000)
        assert _on(victim, keys, cluster) > 10
        maintenance.request("the test")
        wait_until(lambda: maintenance._walk is not None, 20, message="no walk began")
        _paused_then_judged(
            victim,
            c,
            keys,
            verdict,
            pause_s=14.0,
            slack_s=3,
            message="the ledger runs waited for the pause",
        )


def _without_quick_repairs(cluster: LocalCluster, db_url: str, tmp_path: Path) -> Settings:
    """Settings whose overdue check and canary wait a minute: only the path under test can run
    the tasks in time."""
    return make_settings(
        cluster.url(), db_url, tmp_path, lease_check_s=60, stuck_after_s=60, canary_interval_s=60
    )


def _paused_then_judged(
    victim: ClusterNode,
    c: Client,
    keys: list[str],
    verdict: Verdict,
    *,
    pause_s: float,
    slack_s: float,
    message: str,
) -> None:
    """`victim` paused (`CLIENT PAUSE ALL`) for `pause_s`: every one of `keys` done `slack_s`
    before the pause ends, then the verdict on them."""
    victim.command("CLIENT", "PAUSE", int(pause_s * 1000), "ALL")
    _done_within(c, keys, monotonic_s() + pause_s - slack_s, message)
    verdict.check(c, keys, timeout_s=30)


def _done_within(c: Client, keys: list[str], deadline_s: float, message: str) -> None:
    """Every one of `keys` done by the monotonic `deadline_s` (a primary still paused)."""
    wait_until(
        lambda: all(s is TaskStatus.DONE for s in _statuses(c, keys)),
        max(0.1, deadline_s - monotonic_s()),
        message=message,
    )


def _statuses(c: Client, keys: list[str]) -> list[TaskStatus]:
    rows = c.store.get_many(keys)
    return [rows[k].status for k in keys if k in rows]
