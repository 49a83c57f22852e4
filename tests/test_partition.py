"""Listeners share the task keys: the rendezvous assignment (pure), then two listeners on real
Redis and ledgers splitting the work, a dead peer's share caught up from the ledger, a class only
one listener runs, and a graceful stop that hands its share over before it stops hearing."""

from __future__ import annotations

import json
import secrets
import threading
from collections import Counter
from collections.abc import Callable
from typing import ClassVar

import pytest
from typer.testing import CliRunner

from keyexpiry import Client, Listener, Settings, current, exposed
from keyexpiry.bench.servers import wait_until
from keyexpiry.cli import app
from keyexpiry.keys import sentinel_key
from keyexpiry.ledger.heartbeats import ListenerRow
from keyexpiry.ledger.store import NewTask, TaskStatus
from keyexpiry.listener.fleet import share_silence_s
from keyexpiry.listener.partition import BUCKETS, Partition, assign, bucket_of, shares
from keyexpiry.registry import Registry
from tests import sample_tasks
from tests.ke import Running, wait_status

StartListener = Callable[[Settings], Running]
QUICK = {"heartbeat_s": 0.2, "takeover_after_s": 2.0}


def _ids(n: int) -> list[str]:
    return [f"host:{100 + i}:{secrets.token_hex(4)}" for i in range(n)]


# --- the assignment (pure) ------------------------------------------------------------------------
def test_every_bucket_has_exactly_one_owner_and_shares_are_even() -> None:
    for n in (2, 3, 5):
        ids = frozenset(_ids(n))
        tables = [assign(ids, me) for me in ids]
        assert all(sum(t[b] for t in tables) == 1 for b in range(BUCKETS))
        for t in tables:  # rendezvous hashing over 1024 buckets: within a quarter of even
            assert abs(t.count(1) - BUCKETS / n) < BUCKETS / n / 4


def test_a_newcomer_takes_buckets_only_from_others_never_moves_the_rest() -> None:
    old = _ids(3)
    new = [*old, *_ids(1)]
    for me in old:
        before, after = assign(frozenset(old), me), assign(frozenset(new), me)
        assert all(before[b] for b in range(BUCKETS) if after[b])  # nothing gained from peers
    assert assign(frozenset(new), new[-1]).count(1) > 0


def test_a_share_given_up_is_held_for_the_hold_time_and_gains_are_reported() -> None:
    a, b = "a:1:x", "b:2:y"
    part = Partition(a, frozenset({"Probe"}), hold_s=2.0)
    key = b"Probe@record@1"
    assert part.owns("Probe", key)  # before the first update: everything is ours
    assert part.update({a: frozenset({"Probe"})}, now_s=0.0) == {}
    assert part.owned_buckets() == BUCKETS and part.peers == 0
    both = {a: frozenset({"Probe"}), b: frozenset({"Probe"})}
    assert part.update(both, now_s=1.0) == {}
    assert part.owned_buckets() == BUCKETS and part.peers == 1  # given up, still held
    assert part.update(both, now_s=3.5) == {}
    mine = assign(frozenset(both), a)
    assert part.owned_buckets() == mine.count(1)
    assert part.owns("Probe", key) == bool(mine[bucket_of(key)])
    gained = part.update({a: frozenset({"Probe"})}, now_s=4.0)  # b died
    assert gained == {"Probe": {i for i in range(BUCKETS) if not mine[i]}}
    assert part.owned_buckets() == BUCKETS


def test_classes_decide_who_shares_and_old_listeners_share_with_no_one() -> None:
    a, b, old = "a:1:x", "b:2:y", "o:3:z"
    part = Partition(a, frozenset({"Orders", "Auctions"}), hold_s=0.0)
    members = {a: frozenset({"Orders", "Auctions"}), b: frozenset({"Orders"}), old: None}
    part.update(members, now_s=0.0)
    keys = [f"Auctions@end@{i}".encode() for i in range(200)]
    assert all(part.owns("Auctions", k) for k in keys)  # nobody else runs Auctions
    orders = [f"Orders@close@{i}".encode() for i in range(200)]
    assert 40 < sum(part.owns("Orders", k) for k in orders) < 160
    assert part.owns("Unregistered", b"Unregistered@x@1")  # the claimer says what it is
    assert part.owns(None, b"garbage")
    assert part.peers == 1
    got = shares(members)
    # b shares Orders with a; a has all of Auctions and the rest of Orders.
    assert got[old] == 1.0 and 0.3 < got[b] < 0.7
    assert abs(got[a] - (1 + (1 - got[b])) / 2) < 1e-9


# --- on real servers ----------------------------------------------------------------------------
def _sharing(*runs: Running, classes: int) -> Callable[[], bool]:
    def settled() -> bool:
        parts = [r.listener.fleet.partition for r in runs]
        return (
            all(p.peers == len(runs) - 1 for p in parts)
            and sum(p.owned_buckets() for p in parts) == classes * BUCKETS
        )

    return settled


def test_exactly_one_live_listener_leads_each_sentinel_whatever_its_classes() -> None:
    members = {"a:1:x": frozenset({"Probe"}), "b:2:y": frozenset({"Other"}), "c:3:z": None}
    parts = [Partition(me, frozenset({"Probe"}), hold_s=0.0) for me in members]
    assert all(p.leads(b"keyexpiry:sentinel:1") for p in parts)  # before any heartbeat read
    for p in parts:
        p.update(members, now_s=0.0)
    keys = [f"keyexpiry:sentinel:{i}".encode() for i in range(1, 301)]
    leaders = Counter(next(p.me for p in parts if p.leads(k)) for k in keys)
    assert all(sum(p.leads(k) for p in parts) == 1 for k in keys)
    assert set(leaders) == set(members)  # each leads some


def _two_sharing(settings: Settings, start_listener: StartListener) -> tuple[Running, Running]:
    """Two listeners on quick fleet settings, started and sharing the keys."""
    quick = settings.replace(**QUICK)
    one, two = start_listener(quick), start_listener(quick)
    classes = len(one.listener.fleet.partition.classes)
    wait_until(_sharing(one, two, classes=classes), 10, message="listeners never shared")
    return one, two


def test_a_sentinel_firing_is_reconciled_by_one_listener_of_two(
    settings: Settings, client: Client, start_listener: StartListener
) -> None:
    one, two = _two_sharing(settings, start_listener)
    for r in (one, two):
        assert r.listener.wait_reconciled(15)
    before = {r.listener.owner: r.listener.reconciles_done for r in (one, two)}
    key = sentinel_key(99, settings.key_prefix)
    leader = next(r for r in (one, two) if r.listener.fleet.partition.leads(key.encode()))
    client.redis.set(key, b"", px=50)
    wait_until(lambda: leader.listener.reconciles_done > before[leader.listener.owner], 15)
    for r in (one, two):
        assert r.listener.wait_reconciled(15)
    after = {
        r.listener.owner: r.listener.reconciles_done - before[r.listener.owner] for r in (one, two)
    }
    assert sorted(after.values()) == [0, 1], after


def test_two_listeners_split_the_keys_and_each_task_runs_once(
    settings: Settings, client: Client, start_listener: StartListener
) -> None:
    one, two = _two_sharing(settings, start_listener)
    keys = [client.create(sample_tasks.Probe.record, f"s{i}", ttl_ms=50) for i in range(300)]
    for key in keys:
        wait_status(client, key, TaskStatus.DONE)
    assert all(sample_tasks.CALLS[k] == 1 for k in keys)
    by = Counter(
        next(r.listener.owner for r in (one, two) if row.claimed_by.startswith(r.listener.owner))
        for k in keys
        if (row := client.store.get(k)) is not None and row.claimed_by
    )
    assert sum(by.values()) == 300 and min(by.values()) > 60, by  # both worked, by their share
    # No race for the same key: each was claimed by the listener whose share it is. (A key can
    # still be "not claimed" once by its owner: its event came a hair before this host's
    # extrapolation of Redis's clock reached the due time, so it was re-armed and claimed.)
    members = frozenset({one.listener.owner, two.listener.owner})
    mine = assign(members, one.listener.owner)
    for key in keys:
        row = client.store.get(key)
        owner = one if mine[bucket_of(key.encode())] else two
        assert row is not None and (row.claimed_by or "").startswith(owner.listener.owner), row
    for r in (one, two):
        assert r.listener.router.others_share > 60  # heard, and left to the other
        assert r.listener.dispatcher.stats.claims_lost == 0


def test_a_silent_peer_leaves_the_share_after_three_beats_before_its_runs_are_taken() -> None:
    defaults = Settings()
    assert (defaults.heartbeat_s, defaults.takeover_after_s) == (0.5, 5.0)
    assert share_silence_s(defaults) == 2.0  # the floor: three beats would be 1.5 s
    assert share_silence_s(defaults.replace(heartbeat_s=1.0)) == 3.0
    # Never later than the takeover, never sooner than 2 s (a loaded machine's late beat).
    assert share_silence_s(defaults.replace(heartbeat_s=2.0, takeover_after_s=5.0)) == 5.0
    assert share_silence_s(defaults.replace(heartbeat_s=0.2, takeover_after_s=5.0)) == 2.0
    assert share_silence_s(defaults.replace(heartbeat_s=0.2, takeover_after_s=1.0)) == 1.0


class _Ghost:
    """A peer that beats every 0.1 s with the listener's classes but hears nothing (as if its
    process hung in the middle of dying), until `stop()`."""

    name = "ghost:1:dead"

    def __init__(self, client: Client, part: Partition) -> None:
        self.stopped = threading.Event()

        def beat() -> None:
            while not self.stopped.wait(0.1):
                now = client.clock.now_ms()
                client.store.beat(ListenerRow(self.name, "ghost", 1, now, now, 0, part.classes))

        self._thread = threading.Thread(target=beat, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop beating: silent from now on."""
        self.stopped.set()
        self._thread.join()


@pytest.mark.parametrize("backlog", [0, 10_500], ids=["alone", "behind-a-backlog"])
def test_a_dead_peers_share_waits_until_it_is_silent_then_runs_from_the_ledger(
    settings: Settings, client: Client, start_listener: StartListener, backlog: int
) -> None:
    """A peer that beats but hears nothing (as if its process hung in the middle of dying): its
    share of the keys goes unclaimed until it is silent for three beats (`share_silence_s`);
    then the live listener gains those buckets and claims their overdue rows from the ledger,
    also when more overdue rows of other buckets than one read returns fall due before them."""
    if backlog:
        # A class no listener here runs: its overdue rows stay, and come first in due order.
        now_ms = client.clock.now_ms()
        client.store.upsert_pending(
            [
                NewTask(f"Nobody@m@{i}", "Nobody", "m", (str(i),), now_ms - 60_000 + i % 1000)
                for i in range(backlog)
            ],
            now_ms,
        )
    quick = settings.replace(**QUICK)
    running = start_listener(quick)
    part = running.listener.fleet.partition
    ghost = _Ghost(client, part)
    try:
        wait_until(
            lambda: part.peers == 1 and part.owned_buckets() < len(part.classes) * BUCKETS, 10
        )
        mine = assign(frozenset({running.listener.owner, ghost.name}), running.listener.owner)
        keys = [client.create(sample_tasks.Probe.record, f"g{i}", ttl_ms=20) for i in range(200)]
        ghosts = [k for k in keys if not mine[bucket_of(k.encode())]]
        assert 40 < len(ghosts) < 160
        for key in set(keys) - set(ghosts):
            wait_status(client, key, TaskStatus.DONE)
        # The ghost's share is overdue and unclaimed while it beats.
        assert all(client.store.get(k).status is TaskStatus.PENDING for k in ghosts)  # type: ignore[union-attr]
    finally:
        ghost.stop()
    for key in ghosts:
        wait_status(client, key, TaskStatus.DONE, timeout_s=15)
    assert all(sample_tasks.CALLS[k] == 1 for k in keys)
    assert running.listener.fleet.caught_up >= len(ghosts)


def test_a_key_falling_due_while_a_dead_peers_share_moves_is_caught_up_at_once(
    settings: Settings,
    client: Client,
    start_listener: StartListener,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The beat that takes a silent peer's buckets runs their overdue rows: those due by the end
    of that beat, not by its start. A key that falls due while the beat reads who is alive is
    heard and dropped (its bucket still the peer's), and only that read finds it; read up to the
    beat's start, it waited for the overdue check (the Patroni hour: 12-14 s)."""
    running = start_listener(settings.replace(**QUICK))
    fleet, router = running.listener.fleet, running.listener.router
    part = fleet.partition
    ghost = _Ghost(client, part)
    submitted: list[str] = []
    submit = fleet._submit
    assert submit is not None

    def record(keys: list[str]) -> None:
        submitted.extend(keys)
        submit(keys)

    monkeypatch.setattr(fleet, "_submit", record)
    late: list[str] = []
    read_members = fleet.store.live_members

    def live_members(since_ms: int) -> dict[str, frozenset[str] | None]:
        members = read_members(since_ms)
        if ghost.stopped.is_set() and ghost.name not in members and not late:
            # This beat moves the ghost's share here. Meanwhile a key of it falls due, and its
            # event is heard and dropped: the bucket is still the ghost's.
            dropped = router.others_share
            # (50 ms ahead: after the beat's start on any of the two clocks)
            late.append(client.create(sample_tasks.Probe.record, arg, ttl_ms=50))
            wait_until(lambda: router.others_share > dropped, 5, message="no event dropped")
        return members

    try:
        wait_until(lambda: part.peers == 1, 10)
        mine = assign(frozenset({running.listener.owner, ghost.name}), running.listener.owner)
        arg = next(
            a
            for a in (f"late{i}" for i in range(1000))
            if not mine[bucket_of(client.key_for(sample_tasks.Probe.record, a).encode())]
        )
        monkeypatch.setattr(fleet.store, "live_members", live_members)
    finally:
        ghost.stop()
    wait_until(lambda: bool(late), 10, message="the ghost's share never moved")
    wait_status(client, late[0], TaskStatus.DONE)
    # Run by the beat that took the bucket, not by the overdue check after it.
    assert late[0] in submitted
    assert sample_tasks.CALLS[late[0]] == 1


class Solo:
    """A class only one listener of the test registers."""

    runs: ClassVar[Counter[str]] = Counter()

    @exposed
    def run(self, name: str) -> None:
        Solo.runs[current().key] += 1


def test_a_class_only_one_listener_registers_is_all_its_own(
    settings: Settings, client: Client, start_listener: StartListener
) -> None:
    """Listeners running different task classes share only what both run: each class's keys
    all go to the listeners that register it (a class of one listener is all its own)."""
    Solo.runs.clear()
    quick = settings.replace(**QUICK)
    full = start_listener(quick)
    narrow = Registry()
    narrow.register(Solo)
    partial = Listener(quick, narrow)
    thread = threading.Thread(target=partial.run, daemon=True)
    thread.start()
    try:
        assert partial.subscribed.wait(15)
        wait_until(lambda: full.listener.fleet.partition.peers == 0, 10)  # no class in common
        probes = [client.create(sample_tasks.Probe.record, f"p{i}", ttl_ms=20) for i in range(60)]
        with Client(quick, registry=narrow) as solo_client:
            solos = [solo_client.create(Solo.run, f"s{i}", ttl_ms=20) for i in range(60)]
        for key in probes + solos:
            wait_status(client, key, TaskStatus.DONE)
        for keys, runner in ((probes, full.listener.owner), (solos, partial.owner)):
            for key in keys:
                row = client.store.get(key)
                assert row is not None and (row.claimed_by or "").startswith(runner), row
        assert all(Solo.runs[k] == 1 for k in solos)
        assert partial.fleet.partition.owned_buckets() == BUCKETS  # all of Solo
    finally:
        partial.stop()
        thread.join(timeout=30)


def test_a_graceful_stop_hands_its_share_over_before_it_stops_hearing(
    settings: Settings, client: Client, start_listener: StartListener, cli_env: dict[str, str]
) -> None:
    quick = settings.replace(heartbeat_s=0.5, takeover_after_s=3.0)
    stays, leaves = start_listener(quick), start_listener(quick)
    classes = len(stays.listener.fleet.partition.classes)
    wait_until(_sharing(stays, leaves, classes=classes), 10, message="listeners never shared")
    seen: list[int] = []
    shown: list[dict[str, object]] = []
    original = leaves.listener._hand_over
    env = {**cli_env, "KEYEXPIRY_DATABASE_URL": settings.database_url or ""}

    def hand_over() -> None:
        original()
        # Still subscribed: by now the peer must own every bucket.
        seen.append(stays.listener.fleet.partition.owned_buckets())
        out = CliRunner().invoke(app, ["listeners", "--json"], env=env).stdout
        shown.extend(json.loads(line) for line in out.splitlines())

    leaves.listener._hand_over = hand_over  # type: ignore[method-assign]
    leaves.stop()
    assert seen == [classes * BUCKETS]
    states = {row["id"]: (row["state"], row["share"]) for row in shown}
    assert states[leaves.listener.owner][0] == "stopping"
    assert states[stays.listener.owner] == ("live", 1.0)
    keys = [client.create(sample_tasks.Probe.record, f"a{i}", ttl_ms=20) for i in range(50)]
    for key in keys:
        wait_status(client, key, TaskStatus.DONE)
