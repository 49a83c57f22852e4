"""The suite's own scheduling (tests/slots.py): where the fault scenarios go in a run."""

from __future__ import annotations

from tests.slots import QUICK_S, expected_durations, spread_by_time, ungrouped_id


def _is_fault(name: str) -> bool:
    return name.startswith("f")


def test_takers_are_spread_by_their_expected_time_not_by_count() -> None:
    takers = ["f_long", "f_short1", "f_short2"]
    others = [f"o{i}" for i in range(20)]
    durations = {"f_long": 20.0, "f_short1": 5.0, "f_short2": 5.0, **{o: 1.0 for o in others}}
    spread = spread_by_time(takers + others, _is_fault, durations)
    assert sorted(spread) == sorted(takers + others)
    # Each taker is followed by its share of the others' 20 s: 20/30 of it, then 5/30 each.
    assert spread.index("f_short1") - spread.index("f_long") - 1 == 14
    assert spread.index("f_short2") - spread.index("f_short1") - 1 == 3
    assert [i for i in spread if _is_fault(i)] == takers  # each list keeps its order
    assert [i for i in spread if not _is_fault(i)] == others


def test_grouped_tests_go_first_and_unknown_tests_get_defaults() -> None:
    items = ["o1", "f1", "heavy@heavy", "o2", "f2", "o3", "o4"]
    # f2 unknown: the known takers' median (f1's 4 s); o3, o4 unknown: QUICK_S each.
    spread = spread_by_time(items, _is_fault, {"f1": 4.0, "o1": 0.1, "o2": 0.1})
    assert spread[0] == "heavy@heavy"
    assert spread[1:] == ["f1", "o1", "o2", "f2", "o3", "o4"]
    assert QUICK_S < 0.1


def test_without_takers_or_others_the_order_stays() -> None:
    assert spread_by_time(["o1", "o2"], _is_fault, {}) == ["o1", "o2"]
    assert spread_by_time(["f1", "f2"], _is_fault, {}) == ["f1", "f2"]


def test_the_committed_durations_are_read() -> None:
    durations = expected_durations()
    # A missing or broken file would spread the takers by defaults alone, unseen.
    assert len(durations) > 100
    assert all(s >= 0.5 for s in durations.values())


def test_a_group_suffix_is_told_from_an_at_sign_in_a_parameter() -> None:
    assert ungrouped_id("tests/a.py::test_x@heavy") == "tests/a.py::test_x"
    assert ungrouped_id("tests/a.py::test_x[sqlite-2]@heavy") == "tests/a.py::test_x[sqlite-2]"
    key = "tests/a.py::test_x[sqlite-os@system@ls-args6]"
    assert ungrouped_id(key) == key
    assert ungrouped_id(key + "@heavy") == key
    assert ungrouped_id("tests/a.py::test_x") == "tests/a.py::test_x"
    # A parameter with `@` is not mistaken for a grouped test: it keeps its place.
    items = ["f1", key, "o1"]
    assert spread_by_time(items, lambda i: i.startswith("f"), {"f1": 1.0}) == items
