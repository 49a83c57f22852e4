"""The intake's lanes: a due task read from the ledger (the front lane) whose event still waits
further back is claimed once, not twice."""

from __future__ import annotations

from keyexpiry.runner.inflight import DispatchStats
from keyexpiry.runner.intake import Intake


def _intake() -> Intake:
    return Intake(DispatchStats(), max_backlog=64, max_queued=1000)


def test_a_key_taken_from_the_front_lane_is_not_claimed_again_from_its_event() -> None:
    intake = _intake()
    intake.submit(["A@m@1", "A@m@2", "A@m@3"])
    intake.put_first(["A@m@2"])  # read from the ledger after events were dropped
    assert intake.take(1) == ["A@m@2"]
    # The event's copy of A@m@2 waits between the others: skipped, not claimed a second time.
    assert intake.take(10) == ["A@m@1", "A@m@3"]
    assert intake.take(10) == []


def test_a_new_sighting_after_the_front_lane_took_the_key_is_claimed() -> None:
    """The task moved and fell due again: its new event must not be lost to the skip."""
    intake = _intake()
    intake.submit(["A@m@1"])
    intake.put_first(["A@m@1"])
    assert intake.take(1) == ["A@m@1"]
    intake.submit(["A@m@1"])  # queued anew behind the stale copy
    assert intake.take(10) == ["A@m@1"]
    assert intake.take(10) == []


def test_a_front_lane_key_with_no_event_waiting_skips_nothing() -> None:
    intake = _intake()
    intake.put_first(["A@m@1"])
    assert intake.take(1) == ["A@m@1"]
    intake.submit(["A@m@1"])  # a later event of the same key
    assert intake.take(10) == ["A@m@1"]
