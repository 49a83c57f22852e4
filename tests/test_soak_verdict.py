"""The soak benchmark's verdict and plots on synthetic histories (no servers).

Each test writes the files the soak runner would (`produced.jsonl`, `runs-<pid>.jsonl`,
`faults.jsonl`, `samples.jsonl`) into tmp_path and checks what `verdict()` makes of them.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from keyexpiry.bench.soak import _growth_rule, summary
from keyexpiry.bench.soak_plots import plot
from keyexpiry.bench.soak_verdict import growth_check, verdict

T0_MS = 1_700_000_000_000
PID_A, PID_B, PID_C = 101, 102, 103


def ms(t_s: float) -> int:
    """Seconds since the run's start as epoch ms."""
    return T0_MS + round(t_s * 1000)


class Recorder:
    """Builds a soak run's history the way the runner writes it."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.produced: list[dict[str, Any]] = []
        self.runs: dict[int, list[dict[str, Any]]] = defaultdict(list)
        self.faults: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []

    def create(
        self,
        i: int,
        due_s: float,
        kind: str = "normal",
        t_s: float = 1.0,
        ambiguous: bool = False,
        unarmed: bool = False,
    ) -> None:
        line = {"op": "create", "t_ms": ms(t_s), "i": i, "due_ms": ms(due_s), "kind": kind}
        flags = {"ambiguous": True} if ambiguous else {}
        if unarmed:
            flags["unarmed"] = True
        self.produced.append({**line, "via": "plain", **flags})

    def reschedule(self, i: int, t_s: float, due_s: float, ambiguous: bool = False) -> None:
        line = {"op": "reschedule", "t_ms": ms(t_s), "i": i, "due_ms": ms(due_s)}
        self.produced.append({**line, **({"ambiguous": True} if ambiguous else {})})

    def cancel(self, i: int, t_s: float, ok: bool) -> None:
        self.produced.append({"op": "cancel", "t_ms": ms(t_s), "i": i, "ok": ok})

    def cancel_tag(self, t_s: float, ids: list[int], cancelled: int) -> None:
        self.produced.append(
            {"op": "cancel_tag", "t_ms": ms(t_s), "ids": ids, "cancelled": cancelled}
        )

    def run(
        self,
        i: int,
        start_s: float,
        end_s: float | None = None,
        result: str = "ok",
        attempt: int = 1,
        pid: int = PID_A,
    ) -> None:
        self.runs[pid].append(
            {
                "ev": "start",
                "i": i,
                "attempt": attempt,
                "pid": pid,
                "t_ms": ms(start_s),
                "due_ms": ms(start_s),
            }
        )
        if end_s is not None:
            self.runs[pid].append(
                {
                    "ev": "end",
                    "i": i,
                    "attempt": attempt,
                    "pid": pid,
                    "t_ms": ms(end_s),
                    "result": result,
                }
            )

    def fault(
        self,
        kind: str,
        start_s: float,
        end_s: float,
        pids: tuple[int, ...] = (),
        hit_s: float | None = None,
    ) -> None:
        line: dict[str, Any] = {
            "fault": kind,
            "start_ms": ms(start_s),
            "end_ms": ms(end_s),
            "pids": list(pids),
            "detail": "",
        }
        if hit_s is not None:
            line["hit_ms"] = ms(hit_s)
        self.faults.append(line)

    def sample(
        self,
        t_s: float,
        listeners: list[dict[str, Any]],
        redis_used_bytes: int = 1_000_000,
        ledger_rows: dict[str, int] | None = None,
    ) -> None:
        self.samples.append(
            {
                "t_ms": ms(t_s),
                "listeners": listeners,
                "redis_used_bytes": redis_used_bytes,
                "ledger_rows": ledger_rows or {"pending": 1000, "running": 3, "done": 200},
            }
        )

    def write(self) -> Path:
        def dump(name: str, rows: list[dict[str, Any]]) -> None:
            text = "".join(json.dumps(r) + "\n" for r in rows)
            (self.run_dir / name).write_text(text, encoding="utf-8")

        dump("produced.jsonl", self.produced)
        for pid, rows in self.runs.items():
            dump(f"runs-{pid}.jsonl", rows)
        dump("faults.jsonl", self.faults)
        dump("samples.jsonl", self.samples)
        return self.run_dir


def listener(
    slot: int, pid: int, started_s: float, rss_mb: float = 80.0, fds: int = 20, **more: Any
) -> dict[str, Any]:
    """One listener's entry in a sample."""
    entry = {
        "slot": slot,
        "pid": pid,
        "started_ms": ms(started_s),
        "rss_mb": rss_mb,
        "fds": fds,
        "threads": 12,
        "ledger_conns": 4,
        "redis_conns": 3,
        "cpu_s": 1.0,
    }
    entry.update(more)
    return entry


def params(**overrides: Any) -> dict[str, Any]:
    """A 10-minute run's parameters: production ends at 600 s, the run at 700 s."""
    base: dict[str, Any] = {
        "start_ms": T0_MS,
        "produce_end_ms": ms(600),
        "end_ms": ms(700),
        "warm_up_s": 120,
        "max_due_s": 300,
        "max_attempts": 3,
        "settle_s": 10,
        "growth_limit": 0.10,
        "retain_done_s": 60,
        "prune_every_s": 30,
        "rate_per_s": 10,
    }
    base.update(overrides)
    return base


@pytest.fixture
def rec(tmp_path: Path) -> Recorder:
    return Recorder(tmp_path)


def judge(rec: Recorder, **overrides: Any) -> dict[str, Any]:
    report = verdict(rec.write(), params(**overrides))
    json.dumps(report, allow_nan=False)  # JSON-serialisable, no NaN
    return report


def fate_ids(report: dict[str, Any], fate: str) -> list[int]:
    section = report["fates"][fate]
    assert section["count"] == len(section["examples"])  # the tests stay under 20 a fate
    return [e["i"] for e in section["examples"]]


# --- fates ---------------------------------------------------------------------------------


def test_each_kind_as_designed_passes(rec: Recorder) -> None:
    rec.create(1, due_s=10)
    rec.run(1, 10.01, 10.02)
    rec.create(2, due_s=10, kind="fail_once")
    rec.run(2, 10.01, 10.02, "fail")
    rec.run(2, 12.0, 12.01, attempt=2, pid=PID_B)
    # The retry starts while the timed-out first run still sleeps (GUARANTEES window 2).
    rec.create(3, due_s=10, kind="slow_once")
    rec.run(3, 10.01, 16.0, "slow")
    rec.run(3, 15.5, 15.6, attempt=2, pid=PID_B)
    rec.create(4, due_s=10, kind="dead")
    for attempt in (1, 2, 3):
        rec.run(4, 10 + 2 * attempt, 10.1 + 2 * attempt, "fail", attempt=attempt)
    report = judge(rec)
    assert report["passed"], report["failures"]
    assert fate_ids(report, "ran_once") == [1, 2, 3]
    assert fate_ids(report, "dead_by_design") == [4]
    assert report["fates"]["ran_twice_undocumented"]["count"] == 0
    assert report["created_by_kind"] == {"normal": 1, "fail_once": 1, "slow_once": 1, "dead": 1}


def test_a_task_never_run_is_lost_unless_due_after_the_end(rec: Recorder) -> None:
    rec.create(1, due_s=100)
    rec.create(2, due_s=750)  # due after end_ms (700 s): not judged
    rec.create(3, due_s=100, kind="fail_once")
    rec.run(3, 100.0, 100.1, "fail")  # its retry never came
    report = judge(rec)
    assert fate_ids(report, "lost") == [1, 3]
    assert fate_ids(report, "unfinished") == [2]
    assert not report["passed"]
    assert any("2 task(s) lost" in f for f in report["failures"])


def test_unfinished_grace_spares_tasks_due_just_before_the_end(rec: Recorder) -> None:
    rec.create(1, due_s=695)
    assert judge(rec)["fates"]["lost"]["count"] == 1
    assert fate_ids(judge(rec, unfinished_grace_s=10), "unfinished") == [1]


def test_two_ok_runs_without_a_fault_are_an_undocumented_duplicate(rec: Recorder) -> None:
    rec.create(1, due_s=10)
    rec.run(1, 10.0, 10.1)
    rec.run(1, 10.05, 10.2, pid=PID_B)
    rec.create(2, due_s=10)
    rec.run(2, 10.0, 10.1)
    rec.run(2, 30.0, 30.1, "fail", attempt=2, pid=PID_B)  # any start after the ok end counts
    report = judge(rec)
    assert fate_ids(report, "ran_twice_undocumented") == [1, 2]
    example = report["fates"]["ran_twice_undocumented"]["examples"][0]
    assert example["window_hints"] == ["none: no fault between the runs"]
    assert len(example["runs"]) == 2
    assert any("ran_twice_undocumented" in f for f in report["failures"])


def test_a_second_run_after_kill9_of_the_first_ones_listener_is_documented(rec: Recorder) -> None:
    rec.create(1, due_s=10)
    rec.run(1, 10.0, 10.1, pid=PID_A)  # did the work; killed before `done` was written
    rec.fault("kill9", 10.15, 10.15, pids=(PID_A,))
    rec.run(1, 25.0, 25.1, attempt=2, pid=PID_B)
    report = judge(rec)
    assert fate_ids(report, "ran_twice_documented") == [1]
    assert report["fates"]["ran_twice_documented"]["by_fault"] == {"kill9": 1}
    assert report["passed"], report["failures"]


def test_a_partition_from_the_ledger_documents_a_second_run_but_one_from_redis_does_not(
    rec: Recorder,
) -> None:
    # A listener cut off from the database cannot record the outcome of the run it holds, and
    # its peer takes it over (GUARANTEES window 1); cut off from Redis, it still can.
    rec.create(1, due_s=10)
    rec.run(1, 10.0, 10.1, pid=PID_A)
    rec.fault("net_partition_ledger", 10.05, 30.0, pids=(PID_A,))
    rec.run(1, 16.0, 16.1, attempt=2, pid=PID_B)
    rec.create(2, due_s=40)
    rec.run(2, 40.0, 40.1, pid=PID_A)
    rec.fault("net_partition_redis", 40.05, 60.0, pids=(PID_A,))
    rec.run(2, 46.0, 46.1, attempt=2, pid=PID_B)
    # Seen in the first --network soak: claimed just before the rules took hold, started 11 ms
    # after the fault's stamp, its outcome never recorded.
    rec.create(3, due_s=70)
    rec.fault("net_partition_ledger", 69.999, 90.0, pids=(PID_A,))
    rec.run(3, 70.01, 70.01, pid=PID_A)
    rec.run(3, 75.27, 75.27, attempt=2, pid=PID_B)
    # Started after the partition had ended: not covered.
    rec.create(4, due_s=95)
    rec.run(4, 95.0, 95.0, pid=PID_A)
    rec.run(4, 96.0, 96.0, attempt=2, pid=PID_B)
    report = judge(rec)
    assert fate_ids(report, "ran_twice_documented") == [1, 3]
    assert report["fates"]["ran_twice_documented"]["by_fault"] == {"net_partition_ledger": 2}
    assert fate_ids(report, "ran_twice_undocumented") == [2, 4]


def test_a_second_run_of_an_ambiguous_create_retried_is_documented(rec: Recorder) -> None:
    rec.create(1, due_s=10, ambiguous=True)  # the first create's answer was lost, then retried
    rec.run(1, 10.0, 10.1)
    rec.run(1, 10.5, 10.6, pid=PID_B)
    rec.create(2, due_s=10)  # the same without the flag: a defect
    rec.run(2, 10.0, 10.1)
    rec.run(2, 10.5, 10.6, pid=PID_B)
    report = judge(rec)
    assert fate_ids(report, "ran_twice_documented") == [1]
    assert report["fates"]["ran_twice_documented"]["by_fault"] == {"ambiguous_create": 1}
    assert fate_ids(report, "ran_twice_undocumented") == [2]


def test_a_run_between_a_reschedule_and_its_retry_is_documented_only_when_flagged(
    rec: Recorder,
) -> None:
    # The producer's reschedule failed, was retried past the old due (or may have committed):
    # the task ran, then the retry created it again (CI on f536b30, a Cluster failover).
    rec.create(1, due_s=10)
    rec.run(1, 10.0, 10.1)
    rec.reschedule(1, 9, due_s=14, ambiguous=True)
    rec.run(1, 14.0, 14.1, pid=PID_B)
    rec.create(2, due_s=10)
    rec.run(2, 10.0, 10.1)
    rec.reschedule(2, 9, due_s=14)
    rec.run(2, 14.0, 14.1, pid=PID_B)
    report = judge(rec)
    assert fate_ids(report, "ran_twice_documented") == [1]
    assert fate_ids(report, "ran_twice_undocumented") == [2]


def test_a_frozen_listener_finishing_after_its_takeover_is_documented(rec: Recorder) -> None:
    rec.create(1, due_s=10)
    rec.run(1, 10.0, 30.5, pid=PID_A)  # frozen 10.2 .. 30.2, ends after resuming
    rec.fault("sigstop", 10.2, 30.2, pids=(PID_A,))
    rec.run(1, 20.0, 20.1, attempt=2, pid=PID_B)
    report = judge(rec)
    assert fate_ids(report, "ran_twice_documented") == [1]


@pytest.mark.parametrize(
    ("started_s", "documented"),
    [
        pytest.param(10.05, True, id="between the stamp and the signal"),
        pytest.param(10.14, True, id="within the clocks' slack after it"),
        pytest.param(10.2, False, id="after the signal"),
    ],
)
def test_a_run_that_started_before_the_signal_came_is_one_it_hit(
    rec: Recorder, started_s: float, documented: bool
) -> None:
    # The driver stamps a fault, then signals once it holds its fleet's lock: a run may start
    # in between (CI, 2026-12-07: a SIGSTOP's run, taken over and run again, was judged an
    # undocumented duplicate). A frozen or dead process starts nothing after the signal.
    rec.create(1, due_s=10)
    rec.run(1, started_s, 16.5, pid=PID_A)
    rec.fault("sigstop", 10.0, 16.0, pids=(PID_A,), hit_s=10.1)
    rec.run(1, 15.6, 15.7, attempt=2, pid=PID_B)
    fate = "ran_twice_documented" if documented else "ran_twice_undocumented"
    assert fate_ids(judge(rec), fate) == [1]


@pytest.mark.parametrize(
    ("fault_s", "pids"),
    [
        (9.0, (PID_A,)),  # before the first run started: its handler was not hit
        (26.0, (PID_A,)),  # after the second run started: cannot explain it
        (10.15, (PID_C,)),  # another listener
    ],
)
def test_a_kill9_that_cannot_explain_the_second_run_does_not_document_it(
    rec: Recorder, fault_s: float, pids: tuple[int, ...]
) -> None:
    rec.create(1, due_s=10)
    rec.run(1, 10.0, 10.1, pid=PID_A)
    rec.fault("kill9", fault_s, fault_s, pids=pids)
    rec.run(1, 25.0, 25.1, attempt=2, pid=PID_B)
    report = judge(rec)
    assert fate_ids(report, "ran_twice_undocumented") == [1]
    assert not report["passed"]


def test_a_failed_run_on_a_killed_listener_does_not_document_a_later_duplicate(
    rec: Recorder,
) -> None:
    rec.create(1, due_s=10, kind="fail_once")
    rec.run(1, 10.0, 10.1, "fail", pid=PID_A)  # did no work: it raised
    rec.fault("kill9", 11, 11, pids=(PID_A,))
    rec.run(1, 12.0, 12.1, attempt=2, pid=PID_B)
    rec.run(1, 20.0, 20.1, attempt=3, pid=PID_C)
    report = judge(rec)
    assert fate_ids(report, "ran_twice_undocumented") == [1]


ASYNC = {"lost_commit_faults": ["pg_kill_primary"], "lost_commit_window_ms": 2000}
"""A Patroni ledger with asynchronous replication: a primary lost may take its last 2 s."""


def test_asynchronous_replication_documents_what_a_lost_primary_took(rec: Recorder) -> None:
    rec.fault("pg_kill_primary", 30, 41)
    rec.create(1, due_s=29.0, t_s=20)
    rec.run(1, 29.0, 29.1)  # its outcome committed 0.9 s before the kill, missing after it
    rec.run(1, 45.0, 45.1, pid=PID_B)
    rec.create(2, due_s=50, t_s=29.5)  # created 0.5 s before the kill: its row went with it
    rec.create(3, due_s=60, t_s=10)
    rec.cancel(3, 29.8, ok=True)  # the cancel went with it
    rec.run(3, 60.0, 60.1)
    rec.create(4, due_s=60, t_s=10)
    rec.reschedule(4, 29.0, due_s=80)  # the reschedule went with it: runs at the old due
    rec.run(4, 60.0, 60.1)
    report = judge(rec, **ASYNC)
    assert fate_ids(report, "ran_twice_documented") == [1]
    assert report["fates"]["ran_twice_documented"]["by_fault"] == {"pg_kill_primary": 1}
    assert fate_ids(report, "lost_with_commit") == [2]
    assert fate_ids(report, "ran_once") == [3, 4]
    assert report["early"]["starts"] == 0
    assert report["passed"], report["failures"]


def test_the_lost_commit_window_is_only_the_seconds_before_the_loss(rec: Recorder) -> None:
    rec.fault("pg_kill_primary", 30, 41)
    rec.create(1, due_s=20.0, t_s=10)
    rec.run(1, 20.0, 20.1)  # 10 s before the kill: replicated long since
    rec.run(1, 45.0, 45.1, pid=PID_B)
    rec.create(2, due_s=50, t_s=20)  # never ran: lost, not explained
    rec.create(3, due_s=60, t_s=10)
    rec.cancel(3, 20.0, ok=True)
    rec.run(3, 60.0, 60.1)
    # Answered by the promoted standby, during the fault: a loss of the new primary's
    # (a switchover onto a standby not streaming yet did that to 2,000 tasks in a soak).
    rec.create(4, due_s=50, t_s=35)
    for overrides in (ASYNC, {}):  # and none of it without asynchronous replication
        report = judge(rec, **overrides)
        assert fate_ids(report, "ran_twice_undocumented") == [1]
        assert fate_ids(report, "lost") == [2, 4]
        assert fate_ids(report, "ran_after_cancel") == [3]
    report = judge(rec)
    assert report["fates"]["lost_with_commit"]["count"] == 0


def test_a_stall_hints_window_1_and_counts_when_configured(rec: Recorder) -> None:
    rec.create(1, due_s=10)
    rec.run(1, 10.0, 21.0, pid=PID_A)
    rec.fault("stall", 10.5, 20.5, pids=(PID_A,))
    rec.run(1, 18.0, 18.1, attempt=2, pid=PID_B)
    report = judge(rec)
    [hint] = report["fates"]["ran_twice_undocumented"]["examples"][0]["window_hints"]
    assert hint.startswith("1: listener [101] cut off from the database")
    assert report["fates"]["ran_twice_undocumented"]["by_window"] == {"1": 1}
    configured = judge(rec, window1_faults=["kill9", "sigstop", "stall"])
    assert fate_ids(configured, "ran_twice_documented") == [1]


def test_a_run_before_the_create_returned_hints_a_retried_create(rec: Recorder) -> None:
    rec.create(1, due_s=10, t_s=12)  # the call that returned; an earlier try had committed
    rec.run(1, 10.0, 10.1)
    rec.run(1, 13.0, 13.1, pid=PID_B)
    report = judge(rec)
    [hint] = report["fates"]["ran_twice_undocumented"]["examples"][0]["window_hints"]
    assert hint.startswith("3: ran before its create call returned")


def test_a_killed_run_retried_is_not_a_duplicate(rec: Recorder) -> None:
    rec.create(1, due_s=10)
    rec.run(1, 10.0, pid=PID_A)  # no end: killed mid-run
    rec.fault("kill9", 10.05, 10.05, pids=(PID_A,))
    rec.run(1, 25.0, 25.1, attempt=2, pid=PID_B)
    rec.create(2, due_s=10)
    rec.run(2, 10.0, pid=PID_C)  # no end, yet no fault hit its listener
    rec.run(2, 25.0, 25.1, attempt=2, pid=PID_B)
    report = judge(rec)
    assert fate_ids(report, "ran_once") == [1, 2]
    assert report["passed"], report["failures"]
    # Not a failure, but a listener died without an injected fault: worth a look.
    assert report["vanished_then_retried"]["count"] == 1
    assert report["vanished_then_retried"]["examples"][0]["i"] == 2


def test_cancels(rec: Recorder) -> None:
    rec.create(1, due_s=30)
    rec.cancel(1, 5, ok=True)
    rec.create(2, due_s=30)
    rec.cancel(2, 5, ok=True)
    rec.run(2, 30.0, 30.1)  # ran although the cancel took effect
    rec.create(3, due_s=30)
    rec.cancel(3, 29.99, ok=False)  # too late: it runs, and that is fine
    rec.run(3, 30.0, 30.1)
    rec.create(4, due_s=30, kind="fail_once")
    rec.run(4, 30.0, 30.1, "fail")
    rec.cancel(4, 31, ok=True)  # its retry cancelled
    report = judge(rec)
    assert fate_ids(report, "cancelled") == [1, 4]
    assert fate_ids(report, "ran_after_cancel") == [2]
    assert fate_ids(report, "ran_once") == [3]
    assert any("ran_after_cancel" in f for f in report["failures"])


def test_cancel_tag_members(rec: Recorder) -> None:
    for i in (1, 2, 3):
        rec.create(i, due_s=30)
    rec.cancel_tag(5, [1, 2, 3], cancelled=2)
    rec.run(3, 30.0, 30.1)  # the one the call did not cancel
    report = judge(rec)
    assert fate_ids(report, "cancelled") == [1, 2]
    assert fate_ids(report, "ran_once") == [3]
    assert report["cancel_tag_overruns"] == []
    assert report["passed"], report["failures"]


def test_cancel_tag_that_cancelled_more_than_stayed_unstarted_fails(rec: Recorder) -> None:
    for i in (1, 2, 3):
        rec.create(i, due_s=30)
    rec.cancel_tag(5, [1, 2, 3], cancelled=2)
    rec.run(2, 30.0, 30.1)
    rec.run(3, 30.0, 30.1)
    rec.create(4, due_s=30)
    rec.cancel_tag(5, [4], cancelled=-1)  # a cancel retried: whether it took effect is unknown
    rec.run(4, 30.0, 30.1)
    report = judge(rec)
    assert report["cancel_tag_overruns"] == [
        {"t_ms": ms(5), "ids": 3, "cancelled": 2, "started_after": 2}
    ]
    assert fate_ids(report, "ran_once") == [2, 3, 4]
    assert not report["passed"]


def test_dead_tasks(rec: Recorder) -> None:
    rec.create(1, due_s=10, kind="dead")
    rec.run(1, 10.0, 10.1, "fail")
    rec.run(1, 12.0, 12.1, "fail", attempt=2)  # the third attempt never came
    rec.create(2, due_s=10, kind="dead")
    rec.run(2, 10.0, 10.1, "ok")
    rec.create(3, due_s=800, kind="dead")
    report = judge(rec)
    assert fate_ids(report, "dead_short") == [1]
    assert fate_ids(report, "dead_ran_ok") == [2]
    assert fate_ids(report, "unfinished") == [3]
    assert not report["passed"]


def test_a_dead_task_whose_attempt_was_lost_with_a_frozen_listener_is_documented(
    rec: Recorder,
) -> None:
    # The Sentinel hour: the third attempt claimed just before its listener was frozen 20 s;
    # the takeover counted it, and the task died after two runs.
    rec.create(1, due_s=10, kind="dead")
    rec.run(1, 10.0, 10.1, "fail")
    rec.run(1, 10.6, 10.7, "fail", attempt=2)
    rec.fault("sigstop", 11.7, 31.7, pids=(PID_B,))
    # The same shape with the fault long after the last run: nothing explains the lost attempt.
    rec.create(2, due_s=100, kind="dead")
    rec.run(2, 100.0, 100.1, "fail")
    rec.run(2, 100.6, 100.7, "fail", attempt=2)
    rec.fault("kill9", 130, 131, pids=(PID_C,))
    # Two runs short: one lost claim explains one attempt, not two.
    rec.create(3, due_s=200, kind="dead")
    rec.run(3, 200.0, 200.1, "fail")
    rec.fault("sigstop", 201, 221, pids=(PID_B,))
    # The Cluster hour: the second attempt claimed 4 ms before its listener was frozen; the
    # takeover counted it and ran the third, which failed: attempts 1 and 3, dead.
    rec.create(4, due_s=300, kind="dead")
    rec.run(4, 300.0, 300.1, "fail")
    rec.fault("sigstop", 300.6, 320.6, pids=(PID_B,))
    rec.run(4, 305.8, 305.9, "fail", attempt=3)
    # Attempts 1 and 3 with no fault after the first: unexplained.
    rec.create(5, due_s=400, kind="dead")
    rec.run(5, 400.0, 400.1, "fail")
    rec.run(5, 430.0, 430.1, "fail", attempt=3)
    report = judge(rec)
    assert fate_ids(report, "dead_attempt_lost") == [1, 4]
    assert fate_ids(report, "dead_short") == [2, 3, 5]


# --- due times: reschedules, early starts, lateness ----------------------------------------


def test_a_reschedule_moves_the_due_used_for_lateness_and_early(rec: Recorder) -> None:
    rec.create(1, due_s=30)
    rec.reschedule(1, 5, due_s=60)
    rec.run(1, 60.2, 60.3)  # 200 ms late against the new due, not 30.2 s
    rec.create(2, due_s=60)
    rec.reschedule(2, 5, due_s=20)
    rec.run(2, 20.1, 20.2)  # moved earlier: on time, not 39.9 s early
    rec.create(3, due_s=30)
    rec.reschedule(3, 5, due_s=60)
    rec.run(3, 40.0, 40.1)  # at the old due: 20 s early
    rec.create(4, due_s=10, kind="fail_once")
    rec.run(4, 10.1, 10.2, "fail")  # on time for the due of then
    rec.reschedule(4, 11, due_s=60)
    rec.run(4, 60.0, 60.1, attempt=2)
    report = judge(rec)
    assert report["early"]["starts"] == 1
    assert [e["i"] for e in report["early"]["examples"]] == [3]
    outside = report["lateness"]["outside"]
    assert outside["count"] == 4
    assert outside["p50"] == 100
    assert outside["max"] == 200
    assert any("early" in f for f in report["failures"])


def test_early_tolerance_is_5_ms(rec: Recorder) -> None:
    rec.create(1, due_s=30)
    rec.run(1, 29.995, 30.1)
    rec.create(2, due_s=30)
    rec.run(2, 29.994, 30.1)
    report = judge(rec)
    assert [e["i"] for e in report["early"]["examples"]] == [2]


def test_lateness_inside_and_outside_fault_windows(rec: Recorder) -> None:
    for n in range(100):  # due outside any window, 20 ms late; one 900 ms late
        rec.create(n, due_s=100 + n * 0.1)
        rec.run(n, 100 + n * 0.1 + (0.9 if n == 50 else 0.02), 200.0)
    rec.fault("failover", 300, 305)
    rec.create(1000, due_s=312)  # in the settle time after the failover
    rec.run(1000, 315.0, 315.1)
    rec.create(1001, due_s=316)  # past the settle time: outside
    rec.run(1001, 316.03, 316.1)
    rec.create(1002, due_s=400, kind="fail_once")
    rec.fault("kill9", 399, 399)
    rec.run(1002, 400.5, 400.6, "fail")
    rec.run(1002, 430.0, 430.1, attempt=2)  # a retry: does not count for lateness
    rec.create(1003, due_s=498)  # due before the fault, still waiting when it struck: inside
    rec.fault("sigstop", 499, 510)
    rec.run(1003, 503.0, 503.1)
    report = judge(rec)
    lateness = report["lateness"]
    assert lateness["inside_by_fault"]["sigstop"] == {
        "count": 1, "p50": 5000, "p99": 5000, "p99.9": 5000, "max": 5000
    }  # fmt: skip
    assert lateness["outside"]["count"] == 101
    assert lateness["outside"]["p50"] == 20
    assert lateness["outside"]["p99"] == 30
    assert lateness["outside"]["max"] == 900
    assert lateness["inside"] == {"count": 3, "p50": 3000, "p99": 5000, "p99.9": 5000, "max": 5000}
    assert lateness["inside_by_fault"]["failover"]["max"] == 3000
    assert lateness["inside_by_fault"]["kill9"]["max"] == 500


def test_the_latest_outside_starts_are_listed_and_unarmed_creates_counted_apart(
    rec: Recorder,
) -> None:
    for n in range(50):
        rec.create(n, due_s=100 + n * 0.1)
        rec.run(n, 100 + n * 0.1 + 0.01 * (n % 7), 200.0)
    rec.create(60, due_s=150, t_s=150.17)  # created 170 ms after its due, run 12.6 s later
    rec.run(60, 162.77, 162.8)
    rec.create(61, due_s=160, t_s=160.2, unarmed=True)  # its key not set: the overdue repair
    rec.run(61, 170.5, 170.6)
    lateness = judge(rec)["lateness"]
    assert lateness["outside"]["count"] == 51
    assert lateness["outside"]["max"] == 12770
    assert lateness["unarmed_creates"]["count"] == 1
    assert lateness["unarmed_creates"]["max"] == 10500
    latest = lateness["outside_latest"]
    assert latest[0]["i"] == 60
    assert [w["late_ms"] for w in latest[1:]] == [60] * 4
    assert latest[0]["created_after_due_ms"] == 170
    assert latest[0]["late_ms"] == 12770 and latest[0]["pid"] == PID_A
    # Due from 100 s to 160 s: one interval of five minutes, all the outside starts in it.
    assert [(b["from_s"], b["count"], b["max"]) for b in lateness["outside_by_interval"]] == [
        (0, 51, 12770)
    ]


def test_tail_targets_name_each_kind_of_faults_worst_instance(rec: Recorder) -> None:
    for n in range(200):  # outside: 10 ms late, but for one 1.2 s late (the max bound is 1 s)
        rec.create(n, due_s=100 + n * 0.1)
        rec.run(n, 100 + n * 0.1 + (1.2 if n == 7 else 0.01), 200.0)
    # Two stalls of 10 s: the first's latest start 12 s late (within 10 s + 10 s), the
    # second's 21 s (1 s past the bound): the kind is judged by its worst instance.
    rec.fault("stall", 300, 310)
    rec.create(1000, due_s=301)
    rec.run(1000, 313.0, 313.1)
    rec.fault("stall", 400, 410)
    rec.create(1001, due_s=401)
    rec.run(1001, 422.0, 422.1)
    rec.fault("flushall", 500, 500.2)
    for n in range(2000, 2010):
        rec.create(n, due_s=500.1)
        rec.run(n, 500.6, 500.7)
    tails = {t["target"]: t for t in judge(rec)["tails"]}
    assert {name: t["met"] for name, t in tails.items()} == {
        "outside faults p99": True,
        "outside faults max": False,
        "flushall p99": True,
        "stall p99": False,
        "flushall max past its length": True,
        "stall max past its length": False,
    }
    assert tails["outside faults max"]["ms"] == 1200
    assert tails["stall max past its length"]["ms"] == 21_000 - 10_000
    assert tails["flushall p99"]["ms"] == 500
    assert judge(rec)["lateness"]["worst_by_fault"]["stall"]["start_ms"] == ms(400)


# --- growth --------------------------------------------------------------------------------


def test_integer_counts_need_a_rise_of_more_than_one() -> None:
    assert growth_check([6, 6, 6, 6, 7, 7, 7], integer=True, limit=0.10)["passed"]
    grew = growth_check([6, 6, 6, 6, 8, 8, 8], integer=True, limit=0.10)
    assert not grew["passed"]
    assert grew["growth"] == pytest.approx(1 / 3, abs=1e-3)
    assert not growth_check([6, 6, 6, 6, 7, 7, 7], integer=False, limit=0.10)["passed"]
    assert not growth_check([0, 0, 0, 0, 3, 3, 3], integer=True, limit=0.10)["passed"]


def test_the_listeners_pace_is_their_cpu_outside_fault_windows(rec: Recorder) -> None:
    # Two listeners at 0.2 and 0.3 cores, 10 starts a second; a fault from 100 to 105 s (its
    # window to 115 s) where they burn 5 cores' worth, and a restart of one at 300 s: both
    # left out. What is left: 0.5 cores, 50 ms a start.
    for i, t_s in enumerate(x / 10 for x in range(0, 6000)):
        rec.create(i, t_s, t_s=max(0.0, t_s - 1))
        rec.run(i, t_s, t_s + 0.001, pid=PID_A if i % 2 else PID_B)
    rec.fault("stall", 100, 105)
    cpu_a = cpu_b = 0.0
    for t_s in range(0, 601, 10):
        burn = 5.0 if 100 <= t_s <= 120 else 1.0
        cpu_a += 0 if t_s == 0 else 0.2 * 10 * burn
        cpu_b += 0 if t_s == 0 else 0.3 * 10 * burn
        pid_b = PID_B if t_s < 300 else PID_B + 100
        rec.sample(t_s, [listener(0, PID_A, 0, cpu_s=cpu_a), listener(1, pid_b, 0, cpu_s=cpu_b)])
    report = judge(rec)
    pace = report["pace"]
    assert "listeners' CPU outside faults: 0.5 cores, 50.0 ms a start" in summary(
        {"verdict": report}
    )
    # 60 intervals: 3 meet the fault's window (100-110, 110-120, 90-100 ends at 100), one the
    # restart.
    assert pace["quiet_intervals"] == 56
    assert pace["listener_cores"] == pytest.approx(0.5)
    assert pace["listener_cpu_ms_per_start"] == pytest.approx(50.0, rel=0.01)


def _listener_samples(rec: Recorder, rss_of: Any, until_s: int = 600) -> None:
    for t_s in range(0, until_s + 1, 10):
        rec.sample(t_s, [listener(0, PID_A, 0, rss_mb=rss_of(t_s)), listener(1, PID_B, 0)])


def test_a_leaking_listener_fails_growth(rec: Recorder) -> None:
    _listener_samples(rec, lambda t_s: 80 + t_s / 5)  # +1 MB every 5 s
    report = judge(rec)
    by_pid = {p["pid"]: p for p in report["growth"]["listeners"]}
    assert not by_pid[PID_A]["metrics"]["rss_mb"]["passed"]
    assert by_pid[PID_B]["passed"]
    assert any(f"listener pid {PID_A}" in f and "rss_mb" in f for f in report["failures"])


def test_growth_during_the_warm_up_does_not_count(rec: Recorder) -> None:
    _listener_samples(rec, lambda t_s: 40 + min(t_s, 110) / 2)  # fills up, then flat
    report = judge(rec)
    assert report["passed"], report["failures"]
    assert report["growth"]["listeners"][0]["samples"] == 49  # 120 s .. 600 s


def _faults_every_minute(rec: Recorder, kinds: tuple[str, ...], until_s: int) -> None:
    for n, start_s in enumerate(range(60, until_s, 60)):
        rec.fault(kinds[n % len(kinds)], start_s, start_s + 5)


def test_rss_is_judged_once_the_listener_met_every_kind_of_fault(rec: Recorder) -> None:
    # The Cluster hour's listeners: +3 MB at each kind of fault's first instance, flat after
    # (kinds at 60, 120, 180 and 240 s; every one met by 245 s + the 10 s settle).
    _faults_every_minute(rec, ("stall", "reshard", "failover", "sigstop"), 600)
    _listener_samples(rec, lambda t_s: 75 + 3 * min(4, max(0, t_s - 1) // 60))
    report = judge(rec)
    rss = report["growth"]["listeners"][0]["metrics"]["rss_mb"]
    assert rss["passed"], rss
    assert rss["judged_from_ms"] == ms(255)
    assert rss["samples"] == 35  # 260 s .. 600 s
    assert report["passed"], report["failures"]


def test_rss_still_growing_after_every_kind_of_fault_fails(rec: Recorder) -> None:
    _faults_every_minute(rec, ("stall", "reshard"), 900)
    _listener_samples(rec, lambda t_s: 75 + t_s / 30, until_s=900)  # +2 MB a minute throughout
    report = judge(rec)
    rss = report["growth"]["listeners"][0]["metrics"]["rss_mb"]
    assert rss["judged_from_ms"] == ms(135)  # the reshard at 120 s, its end and settle
    assert not rss["passed"]
    assert any(f"listener pid {PID_A}" in f and "rss_mb" in f for f in report["failures"])


def test_only_the_kinds_of_fault_after_its_start_hold_the_rss_back(rec: Recorder) -> None:
    rec.fault("flushall", 10, 15)  # before the second process started: not waited for
    rec.fault("stall", 60, 65)
    rec.fault("reshard", 200, 205)
    for t_s in range(0, 601, 10):
        entry = listener(0, PID_A, 0) if t_s < 30 else listener(0, PID_C, 30)
        rec.sample(t_s, [entry])
    report = judge(rec)
    procs = {p["pid"]: p for p in report["growth"]["listeners"]}
    assert procs[PID_C]["metrics"]["rss_mb"]["judged_from_ms"] == ms(215)
    assert procs[PID_C]["metrics"]["rss_mb"]["samples"] == 39  # 220 s .. 600 s
    assert procs[PID_C]["samples"] == 46  # the counts after its own warm-up: 150 s .. 600 s


def test_a_restart_is_not_growth(rec: Recorder) -> None:
    # Slot 0's first process is killed at 300 s; its successor warms up from 40 MB to 120 MB
    # and stays there: each incarnation is flat, though the slot's line went up.
    for t_s in range(0, 601, 10):
        if t_s < 300:
            entry = listener(0, PID_A, 0, rss_mb=80, fds=20)
        else:
            entry = listener(0, PID_C, 300, rss_mb=min(120, 40 + t_s - 300), fds=30)
        rec.sample(t_s, [entry])
    rec.fault("kill9", 300, 300, pids=(PID_A,))
    report = judge(rec)
    procs = {p["pid"]: p for p in report["growth"]["listeners"]}
    assert procs[PID_A]["samples"] == 18  # 120 s .. 290 s
    assert procs[PID_C]["samples"] == 19  # after its own warm-up: 420 s .. 600 s
    assert report["passed"], report["failures"]


def test_a_short_lived_process_is_too_short(rec: Recorder) -> None:
    for t_s in range(0, 601, 10):
        entry = listener(0, PID_A, 0) if t_s < 170 else listener(0, PID_C, 170, rss_mb=999)
        rec.sample(t_s, [entry])
    report = judge(rec)
    procs = {p["pid"]: p for p in report["growth"]["listeners"]}
    assert procs[PID_A]["status"] == "too_short"
    assert procs[PID_A]["passed"]


def test_server_growth_is_judged_after_the_longest_due_until_production_ends(
    rec: Recorder,
) -> None:
    for t_s in range(0, 701, 10):
        # Fills until 300 s (max_due_s), flat while producing, drains after 600 s: fine.
        level = min(t_s, 300) * 1000 if t_s <= 600 else 10
        rec.sample(t_s, [], redis_used_bytes=level, ledger_rows={"pending": level // 100})
    assert judge(rec)["passed"]


def test_redis_memory_growing_while_producing_fails(rec: Recorder) -> None:
    for t_s in range(0, 601, 10):
        rec.sample(t_s, [], redis_used_bytes=1_000_000 + t_s * 5000)
    report = judge(rec)
    assert not report["growth"]["servers"]["redis_used_bytes"]["passed"]
    assert report["growth"]["servers"]["ledger_pending_rows"]["passed"]
    assert any(f.startswith("redis_used_bytes grew") for f in report["failures"])


def test_ledger_bound_on_finished_rows(rec: Recorder) -> None:
    # 1.25 * 10/s * (60 s + 30 s) = 1125, plus the one dead task created.
    rec.create(1, due_s=10, kind="dead")
    for attempt in (1, 2, 3):
        rec.run(1, 10 + attempt, 10.1 + attempt, "fail", attempt=attempt)
    rec.sample(100, [], ledger_rows={"done": 1000, "dead": 100, "cancelled": 26})
    report = judge(rec)
    assert report["ledger_bound"]["bound_rows"] == 1126
    assert report["ledger_bound"]["passed"]
    rec.sample(110, [], ledger_rows={"done": 1000, "dead": 100, "cancelled": 27})
    report = judge(rec)
    assert report["ledger_bound"]["max_finished_rows"] == 1127
    assert not report["passed"]
    assert any("finished ledger rows reached 1127" in f for f in report["failures"])


# --- throughput, robustness, plots ---------------------------------------------------------


def test_throughput_counts_ok_ends_per_10_s(rec: Recorder) -> None:
    for n in range(600):  # 1 a second from 0 s to 600 s, 2 a second 300 s .. 400 s
        rec.create(n, due_s=n)
        rec.run(n, n + 0.01, n + 0.02)
    for n in range(100):
        rec.create(1000 + n, due_s=300 + n)
        rec.run(1000 + n, 300 + n + 0.01, 300 + n + 0.02, pid=PID_B)
    tp = judge(rec)["throughput"]
    assert tp["ok_ends_total"] == 700
    assert tp["ok_ends_per_s"] == {"min": 1.0, "p50": 1.0, "max": 2.0}
    assert tp["empty_buckets"] == 0


def test_a_torn_last_line_is_counted_not_fatal(rec: Recorder) -> None:
    rec.create(1, due_s=10)
    rec.run(1, 10.0, 10.1)
    run_dir = rec.write()
    with (run_dir / f"runs-{PID_A}.jsonl").open("a") as f:
        f.write('{"ev": "start", "i": 1, "att')
    report = verdict(run_dir, params())
    assert report["anomalies"] == {"unparsable_lines": 1}
    assert fate_ids(report, "ran_once") == [1]


def _busy_history(rec: Recorder) -> None:
    for n in range(2000):
        due_s = 130 + n * 0.2
        rec.create(n, due_s=due_s)
        rec.run(n, due_s + 0.01 + (n % 7) * 0.01, due_s + 0.1, pid=(PID_A, PID_B)[n % 2])
    rec.fault("kill9", 200, 200, pids=(PID_A,))
    rec.fault("sigstop", 260, 280, pids=(PID_B,))
    rec.fault("failover", 400, 405)
    for t_s in range(0, 601, 10):
        first = listener(0, PID_A, 0) if t_s < 200 else listener(0, PID_C, 200, rss_mb=90)
        rec.sample(t_s, [first, listener(1, PID_B, 0, rss_mb=70 + t_s / 100)])


def test_plot_writes_three_pngs(rec: Recorder) -> None:
    pytest.importorskip("matplotlib")
    _busy_history(rec)
    report = judge(rec)
    paths = plot(rec.run_dir, report)
    assert [p.name for p in paths] == [
        "soak-lateness.png",
        "soak-throughput.png",
        "soak-listeners.png",
    ]
    for path in paths:
        assert path.parent == rec.run_dir
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 10_000


def test_plot_without_matplotlib_says_what_to_install(
    rec: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec.create(1, due_s=10)
    report = judge(rec)
    # A None entry in sys.modules makes the import raise ImportError.
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(RuntimeError, match=r"pip install 'keyexpiry\[bench\]'"):
        plot(rec.run_dir, report)


def test_a_step_that_comes_early_and_stays_fails_growth() -> None:
    # Redis connections 5 -> 9 at a failover a quarter of the way in: the median is 9 already,
    # so only the end against the start shows the step.
    stepped = growth_check([5.0] * 12 + [9.0] * 36, integer=True, limit=0.10)
    assert not stepped["passed"]
    assert (stepped["start"], stepped["middle"], stepped["end"]) == (5, 9, 9)
    assert stepped["growth"] == 0 and stepped["step"] == pytest.approx(0.8)
    # RSS stepping 82 -> 92 MB early on, flat after: the same.
    assert not growth_check([82.0] * 10 + [92.0] * 38, integer=False, limit=0.10)["passed"]
    # A step that goes back down within the run, or one of a single count, passes.
    assert growth_check([5.0] * 12 + [9.0] * 30 + [5.0] * 6, integer=True, limit=0.10)["passed"]
    assert growth_check([5.0] * 12 + [6.0] * 36, integer=True, limit=0.10)["passed"]


def test_a_step_is_named_in_the_failures_with_start_median_and_end(rec: Recorder) -> None:
    _listener_samples(rec, lambda t_s: 80 if t_s < 250 else 95)
    report = judge(rec)
    assert not report["passed"]
    [failure] = [f for f in report["failures"] if "rss_mb" in f]
    assert "80 (start) -> 95 (middle) -> 95 (end)" in failure


def _judged_conns(
    rec: Recorder, conns_a: Callable[[int], int], conns_b: Callable[[int], int]
) -> dict[str, Any]:
    """Two listeners' Redis connections every 10 s for 600 s, judged."""
    for t_s in range(0, 601, 10):
        rec.sample(
            t_s,
            [
                listener(0, PID_A, 0, redis_conns=conns_a(t_s)),
                listener(1, PID_B, 0, redis_conns=conns_b(t_s)),
            ],
        )
    return judge(rec)


def test_connections_that_wobble_with_load_pass_and_a_leaked_one_fails(rec: Recorder) -> None:
    # A Cluster listener's six per-node pools, sampled every 10 s, hold 12 to 17 connections
    # with the load of the moment; its last three samples landed on 15, 17, 15 against a start
    # of 13 (ba680d1's soak failed on that). A pool a recovery leaked stays in every sample.
    wobble = [13, 12, 14, 16, 13, 12, 15, 17, 14, 12, 13, 16]

    def crest(t_s: int) -> int:
        i = t_s // 10
        return [15, 17, 15][i - 58] if i >= 58 else wobble[i % len(wobble)]

    report = _judged_conns(
        rec, crest, lambda t_s: wobble[t_s // 10 % len(wobble)] + (3 if t_s >= 300 else 0)
    )
    by_pid = {p["pid"]: p for p in report["growth"]["listeners"]}
    conns_a = by_pid[PID_A]["metrics"]["redis_conns"]
    assert conns_a["passed"], conns_a
    assert conns_a["basis"].startswith("floor over 60 s")
    conns_b = by_pid[PID_B]["metrics"]["redis_conns"]
    assert not conns_b["passed"]
    assert (conns_b["start"], conns_b["end"]) == (12, 15)
    [failure] = [f for f in report["failures"] if "redis_conns" in f]
    assert f"pid {PID_B}" in failure and "each a floor over 60 s" in failure
    # The same crest judged by the median of three ends, as before: a step.
    assert not growth_check([13.0] * 6 + wobble * 4 + [15.0, 17.0, 15.0], True, 0.10)["passed"]


def test_a_dip_in_a_fault_window_neither_hides_a_leak_nor_makes_one(rec: Recorder) -> None:
    # A restart closes every connection for a moment: a sample at 0 or 2 inside its window is
    # not the listener's floor. One listener leaked 4 connections at 300 s and dipped to 2 in
    # the last minute's fault; the other dipped to 3 in the first minute's, and is flat.
    rec.fault("ledger_restart", 135, 140)
    rec.fault("ledger_restart", 565, 570)

    def in_fault(t_s: int) -> bool:
        return 135 <= t_s <= 150 or 565 <= t_s <= 580

    report = _judged_conns(
        rec,
        lambda t_s: 2 if in_fault(t_s) and t_s > 500 else (9 if t_s >= 300 else 5),
        lambda t_s: 3 if in_fault(t_s) and t_s < 200 else 6,
    )
    by_pid = {p["pid"]: p for p in report["growth"]["listeners"]}
    leak = by_pid[PID_A]["metrics"]["redis_conns"]
    assert not leak["passed"] and (leak["start"], leak["end"]) == (5, 9), leak
    flat_conns = by_pid[PID_B]["metrics"]["redis_conns"]
    assert flat_conns["passed"] and flat_conns["start"] == 6, flat_conns


def _driver_samples(
    rec: Recorder, conns_of: Callable[[int, bool], int], drives_from_s: int
) -> None:
    """PID_A drives from `drives_from_s` on (PID_B before); Redis connections and descriptors
    by `conns_of(t_s, driving)`, every 10 s for 600 s."""
    for t_s in range(0, 601, 10):
        a_drives = t_s >= drives_from_s
        rec.sample(
            t_s,
            [
                listener(
                    0, PID_A, 0, redis_conns=conns_of(t_s, a_drives),
                    fds=17 + conns_of(t_s, a_drives), drives=a_drives,
                ),
                listener(1, PID_B, 0, redis_conns=9 + 3 * (not a_drives), drives=not a_drives),
            ],
        )  # fmt: skip


def test_a_listener_that_took_the_driver_over_is_not_growing(rec: Recorder) -> None:
    # The Cluster hour: the driving listener holds a connection per primary more (12 against 9);
    # PID_A took the driver over at 480 s and held it to the end, PID_B drove before.
    _driver_samples(rec, lambda t_s, driving: 12 if driving else 9, drives_from_s=480)
    report = judge(rec)
    by_pid = {p["pid"]: p for p in report["growth"]["listeners"]}
    for pid in (PID_A, PID_B):
        for name in ("redis_conns", "fds"):
            assert by_pid[pid]["metrics"][name]["passed"], (pid, name, by_pid[pid]["metrics"][name])
    assert by_pid[PID_A]["metrics"]["redis_conns"]["judged"] == "not driving"
    assert by_pid[PID_B]["metrics"]["redis_conns"]["judged"] == "not driving"  # 480-600 s
    assert report["passed"], report["failures"]


def test_a_connection_leaked_while_driving_stays_after_and_fails(rec: Recorder) -> None:
    # PID_A drives from 200 s to 300 s and keeps three connections more after it stopped:
    # they are in the samples judged (not driving).
    def conns(t_s: int, driving: bool) -> int:
        return 12 if driving or t_s >= 300 else 9

    for t_s in range(0, 601, 10):
        a_drives = 200 <= t_s < 300
        rec.sample(
            t_s,
            [listener(0, PID_A, 0, redis_conns=conns(t_s, a_drives), drives=a_drives)],
        )
    report = judge(rec)
    conns_a = report["growth"]["listeners"][0]["metrics"]["redis_conns"]
    assert conns_a["judged"] == "not driving"
    assert not conns_a["passed"], conns_a


def test_the_report_says_how_rss_and_connections_were_judged(rec: Recorder) -> None:
    _faults_every_minute(rec, ("stall", "reshard"), 600)
    _driver_samples(rec, lambda t_s, driving: 12 if driving else 9, drives_from_s=480)
    rule = _growth_rule(judge(rec))
    assert "met each kind of fault" in rule
    assert "one driving state" in rule
