"""How the peer benchmark turns what huey/arq handlers recorded into figures (no timing)."""

from __future__ import annotations

import math

from keyexpiry.bench.peers import WARMUP, Run, figures, parse


def test_parse_skips_a_line_the_consumer_is_still_writing() -> None:
    text = "0 1000 1003.5 1003.9\n1 1010 1012.000 1012.250\n2 1020 10"
    assert parse(text) == [Run(0, 1000, 1003.5, 1003.9), Run(1, 1010, 1012.0, 1012.25)]


def test_figures_count_each_task_once_from_its_first_run_and_leave_the_warmup_out() -> None:
    runs = [
        Run(WARMUP, 0, 5.0, 6.0),  # before the wave: must not stretch the span or count
        Run(0, 1000, 1010.0, 1011.0),
        # the same task three times; the one that started first is neither first nor last here
        Run(1, 1500, 1700.0, 1701.0),
        Run(1, 1500, 1600.0, 1601.0),
        Run(1, 1500, 1800.0, 1801.0),
        Run(2, 2000, 2100.0, 2101.0),
    ]
    got = figures(runs)
    assert got["fired"] == 3
    assert got["extra_runs"] == 2
    # lateness of 0, 1 (first run: 100), 2 -> sorted [10, 100, 100]
    assert got["late_p50_ms"] == 100.0
    assert got["late_max_ms"] == 100.0
    assert math.isclose(got["tasks_per_s"], 3 / ((2101.0 - 1010.0) / 1000))


def test_figures_of_nothing_fired() -> None:
    got = figures([Run(WARMUP, 0, 5.0, 6.0)])
    assert got["fired"] == 0 and got["extra_runs"] == 0
    assert math.isnan(got["late_p99_ms"])
    assert "tasks_per_s" not in got
