"""The django benchmark's parts that need no server: its record lines, figures and ratios."""

from __future__ import annotations

import math

from keyexpiry.bench.django_bench import (
    WARMUP,
    Calls,
    Start,
    latency,
    parse,
    part_figures,
    summary,
)
from keyexpiry.bench.run import format_table


def test_parse_skips_a_line_the_listener_is_still_writing() -> None:
    text = "immediate-django 0 1000.5 1003.250\nimmediate-native 0 1000.7 1004.000\ndeferred-dj"
    assert parse(text) == [
        Start("immediate-django", 0, 1000.5, 1003.25),
        Start("immediate-native", 0, 1000.7, 1004.0),
    ]


def test_latency_counts_each_task_once_from_its_first_start_and_leaves_others_out() -> None:
    starts = [
        Start("immediate-django", WARMUP, 0.0, 900.0),  # a warm-up: not a figure
        Start("immediate-django", 0, 1000.0, 1004.0),
        Start("immediate-django", 0, 1000.0, 1003.0),  # ran twice: the first start counts
        Start("immediate-django", 1, 1002.0, 1004.0),
        Start("immediate-native", 2, 1000.0, 1100.0),  # the other kind
    ]
    got = latency(starts, "immediate-django", n=3)
    assert (got["fired"], got["extra_runs"], got["all_fired"]) == (2, 1, False)
    assert (got["late_p50_ms"], got["late_max_ms"]) == (3.0, 3.0)


def test_the_backend_rows_carry_their_ratios_to_the_native_api_in_the_same_run() -> None:
    starts = [Start("deferred-django", i, 0.0, 6.0 + i) for i in range(10)]
    starts += [Start("deferred-native", i, 0.0, 4.0 + i) for i in range(10)]
    calls = {"django": Calls([300e-6, 500e-6, 400e-6], 1.2e-3), "native": Calls([200e-6], 0.3e-3)}
    got = part_figures(starts, "deferred", 10, calls)
    backend, native = got["deferred django"], got["deferred native"]
    assert (backend["late_p50_ms"], native["late_p50_ms"]) == (11.0, 9.0)
    assert backend["p50_vs_native"] == round(11 / 9, 2)
    assert backend["p99_vs_native"] == round(15 / 13, 2)
    assert (backend["enqueue_us"], backend["enqueue_cpu_us"]) == (400.0, 400.0)
    assert (native["enqueue_us"], native["enqueue_cpu_us"]) == (200.0, 300.0)
    assert (backend["enqueue_vs_native"], backend["enqueue_cpu_vs_native"]) == (2.0, 1.33)
    assert "p50_vs_native" not in native


def test_no_start_or_no_call_gives_nan_not_a_ratio_of_zero() -> None:
    got = part_figures([], "immediate", 5, {"django": Calls(), "native": Calls()})
    backend = got["immediate django"]
    assert backend["fired"] == 0 and not backend["all_fired"]
    assert math.isnan(backend["p50_vs_native"]) and math.isnan(backend["enqueue_cpu_vs_native"])


def test_the_table_and_the_summary_show_the_ratios() -> None:
    medians = part_figures(
        [Start(f"immediate-{k}", 0, 0.0, 2.0) for k in ("django", "native")],
        "immediate",
        1,
        {"django": Calls([330e-6], 330e-6), "native": Calls([300e-6], 300e-6)},
    )
    variants = {label: {"median": m, "runs": [m]} for label, m in medians.items()}
    table = format_table({"runs": 1, "backend": "sqlite", "scenarios": {"django": variants}})
    head, django_row = table.splitlines()[1:3]
    assert "p50_vs_native" in head and "enqueue_cpu_vs_native" in head
    assert django_row.startswith("django immediate django") and django_row.endswith("1.1")
    text = summary(variants, 1)
    assert "immediate: p50 1.00x, p99 1.00x, enqueue call 1.10x wall, 1.10x CPU" in text
