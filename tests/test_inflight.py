"""Outcomes gathered before they are recorded: a trickle of ending runs makes one write, not one
each, and nothing waits longer than the gathering interval."""

from __future__ import annotations

import threading

from keyexpiry.clock import monotonic_s
from keyexpiry.inflight import InFlight
from keyexpiry.rows import Outcome, TaskStatus


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
