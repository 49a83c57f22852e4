"""`bench --scenario flow`: its figures from what handlers noted (no server), and one quick round
on real listeners (redis-server and a SQLite ledger)."""

from __future__ import annotations

import math
import time

import pytest

from keyexpiry.bench import flow
from keyexpiry.bench.flow import Run, Variant
from keyexpiry.bench.run import SCENARIOS, format_table
from keyexpiry.flow.rules import parse_rate


def test_the_most_starts_in_any_second_counts_a_half_open_window() -> None:
    assert flow.max_in_window([], 1000) == 0
    # 0 and 1000 are a second apart: never in one [t, t + 1000) window.
    assert flow.max_in_window([0, 1000, 2000], 1000) == 1
    assert flow.max_in_window([0, 999, 1000, 1500, 1999], 1000) == 3  # [999, 1999): 1999 out
    # The busiest second need not start at the first run, nor at a round second.
    times = [0] + [500 + i for i in range(10)] + [1400 + i for i in range(5)]
    assert flow.max_in_window(reversed(times), 1000) == 15  # [500, 1500)


def test_the_most_at_once_does_not_overlap_a_run_ending_as_another_starts() -> None:
    assert flow.max_overlap([]) == 0
    assert flow.max_overlap([(0, 50), (50, 100), (100, 150)]) == 1
    assert flow.max_overlap([(0, 50), (10, 60), (20, 70), (60, 80)]) == 3
    assert flow.max_overlap([(0, 100)] * 4 + [(99, 200)]) == 5


def test_runs_are_read_by_method_and_a_line_being_written_is_skipped() -> None:
    text = (
        "paced 1 1000 1200 5201.5 5201.75\nfree 2 1000 1001 5001 5001\n"
        "paced 3 1000 1300 5301 5302.5\npaced 4 10"
    )
    assert flow.parse_runs(text, "paced") == [
        Run(1, 1000, 1200, 5201.5, 5201.75),
        Run(3, 1000, 1300, 5301, 5302.5),
    ]
    assert flow.parse_runs(text, "limited") == []


def test_figures_of_a_wave() -> None:
    # Run i: due at 10,000 + i, started at 10,000 + 10 i on the shared clock, its handler
    # entered 3 ms later, for 50 ms, on a machine clock 5,000 ms ahead; claimed 2 ms before start.
    runs = [
        Run(i, 10_000 + i, 10_000 + 10 * i, 15_003 + 10 * i, 15_053 + 10 * i) for i in range(200)
    ]
    claims = {i: 10_000 + 10 * i - 2 for i in range(200) if i != 7}  # 7: not in the ledger
    got = flow.figures(runs, 10_000, claims)
    assert got["noted"] == 200
    assert got["due_to_last_start_s"] == 1.99 and got["due_to_last_end_s"] == 2.04
    assert got["first_start_to_last_end_s"] == 2.04
    assert got["max_starts_1s"] == 100  # one every 10 ms
    assert got["max_overlap_noted"] == 5  # 50 ms runs, one every 10 ms
    assert got["max_claims_1s"] == 100
    assert got["claim_to_start_p50_ms"] == 2 and got["claim_to_start_max_ms"] == 2
    assert got["late_p50_ms"] == 900  # run i is 9 i ms late
    assert got["tasks_per_s"] == round(200 / 2.04, 1)
    assert flow.figures([], 0)["noted"] == 0


def test_the_most_starts_and_runs_at_once_are_on_the_machine_clock_both_listeners_share() -> None:
    # Two listeners whose shared clocks disagree by 30 ms: on them their runs seem to overlap
    # and crowd one second; on the machine's clock they do not.
    one = [Run(i, 0, 1000 + 100 * i, 50_000 + 100 * i, 50_050 + 100 * i) for i in range(10)]
    two = [Run(10 + i, 0, 1030 + 100 * i, 50_050 + 100 * i, 50_100 + 100 * i) for i in range(10)]
    got = flow.figures(one + two, 0)
    assert got["max_overlap_noted"] == 1 and got["max_starts_1s"] == 20
    assert flow.clock_spread_ms([one, two]) == 20.0  # 49,000 vs 49,020
    assert math.isnan(flow.clock_spread_ms([[], []]))


def test_ratios_are_to_the_unlimited_wave_of_the_same_round() -> None:
    got = {"due_to_last_end_s": 10.0, "listener_cpu_s": 6.0, "redis_cpu_s": 1.0}
    flow.add_ratios(got, {"due_to_last_end_s": 4.0, "listener_cpu_s": 2.0, "redis_cpu_s": 0.0})
    assert got["time_vs_unlimited"] == 2.5 and got["cpu_vs_unlimited"] == 3.0
    assert "redis_cpu_vs_unlimited" not in got  # no division by a zero


def test_the_variants_of_a_round_and_the_least_time_their_rule_allows() -> None:
    full = flow.variants(quick=False)
    assert [v.label for v in full] == [
        "unlimited n=20000",
        "rate=2000/s n=20000",
        "unlimited n=400 hold=50ms",
        "concurrency=4 n=400 hold=50ms",
    ]
    assert [v.baseline for v in full] == [None, full[0].label, None, full[2].label]
    # The burst (40), then 1,961/s: about 10 s for 20,000.
    assert full[1].ideal_s is not None and math.isclose(full[1].ideal_s, 19_960 / 1961)
    assert full[3].ideal_s == 5.0 and "would take 250 s" in full[3].note
    assert full[0].ideal_s is None
    quick = flow.variants(quick=True)
    assert quick[1].rate == parse_rate("1000/s", "rate") and quick[1].method == "paced_quick"
    assert Variant("x", "limited", 10, concurrency=4, hold_s=0.05).ideal_s == pytest.approx(0.15)
    assert "flow" in SCENARIOS


def test_the_table_shows_the_flow_figures() -> None:
    medians = {
        "rate=2000/s n=20000": {
            "late_p50_ms": 4455.0,
            "max_starts_1s": 2003,
            "cpu_vs_unlimited": 3.8,
        },
        "concurrency=4 n=400 hold=50ms": {"max_at_once": 4, "time_vs_unlimited": 3.9},
    }
    table = format_table(
        {
            "runs": 3,
            "backend": "mariadb",
            "scenarios": {"flow": {k: {"median": m} for k, m in medians.items()}},
        }
    ).splitlines()
    assert table[1].split() == [
        "scenario", "p50", "max_starts_1s", "max_at_once", "time_vs_unlimited", "cpu_vs_unlimited"
    ]  # fmt: skip
    assert table[2].split() == ["flow", "rate=2000/s", "n=20000", "4455.0", "2003", "3.8"]
    assert table[3].split() == ["flow", "concurrency=4", "n=400", "hold=50ms", "4", "3.9"]


@pytest.mark.xdist_group("heavy")
def test_a_quick_round_keeps_each_rule_on_two_listeners() -> None:
    from keyexpiry.bench.harness import servers

    began = time.monotonic()
    with servers(with_mariadb=False) as srv:
        got = flow.one_round(srv, "sqlite", flow.variants(quick=True), quick=True)
    free, paced, unlimited, limited = (got[v.label] for v in flow.variants(quick=True))
    for figures in got.values():
        assert figures["all_fired"] and figures["max_attempts"] == 1, figures
        assert figures["noted"] == figures["n"], figures
        assert figures["listeners"] == 2
    # At most 4 at once over both listeners, and the limit bites (160 runs of 50 ms, due in 1 s).
    assert limited["max_at_once"] <= 4 and limited["max_overlap_noted"] <= 4, limited
    assert unlimited["max_overlap_noted"] <= 16, unlimited  # 8 threads in each listener
    assert unlimited["max_at_once"] > 4, unlimited
    assert limited["first_start_to_last_end_s"] >= 0.9 * limited["ideal_s"], limited
    # The rate holds at the permits (the claims) and, to a handler's lag, at the starts; the
    # wave takes at least the time the rate allows it.
    assert paced["max_claims_1s"] <= 1100 and paced["max_starts_1s"] <= 1100, paced
    assert free["max_starts_1s"] > 1100, free  # the same wave unlimited: all in one second
    assert paced["first_start_to_last_start_s"] >= 0.9 * paced["ideal_s"], paced
    for limited_one in (paced, limited):
        assert limited_one["time_vs_unlimited"] > 1 and limited_one["cpu_vs_unlimited"] > 0
    assert time.monotonic() - began < 60
