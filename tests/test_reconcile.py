"""Start-up reconciliation under a large ledger: what is due runs first, the keys of rows due
later are checked afterwards in paced pages, and a key Redis lost among those is still re-armed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from keyexpiry import Client, Listener, Settings, TaskRequest
from keyexpiry.bench.servers import wait_until
from keyexpiry.ledger.scans import ScanQueries
from keyexpiry.ledger.store import NewTask, TaskStatus
from keyexpiry.listener.reconcile import DUE_FIRST_MS, Reconciler, ReconcileReport
from keyexpiry.runtime import Runtime
from tests import sample_tasks
from tests.ke import wait_status


def _far(client: Client, n: int) -> list[str]:
    """`n` tasks due an hour and more from now: beyond the urgent part of a reconciliation."""
    assert DUE_FIRST_MS < 3600 * 1000
    return client.create_many(
        TaskRequest("Probe.record", (f"far{i}",), ttl_s=3600 + i) for i in range(n)
    )


def _pass_with(
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
    before_ttls: Callable[[redis.client.Pipeline], None],
) -> ReconcileReport:
    """One full reconciliation pass on real servers, `before_ttls(pipe)` called just before
    each page's TTLs are read (between the walk's read of the page and its check of the keys)."""
    execute = redis.client.Pipeline.execute

    def hooked(self: redis.client.Pipeline, *args: Any, **kw: Any) -> Any:
        if self.command_stack and self.command_stack[0][0][0] == "PTTL":
            before_ttls(self)
        return execute(self, *args, **kw)

    monkeypatch.setattr(redis.client.Pipeline, "execute", hooked)
    rt = Runtime.open(settings)
    try:
        return Reconciler.of(rt).run()
    finally:
        rt.close()


def test_due_work_runs_while_the_walk_over_later_rows_is_in_progress(
    settings: Settings, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    far = _far(client, 600)  # two pages of the paced walk
    lost = far[-1]  # due last: the walk reaches it last
    client.redis.delete(lost)
    # Missed while no listener ran: its key expired unheard, its row is overdue.
    missed = client.create("Probe.record", "missed", ttl_ms=1)
    wait_until(lambda: client.redis.exists(missed) == 0, 5)

    gate = threading.Event()
    far_pages: list[tuple[int, int]] = []
    read = ScanQueries.pending_keys_page

    def held(self: ScanQueries, **kw: Any) -> Any:
        if kw.get("upto_ms") is None:  # the walk over rows due later
            far_pages.append(kw["after"])
            if len(far_pages) == 2:  # hold it mid-way, one page repaired
                assert gate.wait(30)
        return read(self, **kw)

    monkeypatch.setattr(ScanQueries, "pending_keys_page", held)
    listener = Listener(settings)
    thread = threading.Thread(target=listener.run, daemon=True)
    thread.start()
    try:
        assert listener.subscribed.wait(15)
        wait_status(client, missed, TaskStatus.DONE)
        due = client.create("Probe.record", "due", ttl_ms=200)
        wait_status(client, due, TaskStatus.DONE)
        wait_until(lambda: len(far_pages) == 2, 10, message="the walk never reached page 2")
        # Both ran while the walk was held: it has not finished, the lost key is not back.
        assert listener.reconciles_done == 0
        assert client.redis.exists(lost) == 0
        gate.set()
        wait_until(lambda: listener.reconciles_done >= 1, 15, message="the walk never ended")
        row = client.store.get(lost)
        assert row is not None and row.status is TaskStatus.PENDING
        assert client.redis.pexpiretime(lost) == row.due_at_ms
        assert all(client.redis.exists(k) for k in far)
    finally:
        gate.set()
        listener.stop()
        thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_full_pass_rearms_lost_keys_due_soon_and_later(
    settings: Settings, client: Client
) -> None:
    far = _far(client, 1200)
    soon = client.create("Probe.record", "soon", ttl_s=60)
    for key in (far[0], far[700], soon):
        client.redis.delete(key)
    rt = Runtime.open(settings)
    try:
        report = Reconciler.of(rt).run()
    finally:
        rt.close()
    assert report.checked == 1201 and report.rearmed == 3 and report.overdue == 0
    for key in (far[0], far[700], soon):
        row = client.store.get(key)
        assert row is not None
        assert client.redis.pexpiretime(key) == row.due_at_ms


def test_a_page_whose_ttls_come_back_late_is_not_taken_for_lost_keys(
    settings: Settings, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A loaded machine stalled a page's PTTL round trip past the 1 s tolerance: every key of
    # the page then looked a second short, and all 1,000 were re-armed and counted as lost.
    far = _far(client, 1200)
    client.redis.delete(far[300])
    stalled: list[int] = []

    def slow(pipe: redis.client.Pipeline) -> None:
        stalled.append(len(pipe.command_stack))
        time.sleep(1.5)  # the stall itself, not a wait for something

    report = _pass_with(settings, monkeypatch, slow)
    assert stalled, "no page's TTLs were read"
    assert (report.checked, report.rearmed) == (1200, 1)
    row = client.store.get(far[300])
    assert row is not None and client.redis.pexpiretime(far[300]) == row.due_at_ms


def test_a_task_rescheduled_while_the_walk_checks_its_page_keeps_its_new_due(
    settings: Settings, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by the soaks (7-21 s late, outside any fault): a reschedule landed between the
    # walk's read of a page and its read of the page's TTLs; the key's new expiry looked wrong
    # against the old due the page held, and was put back to it. The key fired at the old due
    # (the claim found the row not yet due), nothing at the new one.
    far = _far(client, 50)
    moved: list[str] = []

    def reschedule_first(_pipe: redis.client.Pipeline) -> None:
        if not moved:
            moved.append(client.create(sample_tasks.Probe.record, "far7", ttl_s=7200))

    report = _pass_with(settings, monkeypatch, reschedule_first)
    assert moved == [far[7]]
    assert (report.checked, report.rearmed) == (50, 0)
    row = client.store.get(far[7])
    assert row is not None and client.redis.pexpiretime(far[7]) == row.due_at_ms


@pytest.mark.parametrize("damage", ["lost", "wrong expiry"])
def test_a_key_rescheduled_while_the_walk_rearms_it_keeps_its_new_due(
    settings: Settings, client: Client, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    # The Cluster soak: a task rescheduled just after a FLUSHALL, between the walk's second
    # read of its row (still the old due) and its re-arm, got its key put back to the old due
    # and ran 12 s late, by the overdue check.
    far = _far(client, 50)
    if damage == "lost":
        client.redis.delete(far[7])
    else:
        client.redis.persist(far[7])  # a key that would never expire
    moved: list[str] = []
    read_again = ScanQueries.pending_again

    def then_rescheduled(self: ScanQueries, keys: list[str]) -> Any:
        rows = read_again(self, keys)
        if far[7] in keys and not moved:
            moved.append(client.create(sample_tasks.Probe.record, "far7", ttl_s=7200))
        return rows

    monkeypatch.setattr(ScanQueries, "pending_again", then_rescheduled)
    rt = Runtime.open(settings)
    try:
        report = Reconciler.of(rt).run()
    finally:
        rt.close()
    assert moved == [far[7]] and report.rearmed == 1
    row = client.store.get(far[7])
    assert row is not None and client.redis.pexpiretime(far[7]) == row.due_at_ms


def test_a_reconciliation_asked_for_during_the_walk_walks_again_after_it(
    settings: Settings, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    far = _far(client, 600)
    gate = threading.Event()
    walked: list[tuple[int, str]] = []
    read = ScanQueries.pending_keys_page

    def held(self: ScanQueries, **kw: Any) -> Any:
        if kw.get("upto_ms") is None:
            walked.append(kw["after"])
            if len(walked) == 2:
                assert gate.wait(30)
        return read(self, **kw)

    monkeypatch.setattr(ScanQueries, "pending_keys_page", held)
    listener = Listener(settings)
    thread = threading.Thread(target=listener.run, daemon=True)
    thread.start()
    try:
        assert listener.subscribed.wait(15)
        wait_until(lambda: len(walked) == 2, 10, message="the walk never reached page 2")
        # Lost behind the walk's position: only a walk that starts over finds it.
        client.redis.delete(far[0])
        listener.request_reconcile("test")
        gate.set()
        wait_until(lambda: listener.reconciles_done >= 2, 15, message="no second walk")
        assert listener.wait_reconciled(10)
        assert client.redis.exists(far[0]) == 1
        assert len(walked) == 4  # two pages each
    finally:
        gate.set()
        listener.stop()
        thread.join(timeout=30)
    assert not thread.is_alive()


def test_the_overdue_check_finds_this_listeners_rows_behind_a_peers_backlog(
    settings: Settings, client: Client
) -> None:
    # 1,500 overdue rows of a peer's share fall due first; 3 of this listener's come after them.
    now_ms = client.clock.now_ms()
    peers = [
        NewTask(f"Probe@record@peer{i}", "Probe", "record", (f"peer{i}",), now_ms - 60_000 + i)
        for i in range(1500)
    ]
    own = [
        NewTask(f"Probe@record@own{i}", "Probe", "record", (f"own{i}",), now_ms - 30_000 + i)
        for i in range(3)
    ]
    client.store.upsert_pending(peers + own, now_ms)
    rt = Runtime.open(settings)
    try:
        reconciler = Reconciler.of(rt)
        found = reconciler.repair_stuck(
            grace_ms=5_000, events_arriving=True, limit=1000, mine=lambda key: "@own" in key
        )
    finally:
        rt.close()
    assert found == 3 and reconciler.rearmed_total == 3
