"""Outcomes gathered before they are recorded: a trickle of ending runs makes one write, not one
each, and nothing waits longer than the gathering interval."""

from __future__ import annotations

import threading

from keyexpiry.clock import monotonic_s
from keyexpiry.ledger.rows import Outcome, TaskRow, TaskStatus
from keyexpiry.registry import ExposeOptions, TaskSpec
from keyexpiry.runner.inflight import ClaimedRun, InFlight


def _outcome(i: int) -> Outcome:
    return Outcome(i, f"Probe@record@{i}", "tok", TaskStatus.DONE, 1, 1, None)


def test_outcomes_ending_within_the_interval_are_taken_together() -> None:
    inflight = InFlight(concurrency=8, claim_batch=100)
    gather_s = 0.2
    started = monotonic_s()
    inflight.add_outcome(_outcome(0))

    # More runs end while the first outcome waits; a thread adds them as workers would.
    def end_two_more() -> None:
        for i in (1, 2):
            inflight.add_outcome(_outcome(i))

    more = threading.Thread(target=end_two_more)
    more.start()
    more.join()
    inflight.wait_outcomes(timeout_s=5, gather_s=gather_s)
    assert monotonic_s() - started >= gather_s  # the first waited for the others
    assert [o.task_id for o in inflight.take_outcomes()] == [0, 1, 2]


def test_an_outcome_already_old_enough_is_not_held_back() -> None:
    inflight = InFlight(concurrency=8, claim_batch=100)
    inflight.add_outcome(_outcome(0))
    queued = monotonic_s()
    # Wait (on a deadline) until the outcome is older than the interval.
    while monotonic_s() - queued < 0.05:
        threading.Event().wait(0.01)
    before = monotonic_s()
    inflight.wait_outcomes(timeout_s=5, gather_s=0.05)
    assert monotonic_s() - before < 0.05


def test_with_nothing_to_record_the_wait_ends_at_its_timeout() -> None:
    inflight = InFlight(concurrency=8, claim_batch=100)
    before = monotonic_s()
    inflight.wait_outcomes(timeout_s=0.05, gather_s=10)
    assert 0.04 <= monotonic_s() - before < 5
    assert inflight.take_outcomes() == []


def _run(i: int, *, is_async: bool) -> ClaimedRun:
    spec = TaskSpec("C", "m", object, (), ExposeOptions(), is_async)
    row = TaskRow(
        id=i,
        key=f"C@m@{i}",
        class_name="C",
        method="m",
        args=(),
        status=TaskStatus.RUNNING,
        attempts=1,
        retry_schedule_s=None,
        due_at_ms=0,
        created_at_ms=0,
        updated_at_ms=0,
        started_at_ms=0,
        finished_at_ms=None,
        claimed_by="tok",
        lease_until_ms=0,
        last_error=None,
    )
    return ClaimedRun(row, "tok", spec, 1.0, 0)


def test_running_coroutines_widen_the_claim_window_up_to_their_bound() -> None:
    inflight = InFlight(concurrency=2, claim_batch=100, async_limit=10)
    assert inflight.claim_limit() == 4  # two workers, two queued ahead
    runs = [_run(i, is_async=True) for i in range(10)]
    inflight.add_claimed(runs)
    for run in runs[:3]:
        inflight.started(run)
    # Three coroutines hold no worker, and three more may start: the window doubles them.
    assert inflight.coroutines == 3 and inflight.claim_limit() == 4 + 3 + 3
    for run in runs[3:]:
        inflight.started(run)
    # At the bound: only the queue ahead of the workers is left.
    assert inflight.claim_limit() == 4 + 10
    inflight.finished(runs[0], _outcome(0))
    assert inflight.coroutines == 9 and inflight.count == 9
    late, _ = inflight.take_late(monotonic_s() + 5)
    assert len(late) == 9 and inflight.coroutines == 0 and inflight.count == 0


def test_a_sync_run_is_no_coroutine() -> None:
    inflight = InFlight(concurrency=2, claim_batch=100, async_limit=10)
    run = _run(1, is_async=False)
    inflight.add_claimed([run])
    inflight.started(run)
    assert inflight.coroutines == 0 and inflight.claim_limit() == 4


def _tx_run(i: int, timeout_s: float) -> ClaimedRun:
    from keyexpiry.registry import default_registry
    from tests import sample_tasks

    row = TaskRow(
        i, f"Ledgered@note@{i}", "Ledgered", "note", (str(i),), TaskStatus.RUNNING, 1, None,
        0, 0, 0, 0, None, "tok", 1, None,
    )  # fmt: skip
    spec = default_registry.spec_for(sample_tasks.Ledgered.note)
    return ClaimedRun(row, "tok", spec, timeout_s, 1)


def test_a_timed_out_transactional_run_hands_its_transaction_to_the_watchdog() -> None:
    inflight = InFlight(concurrency=8, claim_batch=100)
    late, detached, committing = _tx_run(1, 0.0), _tx_run(2, 0.0), _tx_run(3, 0.0)
    ended: list[int] = []
    for run in (late, detached, committing):
        inflight.add_claimed([run])
        inflight.started(run)
        assert inflight.attach_tx(run, lambda r=run: ended.append(r.row.id))
    assert inflight.committing(committing)  # about to commit: the watchdog leaves it be
    assert inflight.detach_tx(detached)  # done with its connection before the watchdog looked
    taken, _ = inflight.take_late(monotonic_s() + 1)
    assert {r.row.id for r in taken} == {1, 2}
    assert late.tx_taken and not detached.tx_taken and not committing.tx_taken
    # The late run's connection must not be pooled again; the others' may.
    assert not inflight.detach_tx(late)
    assert inflight.detach_tx(committing)
    # A run the watchdog failed before it began its transaction does not run it.
    assert not inflight.attach_tx(_abandoned(inflight), lambda: None)


def _abandoned(inflight: InFlight) -> ClaimedRun:
    run = _tx_run(4, 0.0)
    inflight.add_claimed([run])
    inflight.started(run)
    inflight.take_late(monotonic_s() + 1)
    return run


def test_a_saturated_listener_claims_half_a_queue_at_a_time_not_each_freed_slot() -> None:
    """With the flight full, one finished run frees one slot: a claim for it alone would be a
    round trip per task (15 keys a claim on average in a 30k wave). No room is offered until
    the queue ahead of the workers has half drained; an idle listener has all of it at once."""
    inflight = InFlight(concurrency=8, claim_batch=100)
    limit = inflight.claim_limit()  # 8 workers + 8 ahead before any run time is known
    assert inflight.claim_room() == limit
    inflight.count = limit - 1  # one run left the full flight
    assert inflight.claim_room() == 0
    inflight.count = limit - 3
    assert inflight.claim_room() == 0
    inflight.count = limit - 4  # half of the 8 queued ahead ran
    assert inflight.claim_room() == 4
    inflight.count = 0
    assert inflight.claim_room() == limit
