"""The run-now benchmark's parts that need no server: its record lines, figures and pacing."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from keyexpiry.bench import runnow
from keyexpiry.bench.peer_runnow import WARMUP
from keyexpiry.bench.run import format_table
from keyexpiry.bench.runnow import Run, burst_figures, latency_figures, paced, parse, per_10k


def test_parse_skips_a_line_a_worker_is_still_writing() -> None:
    text = "0 1000.5 1003.250 1003.900 41\n1 1010.000 1012.000 1012.250 42\n2 1020.0 10"
    assert parse(text) == [Run(0, 1000.5, 1003.25, 1003.9, 41), Run(1, 1010.0, 1012.0, 1012.25, 42)]


def test_keyexpiry_and_peer_handlers_write_lines_the_same_parser_reads(tmp_path: Path) -> None:
    out = tmp_path / "starts.txt"
    script = (
        "import os, time\n"
        "from keyexpiry.bench import peer_runnow, tasks\n"
        "tasks._note_sent(7, 1000.25, time.time())\n"
        f"peer_runnow._out_fd = os.open({str(out)!r}, os.O_WRONLY | os.O_APPEND)\n"
        "peer_runnow.record(8, 2000.5, time.time())\n"
    )
    env = {"KEYEXPIRY_BENCH_STARTS": str(out), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=60)
    runs = parse(out.read_text())
    assert [(r.i, r.sent_ms) for r in runs] == [(7, 1000.25), (8, 2000.5)]
    assert all(r.sent_ms < r.start_ms <= r.end_ms for r in runs)


def test_latency_counts_each_task_once_from_its_first_run_and_leaves_warm_ups_out() -> None:
    runs = [
        Run(WARMUP, 0.0, 5.0, 6.0, 1),
        Run(0, 1000.0, 1010.0, 1011.0, 1),
        Run(1, 1500.0, 1700.0, 1701.0, 1),  # a second run of task 1: not its lateness
        Run(1, 1500.0, 1600.0, 1601.0, 2),
        Run(2, 2000.0, 2100.0, 2101.0, 2),
    ]
    got = latency_figures(runs)
    assert got["fired"] == 3 and got["extra_runs"] == 1
    # lateness 10, 100, 100
    assert got["late_p50_ms"] == 100.0 and got["late_max_ms"] == 100.0


def test_burst_rate_runs_from_the_first_start_to_the_last_end_or_ledger_write() -> None:
    runs = [Run(WARMUP, 0.0, 5.0, 6.0, 1)] + [
        Run(i, 1000.0, 2000.0 + i, 2000.5 + i, 10 + i % 2) for i in range(100)
    ]
    got = burst_figures(runs)
    assert got["fired"] == 100 and got["busy_workers"] == 2
    assert got["tasks_per_s"] == round(100 / ((2099.5 - 2000.0) / 1000))
    # keyexpiry's last row written done after its handler ended: the rate counts to the write
    later = burst_figures(runs, last_end_ms=2199.5)
    assert later["tasks_per_s"] == round(100 / 0.1995)
    assert burst_figures(runs, last_end_ms=100.0)["tasks_per_s"] == got["tasks_per_s"]


def test_the_drain_rate_counts_only_what_started_after_the_last_enqueue_returned() -> None:
    # 100 tasks, one a ms from 2000; the producer returned at 2060: 40 started after it
    runs = [Run(i, 1000.0, 2000.0 + i, 2000.5 + i, 1) for i in range(100)]
    got = burst_figures(runs, None, enqueued_ms=2060.0)
    assert got["drain_per_s"] == round(40 / ((2099.5 - 2060.0) / 1000))
    # fewer than a tenth left after the producer: no figure from so few
    assert "drain_per_s" not in burst_figures(runs, None, enqueued_ms=2095.0)


def test_figures_of_nothing_fired() -> None:
    assert math.isnan(latency_figures([])["late_p99_ms"])
    assert "tasks_per_s" not in burst_figures([Run(WARMUP, 0.0, 5.0, 6.0, 1)])
    assert math.isnan(per_10k(1.0, 0))
    assert per_10k(2.5, 50_000) == 0.5


def test_pacing_never_runs_ahead_of_its_rate() -> None:
    calls: list[tuple[int, float]] = []
    rate = paced(20, 2000, lambda i, sent_ms: calls.append((i, sent_ms)))
    assert [i for i, _ in calls] == list(range(20))
    # call i goes no earlier than i / rate after the first: 20 calls span at least 19 slots
    assert rate <= 2000 * 20 / 19
    sent = [s for _, s in calls]
    assert sent == sorted(sent) and sent[-1] - sent[0] >= 19 / 2000 * 1000 - 1


def test_a_variant_is_missing_with_its_library(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "rq" else real(name)
    )
    absent = runnow.missing()
    assert "rq" in absent and "rq-simple" in absent


def test_the_peer_workers_import_neither_sqlalchemy_nor_the_harness() -> None:
    # Their RSS is the library's: the benchmark's own imports must not weigh on it.
    script = (
        "import sys, keyexpiry.bench.peer_runnow\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'sqlalchemy'"
        " or m in ('keyexpiry.bench.harness', 'keyexpiry.client', 'psutil')))\n"
    )
    got = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True, timeout=60
    )
    assert got.stdout.strip() == "[]"


def test_the_table_shows_the_run_now_columns() -> None:
    medians = {
        "keyexpiry latency": {"late_p99_ms": 4.5, "sent_per_s": 998, "cpu_s_per_10k": 3.1},
        "celery 50k workers=1": {"tasks_per_s": 1200, "enqueue_s": 9.5, "worker_rss_mb": 53.0},
    }
    report = {
        "runs": 1,
        "backend": "mariadb",
        "scenarios": {"run-now": {k: {"median": m} for k, m in medians.items()}},
    }
    header = format_table(report).splitlines()[1].split()
    assert header == [
        "scenario",
        "p99",
        "sent_per_s",
        "tasks_per_s",
        "enqueue_s",
        "cpu_s_per_10k",
        "worker_rss_mb",
    ]
