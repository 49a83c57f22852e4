"""`bench --scenario soak`: the verdict, computed from the history the soak runner recorded
(read back by `soak_history.load()`). It judges

- each task's fate from its history alone: ran once, dead by design (or one run short, an
  attempt lost with a killed or frozen listener), cancelled, ran twice in a
  window `docs/GUARANTEES.md` documents ("Where a task may run twice", window 1: a killed or
  frozen handler) or not, ran after a cancel, lost; and whether any run started early; with
  asynchronous replication (`params["lost_commit_faults"]`), what a change committed just
  before the primary was lost explains: a second run, a run after a cancel or early, a create
  that never ran (`lost_with_commit`);
- lateness (first start minus the producer's due), outside and inside fault windows (inside: the
  task's wait, from its due to its first start, met a fault's window);
- growth of every listener process (RSS, descriptors, threads, connections), of Redis memory and
  of the ledger's rows, after the warm-up;
- throughput per 10 s;
- the machine's pace: the listeners' CPU outside fault windows, by which runs on machines of
  different speed are compared.

`verdict()` returns a small JSON-serialisable dict (summaries and examples, no per-task arrays);
`keyexpiry.bench.soak_plots` re-reads the files through `soak_history.load()` for its per-task
series.

Long because it is one judgement, its sections (fates, lateness, growth,
throughput, pace, then the failures they add up to) each a block of small pure
functions over the same `History` and run `params`, and `_failures` reads every
section's keys; split apart, each part would only be imported here. The reading
of the files is `soak_history`.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keyexpiry.bench.soak_history import Fault, FaultWindows, History, Run, Task, load

EARLY_TOLERANCE_MS = 5
"""A start more than this before the producer's due is early (clock reads and rounding)."""
BUCKET_S = 10
EXAMPLES = 20
WINDOW1_FAULTS = ("kill9", "sigstop", "net_partition_ledger")
"""Faults that open GUARANTEES window 1 by default (a killed or frozen handler, a listener cut off
from the database by a network partition); a run's
`params["window1_faults"]` overrides it (a `stall` cuts a listener off from the database, which
GUARANTEES also puts in window 1)."""
SIGNAL_CLOCK_SLACK_MS = 50
"""How far a run's start (the listener's clock, synced to Redis's) may read after the signal that
froze or killed its process (the driver's host clock) and still be a run the signal hit. A
frozen or dead process starts nothing after the signal, so a start read just after it is the
clocks' error (a loaded machine's clock reads are tens of ms off), never a later run; the slack
stays far below the shortest freeze (6 s)."""
SPAN_FAULTS = frozenset({"net_partition_ledger"})
"""Window-1 faults that last: a run of the listener they hit that started while they lasted is
covered too (see `_documenting_fault`)."""
LOST_ATTEMPT_SLACK_MS = 10_000
"""How long after a dead task's previous run (or its due) a window-1 fault may strike and still
have taken the claim of its next attempt: the soak's retry delays (at most 1 s) and a claim's
wait in its listener's queue."""
LOST_COMMIT_SLACK_MS = 500
"""After a lost-commit fault's start stamp, how long the primary may still have answered (the
fault finds the primary, then kills it)."""
GROWTH_METRICS = ("rss_mb", "fds", "threads", "ledger_conns", "redis_conns")
INTEGER_METRICS = frozenset({"fds", "threads", "ledger_conns", "redis_conns"})
DRIVER_HELD = ("redis_conns", "fds")
"""Counts that hold the driver's connections (its sockets are descriptors too)."""
MIN_GROWTH_SAMPLES = 6
END_SAMPLES = 3
END_WINDOW_S = 60.0
"""A listener's counts are judged by their floor over a minute (`floor_check`): the issue's
"back to their level within a minute after each fault"."""
FINISHED_STATUSES = ("done", "dead", "cancelled")
OUTSIDE_P99_MS = 15
OUTSIDE_MAX_MS = 1000
"""Issue 42's bounds on lateness outside fault windows (500 tasks/s, three listeners)."""
P99_BOUND_FAULTS = ("flushall", "stall")
FAULT_P99_MS = 3000
"""Issue 42's bound on the p99 of the faults in `P99_BOUND_FAULTS`."""
FAULT_MAX_OVER_MS = 10_000
"""Issue 42's bound on any fault's max lateness past the fault's own length."""
LEDGER_BOUND_SLACK = 1.25

FATES = (
    "ran_once",
    "ran_twice_documented",
    "ran_twice_undocumented",
    "ran_after_cancel",
    "dead_by_design",
    "dead_attempt_lost",
    "dead_short",
    "dead_ran_ok",
    "cancelled",
    "lost",
    "lost_with_commit",
    "unfinished",
)
FAILED_FATES = frozenset(
    {"ran_twice_undocumented", "ran_after_cancel", "dead_short", "dead_ran_ok", "lost"}
)


# --- fates ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Context:
    max_attempts: int
    end_ms: int
    unfinished_grace_ms: int
    window1: frozenset[str]
    # pid -> (fault start, fault end, kind) of the window-1 faults that hit it
    window1_hits: dict[int, list[tuple[int, int, str]]]
    faults: list[Fault]
    # (from, to, kind): while a fault that may lose commits lasted, and the window before it
    # in which a commit answered may be missing afterwards (asynchronous replication)
    lost_commit: tuple[tuple[int, int, str], ...] = ()

    def undone_by(self, t_ms: int) -> str | None:
        """The fault that may have undone a change committed at `t_ms`, or None."""
        return next((kind for lo, hi, kind in self.lost_commit if lo <= t_ms <= hi), None)


@dataclass(frozen=True)
class Fate:
    """One task's fate and, for a second run, what explains it."""

    name: str
    documented_by: tuple[str, ...] = ()  # the window-1 fault kinds behind documented extra runs
    hints: tuple[str, ...] = ()  # per undocumented extra run: the window that would apply, if any


def _context(faults: list[Fault], params: dict[str, Any]) -> _Context:
    window1 = frozenset(params.get("window1_faults", WINDOW1_FAULTS))
    hits: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
    for f in faults:
        if f.kind in window1:
            for pid in f.pids:
                hits[pid].append((f.hit_ms or f.start_ms, f.end_ms, f.kind))
    lost_kinds = frozenset(params.get("lost_commit_faults", ()))
    window_ms = int(params.get("lost_commit_window_ms", 0))
    # Only what the lost primary had answered before it went: a commit answered after the
    # fault began was answered by the new one, and losing it is a defect.
    lost_commit = tuple(
        (f.start_ms - window_ms, f.start_ms + LOST_COMMIT_SLACK_MS, f.kind)
        for f in faults
        if f.kind in lost_kinds
    )
    return _Context(
        lost_commit=lost_commit,
        max_attempts=int(params["max_attempts"]),
        end_ms=int(params["end_ms"]),
        unfinished_grace_ms=int(float(params.get("unfinished_grace_s", 0)) * 1000),
        window1=window1,
        window1_hits=dict(hits),
        faults=faults,
    )


def _extra_runs(task: Task) -> list[Run]:
    """Runs beyond the one expected: further ok ends, and any start after the first ok end.

    Failed and timed-out (`slow`) runs before the first ok end are the kind's design (fail_once,
    slow_once, a run whose process was killed and is retried), not extras.
    """
    oks = [r for r in task.runs if r.result == "ok"]
    if not oks:
        return []
    primary = oks[0]  # runs are sorted by start
    first_ok_end_ms = min(r.end_ms for r in oks if r.end_ms is not None)
    return [
        r
        for r in task.runs
        if r is not primary and (r.result == "ok" or r.start_ms > first_ok_end_ms)
    ]


def _earlier_candidates(task: Task, extra: Run) -> list[Run]:
    # Runs that may have done the work before `extra` started: they ended ok or never ended.
    return [
        r
        for r in task.runs
        if r is not extra and r.start_ms <= extra.start_ms and r.result in ("ok", None)
    ]


def _documenting_fault(task: Task, extra: Run, ctx: _Context) -> str | None:
    """The window-1 fault kind that explains `extra`, or None.

    Window 1 applies when an earlier run's process was killed or frozen after that run started
    and before `extra` started (the work may be done, its outcome not recorded).
    """
    for earlier in _earlier_candidates(task, extra):
        for start_ms, end_ms, kind in ctx.window1_hits.get(earlier.pid, ()):
            # A frozen or dead process starts nothing: a run of it that started up to the
            # signal (the listener's shared clock read against the driver's host clock) ran
            # when it came.
            if earlier.start_ms <= start_ms + SIGNAL_CLOCK_SLACK_MS and start_ms <= extra.start_ms:
                return kind
            # Cut off from the database, a listener records nothing for as long as the
            # partition lasts: a run it started then (claimed just before the cut took hold,
            # a few ms after the fault's stamp) is as unrecorded as one started before.
            if kind in SPAN_FAULTS and start_ms <= earlier.start_ms <= min(end_ms, extra.start_ms):
                return kind
        # Its claim or its outcome committed just before the primary was lost, and missing
        # on the promoted standby: the task runs again.
        for lo, hi, kind in ctx.lost_commit:
            last_ms = earlier.end_ms if earlier.end_ms is not None else earlier.start_ms
            if earlier.start_ms <= hi and last_ms >= lo and extra.start_ms >= lo:
                return kind
    if task.ambiguous:
        return "ambiguous_create"
    return None


def _window_hint(task: Task, extra: Run, ctx: _Context) -> str:
    """Which GUARANTEES window could explain an undocumented extra run, for a reader to check."""
    earlier = _earlier_candidates(task, extra)
    if not earlier:
        return "none: no earlier run ended ok or vanished"
    first_ms = min(r.start_ms for r in earlier)
    pids = {r.pid for r in earlier}
    between = [f for f in ctx.faults if f.start_ms <= extra.start_ms and f.end_ms >= first_ms]
    if first_ms < task.created_ms:
        # The producer retries a create that raised; if the first try had committed the row,
        # the task ran, and the retry re-created it.
        return "3: ran before its create call returned (a retried create re-created it)"
    if any(first_ms <= t_ms <= extra.start_ms for t_ms, _ in task.reschedules):
        return "3: rescheduled (re-created) while running"
    if task.kind == "slow_once":
        return "2: a handler past its timeout"
    for f in between:
        if f.pids & pids and f.kind == "stall":
            return f"1: listener {sorted(f.pids & pids)} cut off from the database (stall)"
        if f.pids & pids and f.kind not in ctx.window1:
            return f"1?: a {f.kind} hit the earlier run's listener {sorted(f.pids & pids)}"
    if any(f.kind in ("ledger_restart", "mariadb_restart") for f in between):
        return "1 or 4: the ledger restarted between the runs (lost database / refused outcome)"
    if between:
        return "none: faults between the runs: " + ", ".join(sorted({f.kind for f in between}))
    return "none: no fault between the runs"


def _is_unfinished(task: Task, ctx: _Context) -> bool:
    last_ms = max([task.final_due_ms, *(r.end_ms or r.start_ms for r in task.runs)])
    return last_ms >= ctx.end_ms - ctx.unfinished_grace_ms


def _cancelled_untouched(task: Task) -> bool:
    # A cancel that took effect, or a tag cancel that may have: no start after it.
    for cancel_ms in (task.cancel_ok_ms, task.tag_cancel_ms):
        if cancel_ms is not None and not any(r.start_ms > cancel_ms for r in task.runs):
            return True
    return False


def _dead_fate(task: Task, ctx: _Context) -> Fate:
    if any(r.result == "ok" for r in task.runs):
        return Fate("dead_ran_ok")
    if len(task.runs) >= ctx.max_attempts:
        return Fate("dead_by_design")
    if _an_attempt_lost(task, ctx):
        return Fate("dead_attempt_lost")
    if _cancelled_untouched(task):
        return Fate("cancelled")
    if _is_unfinished(task, ctx):
        return Fate("unfinished")
    kind = ctx.undone_by(task.created_ms) if not task.runs else None
    return Fate("dead_short") if kind is None else Fate("lost_with_commit", (kind,))


def _an_attempt_lost(task: Task, ctx: _Context) -> bool:
    """A task one run short of its attempts whose missing attempt a window-1 fault may have
    taken with the listener that had claimed it: a takeover counts a lost claim as an attempt,
    whether or not its handler began (GUARANTEES, "Where a task may run twice", window 1;
    `max_attempts` bounds how often a handler may have run). Found by the Sentinel hour (the
    third attempt claimed 3 ms before its listener was frozen 20 s: dead after two runs) and
    the Cluster hour (the second, 4 ms before: the takeover ran the third, which died). The
    fault must strike after the run before the missing attempt ended (or the task fell due)
    and within `LOST_ATTEMPT_SLACK_MS`: the claim came then."""
    if len(task.runs) != ctx.max_attempts - 1:
        return False
    seen = {r.attempt for r in task.runs}
    missing = [a for a in range(1, ctx.max_attempts + 1) if a not in seen]
    if len(missing) != 1:
        return False  # attempts run twice, or numbered past max_attempts: not this case
    before = [r for r in task.runs if r.attempt < missing[0]]
    prev_ms = max((r.end_ms or r.start_ms for r in before), default=task.final_due_ms)
    return any(
        prev_ms < start_ms <= prev_ms + LOST_ATTEMPT_SLACK_MS
        for hits in ctx.window1_hits.values()
        for start_ms, _end_ms, _kind in hits
    )


def _ran_fate(task: Task, ctx: _Context) -> Fate:
    extras = _extra_runs(task)
    if not extras:
        return Fate("ran_once")
    documented: list[str] = []
    hints: list[str] = []
    for extra in extras:
        kind = _documenting_fault(task, extra, ctx)
        if kind is None:
            hints.append(_window_hint(task, extra, ctx))
        else:
            documented.append(kind)
    if hints:
        return Fate("ran_twice_undocumented", tuple(documented), tuple(hints))
    return Fate("ran_twice_documented", tuple(documented))


def _fate_of(task: Task, ctx: _Context) -> Fate:
    """Classify one task from its history (see the module docstring and FATES)."""
    cancel_ms = task.cancel_ok_ms
    if (
        cancel_ms is not None
        and any(r.start_ms > cancel_ms for r in task.runs)
        and ctx.undone_by(cancel_ms) is None
    ):
        return Fate("ran_after_cancel")
    if task.kind == "dead":
        return _dead_fate(task, ctx)
    if any(r.result == "ok" for r in task.runs):
        return _ran_fate(task, ctx)
    if _cancelled_untouched(task):
        return Fate("cancelled")
    if _is_unfinished(task, ctx):
        return Fate("unfinished")
    kind = ctx.undone_by(task.created_ms)
    return Fate("lost") if kind is None else Fate("lost_with_commit", (kind,))


def early_starts(task: Task, ctx: _Context | None = None) -> list[Run]:
    """Starts more than EARLY_TOLERANCE_MS before the producer's due at that moment (unless
    the reschedule that set it may have been undone with the primary that committed it)."""
    return [
        r
        for r in task.runs
        if r.start_ms < task.due_at(r.start_ms) - EARLY_TOLERANCE_MS
        and not (ctx is not None and _reschedule_undone(task, r.start_ms, ctx))
    ]


def _reschedule_undone(task: Task, t_ms: int, ctx: _Context) -> bool:
    set_ms = max((s for s, _ in task.reschedules if s <= t_ms), default=None)
    return set_ms is not None and ctx.undone_by(set_ms) is not None


def first_start_lateness(task: Task) -> tuple[int, int] | None:
    """(due_ms, lateness_ms) of the task's first start against the producer's due then."""
    if not task.runs:
        return None
    first = task.runs[0]
    due_ms = task.due_at(first.start_ms)
    return due_ms, first.start_ms - due_ms


def lateness_points(history: History) -> list[tuple[int, int]]:
    """(due_ms, lateness_ms) of every task that started, by due time (retries excluded)."""
    points = [p for t in history.tasks.values() if (p := first_start_lateness(t)) is not None]
    points.sort()
    return points


def _vanished_then_retried(task: Task, kill_hits: dict[int, list[int]]) -> bool:
    # A run with no end whose process no kill -9 hit, yet someone ran the task again: its
    # process died (or lost the task) for a reason the run did not inject.
    return any(
        run.end_ms is None and not any(t >= run.start_ms for t in kill_hits.get(run.pid, ()))
        for run in task.runs[:-1]
    )


def task_history(task: Task) -> dict[str, Any]:
    """A task's whole history, for the verdict's examples."""
    return {
        "i": task.i,
        "kind": task.kind,
        "via": task.via,
        "created_ms": task.created_ms,
        "dues": [[task.created_ms, task.due_ms], *(list(d) for d in task.reschedules)],
        "cancels": [list(c) for c in task.cancels],
        "tag_cancel_ms": task.tag_cancel_ms,
        "runs": [
            {
                "start_ms": r.start_ms,
                "attempt": r.attempt,
                "pid": r.pid,
                "seen_due_ms": r.seen_due_ms,
                "end_ms": r.end_ms,
                "result": r.result,
            }
            for r in task.runs
        ],
    }


def _kill_hits(faults: list[Fault]) -> dict[int, list[int]]:
    """pid -> start times of the kill -9 faults that hit it."""
    hits: dict[int, list[int]] = defaultdict(list)
    for f in faults:
        if f.kind == "kill9":
            for pid in f.pids:
                hits[pid].append(f.start_ms)
    return hits


def _example(task: Task, fate: Fate | None = None) -> dict[str, Any]:
    row = task_history(task)
    if fate is not None and fate.hints:
        row["window_hints"] = list(fate.hints)
    if fate is not None and fate.documented_by:
        row["documented_by"] = list(fate.documented_by)
    return row


def _fates_section(history: History, ctx: _Context, examples: int) -> dict[str, Any]:
    by_fate: dict[str, list[tuple[Task, Fate]]] = {name: [] for name in FATES}
    early_tasks: list[Task] = []
    early_count = 0
    kill_hits = _kill_hits(history.faults)
    vanished: list[Task] = []
    for i in sorted(history.tasks):
        task = history.tasks[i]
        fate = _fate_of(task, ctx)
        by_fate[fate.name].append((task, fate))
        early = early_starts(task, ctx)
        if early:
            early_count += len(early)
            early_tasks.append(task)
        if _vanished_then_retried(task, kill_hits):
            vanished.append(task)

    fates: dict[str, Any] = {
        name: {"count": len(rows), "examples": [_example(t, f) for t, f in rows[:examples]]}
        for name, rows in by_fate.items()
    }
    fates["ran_twice_documented"]["by_fault"] = dict(
        Counter(k for _, f in by_fate["ran_twice_documented"] for k in f.documented_by)
    )
    fates["ran_twice_undocumented"]["by_window"] = dict(
        Counter(h.split(":")[0] for _, f in by_fate["ran_twice_undocumented"] for h in f.hints)
    )
    return {
        "fates": fates,
        "early": {
            "starts": early_count,
            "tasks": len(early_tasks),
            "examples": [_example(t) for t in early_tasks[:examples]],
        },
        "vanished_then_retried": {
            "count": len(vanished),
            "examples": [_example(t) for t in vanished[:examples]],
        },
    }


def _tag_overruns(history: History) -> list[dict[str, Any]]:
    """cancel_tag calls after which more tasks started than the call can have left alone."""
    overruns = []
    for tag in history.tag_cancels:
        if tag.cancelled < 0:  # the producer lost the answer (a retried cancel): nothing to check
            continue
        started_after = sum(
            1
            for i in tag.ids
            if (t := history.tasks.get(i)) is not None
            and any(r.start_ms > tag.t_ms for r in t.runs)
        )
        if started_after > len(tag.ids) - tag.cancelled:
            overruns.append(
                {
                    "t_ms": tag.t_ms,
                    "ids": len(tag.ids),
                    "cancelled": tag.cancelled,
                    "started_after": started_after,
                }
            )
    return overruns


# --- lateness ------------------------------------------------------------------------------


def percentiles(values: list[int]) -> dict[str, float | int | None]:
    """count, p50/p99/p99.9 (nearest rank) and max of `values` (None when empty)."""
    ordered = sorted(values)
    n = len(ordered)

    def rank(p: float) -> int | None:
        return ordered[max(0, math.ceil(p * n) - 1)] if n else None

    return {
        "count": n,
        "p50": rank(0.50),
        "p99": rank(0.99),
        "p99.9": rank(0.999),
        "max": ordered[-1] if n else None,
    }


_WORST_LISTED = 5
"""The latest first starts outside fault windows listed in the report, each with its task."""
_INTERVAL_MS = 300_000
"""Outside fault windows, lateness is also reported per this much of due time: a tail that
grows as the run goes on reads differently from one spread evenly over it."""


def _lateness_section(history: History, windows: FaultWindows) -> dict[str, Any]:
    outside: list[int] = []
    inside: list[int] = []
    unarmed: list[int] = []
    by_kind: dict[str, list[int]] = defaultdict(list)
    worst: dict[int, int] = {}
    """Per fault (position in `history.faults`), the latest first start its window met."""
    latest: list[tuple[int, int]] = []  # a heap of (lateness, task id) outside fault windows
    outside_due: list[int] = []
    faults = history.faults
    for task in history.tasks.values():
        point = first_start_lateness(task)
        if point is None:
            continue
        due_ms, late_ms = point
        if task.unarmed:
            # The create said its key was not set (Redis did not answer it): the task waits
            # for the overdue repair, as the error tells the caller. A fault the producer met,
            # whatever the windows say.
            unarmed.append(late_ms)
            continue
        # Inside when the task waited through a fault: due in its window, or due before it
        # and still waiting when it struck (claimed by a listener then killed, say).
        hit = windows.at(due_ms, due_ms + max(0, late_ms))
        if not hit:
            outside.append(late_ms)
            outside_due.append(due_ms)
            if len(latest) < _WORST_LISTED:
                heapq.heappush(latest, (late_ms, task.i))
            elif late_ms > latest[0][0]:
                heapq.heapreplace(latest, (late_ms, task.i))
            continue
        inside.append(late_ms)
        for kind in {faults[i].kind for i in hit}:
            by_kind[kind].append(late_ms)
        for i in hit:
            if late_ms > worst.get(i, -1):
                worst[i] = late_ms
    return {
        "unit": "ms",
        "outside": percentiles(outside),
        "outside_latest": [
            _latest_entry(history.tasks[i], late_ms) for late_ms, i in sorted(latest, reverse=True)
        ],
        "outside_by_interval": _by_interval(outside_due, outside),
        "inside": percentiles(inside),
        "inside_by_fault": {k: percentiles(v) for k, v in sorted(by_kind.items())},
        "worst_by_fault": _worst_by_kind(faults, worst),
        "unarmed_creates": percentiles(unarmed),
    }


def _by_interval(due_ms: list[int], late_ms: list[int]) -> list[dict[str, Any]]:
    """Percentiles of `late_ms` per `_INTERVAL_MS` of due time from the first due."""
    if not due_ms:
        return []
    first = min(due_ms)
    groups: dict[int, list[int]] = defaultdict(list)
    for due, late in zip(due_ms, late_ms, strict=True):
        groups[(due - first) // _INTERVAL_MS].append(late)
    return [
        {"from_s": k * _INTERVAL_MS // 1000, **percentiles(v)} for k, v in sorted(groups.items())
    ]


def _latest_entry(task: Task, late_ms: int) -> dict[str, Any]:
    """One of the latest starts outside fault windows, with what may explain it: a create that
    came after the due time (`created_after_due_ms` > 0) starts no sooner than the create."""
    first = task.runs[0]
    return {
        "i": task.i,
        "late_ms": late_ms,
        "via": task.via,
        "created_after_due_ms": task.created_ms - task.due_at(first.start_ms),
        "start_ms": first.start_ms,
        "pid": first.pid,
        "attempt": first.attempt,
    }


def _worst_by_kind(faults: list[Fault], worst: dict[int, int]) -> dict[str, dict[str, int]]:
    """Per kind of fault, the instance whose latest start ran furthest past the fault's own
    length (issue 42's bound: a fault's max within its length + `FAULT_MAX_OVER_MS`)."""
    out: dict[str, dict[str, int]] = {}
    for i, max_ms in worst.items():
        f = faults[i]
        length_ms = f.end_ms - f.start_ms
        entry = {
            "start_ms": f.start_ms,
            "length_ms": length_ms,
            "max_ms": max_ms,
            "over_length_ms": max_ms - length_ms,
        }
        best = out.get(f.kind)
        if best is None or entry["over_length_ms"] > best["over_length_ms"]:
            out[f.kind] = entry
    return dict(sorted(out.items()))


def _tails_section(lateness: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 42's tail targets, each with its figure and whether it was met. Reported beside
    the verdict, not in it: the verdict judges the promises (fates, growth), these how late."""
    targets: list[dict[str, Any]] = []

    def target(name: str, figure: int | float | None, bound_ms: int) -> None:
        if figure is not None:
            targets.append(
                {"target": name, "ms": figure, "bound_ms": bound_ms, "met": figure <= bound_ms}
            )

    outside = lateness["outside"]
    target("outside faults p99", outside.get("p99"), OUTSIDE_P99_MS)
    target("outside faults max", outside.get("max"), OUTSIDE_MAX_MS)
    for kind in P99_BOUND_FAULTS:
        p = lateness["inside_by_fault"].get(kind)
        if p is not None:
            target(f"{kind} p99", p.get("p99"), FAULT_P99_MS)
    for kind, w in lateness["worst_by_fault"].items():
        target(
            f"{kind} max past its length",
            w["over_length_ms"],
            FAULT_MAX_OVER_MS,
        )
    return targets


# --- growth --------------------------------------------------------------------------------


def growth_check(values: list[float], integer: bool, limit: float) -> dict[str, Any]:
    """Did `values` grow past `limit`? Two ways: the end (median of the last 3) against the
    median of all, which catches a steady climb, and the end against the start (median of the
    first 3), which catches a step that came early and stayed: connections stepping 5 -> 9 at a
    failover a quarter of the way in leave the median at 9, and a fleet run for months of such
    faults adds them up.

    growth = end / median - 1, step = end / start - 1. A count (descriptors, threads,
    connections) must also have risen by more than 1: a count of 6 cannot move by 10 %, its next
    step (7) is already +17 %, so a relative limit alone would fail on a single descriptor
    opened at the wrong moment. From 0, the ratio is None and any rise (more than 1 for a
    count) fails.
    """
    return _judged(
        "median",
        statistics.median(values[:END_SAMPLES]),
        statistics.median(values),
        statistics.median(values[-END_SAMPLES:]),
        max(values),
        integer,
        limit,
    )


def floor_check(
    rows: list[tuple[int, float]], integer: bool, limit: float, quiet: Callable[[int], bool]
) -> dict[str, Any]:
    """`growth_check` for a listener's counts, on their floor: the least sample of the first
    minute, of the minute in the middle and of the last minute (`END_WINDOW_S`, at least
    `END_SAMPLES` samples each), counting only samples outside fault windows (`quiet(t_ms)`)
    where enough are.

    A pool's connections wobble with the load of the moment (a Cluster listener's six per-node
    pools between 12 and 17 all run long, sampled every 10 s), so three samples at either end
    can land on a crest; a connection that leaked, or one a recovery left open for more than a
    minute, is there in every sample and raises the floor. A fault drops counts for a moment
    (a restart closes every connection): such a dip inside a window is not the floor either.
    """
    calm = [r for r in rows if quiet(r[0])]
    if len(calm) >= MIN_GROWTH_SAMPLES:
        rows = calm
    span_ms = int(END_WINDOW_S * 1000)

    def floor_of(lo_ms: int, hi_ms: int, nearest: int) -> float:
        picked = [v for t, v in rows if lo_ms <= t <= hi_ms]
        if len(picked) < END_SAMPLES:  # sparse samples: the nearest few instead
            by_distance = sorted(rows, key=lambda r: abs(r[0] - nearest))
            picked = [v for _, v in by_distance[:END_SAMPLES]]
        return min(picked)

    first_ms, last_ms = rows[0][0], rows[-1][0]
    mid_ms = (first_ms + last_ms) // 2
    check = _judged(
        f"floor over {END_WINDOW_S:g} s outside fault windows",
        floor_of(first_ms, first_ms + span_ms, first_ms),
        floor_of(mid_ms - span_ms // 2, mid_ms + span_ms // 2, mid_ms),
        floor_of(last_ms - span_ms, last_ms, last_ms),
        max(v for _, v in rows),
        integer,
        limit,
    )
    return {**check, "judged_samples": len(rows)}


def _judged(
    basis: str, start: float, middle: float, end: float, top: float, integer: bool, limit: float
) -> dict[str, Any]:
    def rose(base: float) -> tuple[bool, float | None]:
        rise = end - base
        ratio = end / base - 1 if base > 0 else None
        up = rise > 0 if ratio is None else ratio > limit
        return (up and rise > 1 if integer else up), ratio

    grew, growth = rose(middle)
    stepped, step = rose(start)
    return {
        "basis": basis,
        "start": round(start, 3),
        "middle": round(middle, 3),
        "end": round(end, 3),
        "max": round(top, 3),
        "growth": None if growth is None else round(growth, 4),
        "step": None if step is None else round(step, 4),
        "passed": not grew and not stepped,
    }


def _series_check(
    rows: list[tuple[int, float]],
    integer: bool,
    limit: float,
    quiet: Callable[[int], bool] | None = None,
) -> dict[str, Any]:
    """`growth_check` of `rows` ((t_ms, value)), or `floor_check` given `quiet`."""
    if len(rows) < MIN_GROWTH_SAMPLES:
        return {"status": "too_short", "samples": len(rows), "passed": True}
    if quiet is not None:
        check = floor_check(rows, integer, limit, quiet)
    else:
        check = growth_check([v for _, v in rows], integer, limit)
    return {"status": "ok" if check["passed"] else "grew", "samples": len(rows), **check}


def _listener_growth(history: History, params: dict[str, Any]) -> list[dict[str, Any]]:
    warm_ms = int(params["warm_up_s"] * 1000)
    limit = float(params["growth_limit"])
    by_pid: dict[int, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for sample in history.samples:
        for entry in sample.get("listeners") or ():
            by_pid[int(entry["pid"])].append((int(sample["t_ms"]), entry))
    windows = FaultWindows(history.faults, float(params.get("settle_s", 0.0)))

    def quiet(t_ms: int) -> bool:
        return not windows.kinds_at(t_ms)

    settle_ms = int(float(params.get("settle_s", 0.0)) * 1000)
    out = []
    for pid, rows in sorted(by_pid.items(), key=lambda kv: kv[1][0][0]):
        first = rows[0][1]
        started_ms = int(first.get("started_ms") or rows[0][0])
        # A fresh process fills its pools and caches first: judge it after its own warm-up too.
        from_ms = max(int(params["start_ms"]) + warm_ms, started_ms + warm_ms)
        kept = [(t, e) for t, e in rows if t >= from_ms]
        rss_from_ms = max(from_ms, _every_kind_met(history.faults, started_ms, settle_ms))
        like = _one_driving_state(kept)
        metrics = {
            name: _series_check(
                [
                    (t, float(e[name]))
                    for t, e in (like if name in DRIVER_HELD else kept)
                    if e.get(name) is not None and (name != "rss_mb" or t >= rss_from_ms)
                ],
                name in INTEGER_METRICS,
                limit,
                quiet if name in INTEGER_METRICS else None,
            )
            for name in GROWTH_METRICS
        }
        if len(like) < len(kept):
            for name in DRIVER_HELD:
                metrics[name]["judged"] = "while driving" if like[0][1]["drives"] else "not driving"
        if rss_from_ms > from_ms:
            metrics["rss_mb"]["judged_from_ms"] = rss_from_ms
        too_short = len(kept) < MIN_GROWTH_SAMPLES
        out.append(
            {
                "pid": pid,
                "slot": first.get("slot"),
                "started_ms": started_ms,
                "samples": len(kept),
                "status": "too_short" if too_short else "ok",
                "passed": all(m["passed"] for m in metrics.values()),
                "metrics": metrics,
            }
        )
    return out


def _one_driving_state(rows: list[tuple[int, dict[str, Any]]]) -> list[tuple[int, dict[str, Any]]]:
    """The samples taken while the listener did not drive, when there are enough of them to
    judge, else those taken while it drove; all of them when the history does not say.

    The driving listener keeps one Redis connection per primary more than the others (its
    lookups go to every primary at once): on a three-primary Cluster 12 against 9, measured
    with three listeners under load. The driver moves at kill -9, SIGSTOP, failovers and
    stalls, so a listener that took it over late in a run showed 9 -> 12 as if it leaked
    (the Cluster hour, 2026-11-28). A connection that leaks stays when it stops driving: it is
    in the samples judged."""
    if not any("drives" in e for _, e in rows):
        return rows
    idle = [(t, e) for t, e in rows if e.get("drives") is False]
    if len(idle) >= MIN_GROWTH_SAMPLES:
        return idle
    driving = [(t, e) for t, e in rows if e.get("drives") is True]
    return driving if len(driving) >= MIN_GROWTH_SAMPLES else rows


def _every_kind_met(faults: list[Fault], started_ms: int, settle_ms: int) -> int:
    """When a process started at `started_ms` had met once every kind of fault that came
    after its start (the end of the last kind's first instance there, plus `settle_ms`);
    `started_ms` when none came.

    A listener's RSS is judged from there: each kind's first burst (a backlog claimed after a
    stall, a takeover's share, a topology refresh after a slot migration) sets the allocator's
    high-water mark for it, reused at every later one. The Cluster hour's listeners climbed
    from 75 to 86-88 MB over their first 10-15 minutes, whenever they started, and stayed
    there; judged from two minutes in, two of them failed as "+10.5 % / +12.7 %". A process
    that keeps growing after meeting every fault still fails.
    """
    firsts: dict[str, int] = {}
    for fault in sorted(faults, key=lambda f: f.start_ms):
        if fault.start_ms >= started_ms and fault.kind not in firsts:
            firsts[fault.kind] = fault.end_ms + settle_ms
    return max(firsts.values(), default=started_ms)


def _ledger_rows(sample: dict[str, Any]) -> dict[str, int] | None:
    rows = sample.get("ledger_rows")
    return rows if isinstance(rows, dict) and rows else None


def _server_growth(history: History, params: dict[str, Any]) -> dict[str, Any]:
    """Redis memory and pending rows, once the longest due time has filled the queue.

    Pending rows and the keys behind them grow until tasks created at the start fall due
    (`max_due_s`); finished rows saw-tooth with every prune, so they get a bound (below), not an
    end-versus-median check.
    """
    from_ms = int(params["start_ms"]) + int(max(params["warm_up_s"], params["max_due_s"]) * 1000)
    to_ms = int(params["produce_end_ms"])
    limit = float(params["growth_limit"])
    window = [s for s in history.samples if from_ms <= s["t_ms"] <= to_ms]
    redis_rows = [
        (s["t_ms"], float(s["redis_used_bytes"]))
        for s in window
        if s.get("redis_used_bytes") is not None
    ]
    pending = [
        (s["t_ms"], float(r.get("pending", 0)))
        for s in window
        if (r := _ledger_rows(s)) is not None
    ]
    return {
        "from_ms": from_ms,
        "to_ms": to_ms,
        "redis_used_bytes": _series_check(redis_rows, False, limit),
        "ledger_pending_rows": _series_check(pending, True, limit),
    }


def _ledger_bound(history: History, params: dict[str, Any]) -> dict[str, Any]:
    """Finished rows (done + dead + cancelled) stay under what retention and pruning allow.

    At most `retain_done_s + prune_every_s` worth of finished tasks wait for a prune, 25 % slack
    for bursts, plus every dead task created (a dead row is evidence: its retention may differ).
    """
    needed = ("rate_per_s", "retain_done_s", "prune_every_s")
    if any(params.get(k) is None for k in needed):
        return {
            "status": "not_checked",
            "passed": True,
            "missing": [k for k in needed if params.get(k) is None],
        }
    dead_created = sum(1 for t in history.tasks.values() if t.kind == "dead")
    bound = (
        LEDGER_BOUND_SLACK
        * float(params["rate_per_s"])
        * (float(params["retain_done_s"]) + float(params["prune_every_s"]))
        + dead_created
    )
    seen = [
        (s["t_ms"], sum(int(r.get(k, 0)) for k in FINISHED_STATUSES))
        for s in history.samples
        if (r := _ledger_rows(s)) is not None
    ]
    max_t_ms, max_rows = max(seen, key=lambda p: p[1], default=(None, 0))
    return {
        "status": "ok" if max_rows <= bound else "exceeded",
        "bound_rows": round(bound),
        "max_finished_rows": max_rows,
        "max_at_ms": max_t_ms,
        "dead_created": dead_created,
        "passed": max_rows <= bound,
    }


# --- throughput ----------------------------------------------------------------------------


@dataclass
class Throughput:
    """Counts per bucket: ok ends, starts and tasks falling due (the producer's final due)."""

    bucket_s: int
    t0_ms: int
    ok_ends: list[int]
    starts: list[int]
    due: list[int]

    def bucket_ms(self, n: int) -> int:
        """Start of bucket `n` in epoch ms."""
        return self.t0_ms + n * self.bucket_s * 1000


def throughput_series(
    history: History, start_ms: int, end_ms: int, bucket_s: int = BUCKET_S
) -> Throughput:
    """Ok ends, starts and dues per `bucket_s` bucket from `start_ms` to `end_ms`."""
    width_ms = bucket_s * 1000
    n = max(1, math.ceil((end_ms - start_ms) / width_ms))
    out = Throughput(bucket_s, start_ms, [0] * n, [0] * n, [0] * n)

    def add(counts: list[int], t_ms: int) -> None:
        idx = (t_ms - start_ms) // width_ms
        if 0 <= idx < n:
            counts[idx] += 1

    for task in history.tasks.values():
        add(out.due, task.final_due_ms)
        for run in task.runs:
            add(out.starts, run.start_ms)
            if run.result == "ok" and run.end_ms is not None:
                add(out.ok_ends, run.end_ms)
    return out


def _rate_summary(counts: list[int], bucket_s: int) -> dict[str, float | None]:
    if not counts:
        return {"min": None, "p50": None, "max": None}
    per_s = [c / bucket_s for c in counts]
    return {"min": min(per_s), "p50": statistics.median(per_s), "max": max(per_s)}


def _throughput_section(history: History, params: dict[str, Any]) -> dict[str, Any]:
    start_ms, end_ms = int(params["start_ms"]), int(params["end_ms"])
    series = throughput_series(history, start_ms, end_ms)
    # Judge the steady part: once tasks of every due time fall due (the rate of dues climbs
    # until `max_due_s`), before production ends.
    first = math.ceil(max(params["warm_up_s"], params["max_due_s"]) / series.bucket_s)
    last = (int(params["produce_end_ms"]) - start_ms) // (series.bucket_s * 1000)
    ok_steady = series.ok_ends[first:last]
    return {
        "bucket_s": series.bucket_s,
        "steady_from_ms": series.bucket_ms(first),
        "steady_to_ms": series.bucket_ms(last),
        "ok_ends_per_s": _rate_summary(ok_steady, series.bucket_s),
        "starts_per_s": _rate_summary(series.starts[first:last], series.bucket_s),
        "due_per_s": _rate_summary(series.due[first:last], series.bucket_s),
        "empty_buckets": sum(1 for c in ok_steady if c == 0),
        "ok_ends_total": sum(series.ok_ends),
        "starts_total": sum(series.starts),
    }


def _pace_section(history: History, windows: FaultWindows) -> dict[str, Any]:
    """What the listeners' work cost in CPU outside fault windows: the machine's pace.

    The same code at the same rate spent 0.49-0.55 cores one night and 0.74 cores another
    morning, and its outside p99 went from 23 ms to 66 ms with it (ENDURANCE rounds seventeen
    and nineteen): a tail target is judged only on a machine whose pace is known. Summed over
    the sampling intervals that meet no fault window and keep the same listener processes (a
    restart's start-up is not steady work): the listeners' CPU seconds over the wall seconds
    (cores), and over the handler starts in those intervals (ms a start)."""
    starts = sorted(run.start_ms for task in history.tasks.values() for run in task.runs)
    cpu_s = wall_s = 0.0
    counted = intervals = 0
    samples = history.samples
    for before, after in itertools.pairwise(samples):
        t0, t1 = int(before["t_ms"]), int(after["t_ms"])
        cpu0 = {entry.get("pid"): entry.get("cpu_s") for entry in before.get("listeners", [])}
        cpu1 = {entry.get("pid"): entry.get("cpu_s") for entry in after.get("listeners", [])}
        if t1 <= t0 or set(cpu0) != set(cpu1) or windows.at(t0, t1):
            continue
        if any(not isinstance(v, int | float) for v in (*cpu0.values(), *cpu1.values())):
            continue
        cpu_s += sum(float(cpu1[pid]) - float(cpu0[pid]) for pid in cpu0)
        wall_s += (t1 - t0) / 1000
        counted += bisect.bisect_left(starts, t1) - bisect.bisect_left(starts, t0)
        intervals += 1
    return {
        "quiet_intervals": intervals,
        "listener_cores": round(cpu_s / wall_s, 3) if wall_s else None,
        "listener_cpu_ms_per_start": round(1000 * cpu_s / counted, 3) if counted else None,
    }


# --- verdict -------------------------------------------------------------------------------


def _ids(section: dict[str, Any]) -> str:
    ids = [str(e["i"]) for e in section["examples"][:5]]
    return ", ".join(ids)


def _grew(m: dict[str, Any]) -> str:
    """How a series failed its check: start, middle and end, what they are, and both ratios."""
    return (
        f"grew {m['start']:g} (start) -> {m['middle']:g} (middle) -> {m['end']:g} (end), "
        f"each a {m['basis']}: growth {m['growth']} against the middle, {m['step']} against "
        "the start"
    )


def _failures(report: dict[str, Any]) -> list[str]:
    failures = []
    for name in FATES:
        section = report["fates"][name]
        if name in FAILED_FATES and section["count"]:
            failures.append(f"{section['count']} task(s) {name}, e.g. ids {_ids(section)}")
    early = report["early"]
    if early["starts"]:
        failures.append(
            f"{early['starts']} start(s) of {early['tasks']} task(s) more than "
            f"{EARLY_TOLERANCE_MS} ms early, e.g. ids {_ids(early)}"
        )
    for tag in report["cancel_tag_overruns"]:
        failures.append(
            f"cancel_tag at {tag['t_ms']}: {tag['started_after']} of {tag['ids']} tasks started "
            f"after it, though it cancelled {tag['cancelled']}"
        )
    for proc in report["growth"]["listeners"]:
        for name, m in proc["metrics"].items():
            if not m["passed"]:
                failures.append(
                    f"listener pid {proc['pid']} (slot {proc['slot']}): {name} {_grew(m)}"
                )
    for name in ("redis_used_bytes", "ledger_pending_rows"):
        m = report["growth"]["servers"][name]
        if not m["passed"]:
            failures.append(f"{name} {_grew(m)}")
    bound = report["ledger_bound"]
    if not bound["passed"]:
        failures.append(
            f"finished ledger rows reached {bound['max_finished_rows']}, "
            f"bound {bound['bound_rows']}"
        )
    return failures


def verdict_of(history: History, params: dict[str, Any]) -> dict[str, Any]:
    """The verdict of an already loaded history (see `verdict`)."""
    ctx = _context(history.faults, params)
    windows = FaultWindows(history.faults, float(params.get("settle_s", 10)))
    report: dict[str, Any] = {
        "params": params,
        "created": len(history.tasks),
        "created_by_kind": dict(Counter(t.kind for t in history.tasks.values())),
        "created_by_via": dict(Counter(t.via for t in history.tasks.values())),
        "faults": [
            {
                "fault": f.kind,
                "start_ms": f.start_ms,
                "end_ms": f.end_ms,
                "pids": sorted(f.pids),
                "detail": f.detail,
            }
            for f in history.faults
        ],
        **_fates_section(history, ctx, int(params.get("examples", EXAMPLES))),
        "cancel_tag_overruns": _tag_overruns(history),
        "lateness": (lateness := _lateness_section(history, windows)),
        "tails": _tails_section(lateness),
        "growth": {
            "listeners": _listener_growth(history, params),
            "servers": _server_growth(history, params),
        },
        "ledger_bound": _ledger_bound(history, params),
        "throughput": _throughput_section(history, params),
        "pace": _pace_section(history, windows),
        "anomalies": dict(history.anomalies),
    }
    report["failures"] = _failures(report)
    report["passed"] = not report["failures"]
    return report


def verdict(run_dir: Path, params: dict[str, Any]) -> dict[str, Any]:
    """Judge the soak run recorded in `run_dir`; a JSON-serialisable dict.

    `params`: start_ms, produce_end_ms, end_ms (epoch ms); warm_up_s, max_due_s, max_attempts,
    settle_s, growth_limit, retain_done_s, prune_every_s, rate_per_s; optional
    `window1_faults` (fault kinds that document a second run, default `WINDOW1_FAULTS`),
    `unfinished_grace_s` (a task whose last due or run is this close to end_ms is "unfinished",
    not lost or dead_short; default 0) and `examples` (per fate, default 20).

    Keys: passed, failures (one line each), fates (count and examples with their history per
    fate), early, vanished_then_retried (a warning: a run without end on a process no kill -9
    hit, run again), cancel_tag_overruns, lateness (with each kind of fault's worst instance),
    tails (issue 42's lateness targets, each met or not), growth, ledger_bound, throughput, faults,
    anomalies (lines that could not be read or joined).
    """
    return verdict_of(load(run_dir), params)
