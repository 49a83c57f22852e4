"""`bench --scenario soak`: the history the soak runner recorded, read back (`load()`): each
task's creates, cancels and runs, the faults and their windows (`FaultWindows`), the samples.

Pure logic, no servers: it reads the JSON-lines files of a run directory (`produced.jsonl`,
`runs-*.jsonl`, `faults.jsonl`, `samples.jsonl`; every time an epoch millisecond on one
machine), counting what it cannot read as anomalies. `soak_verdict` judges it, `soak_plots`
draws it."""

from __future__ import annotations

import bisect
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class Run:
    """One handler run: its start line and, unless its process died, its end line."""

    start_ms: int
    attempt: int
    pid: int
    seen_due_ms: int | None
    end_ms: int | None = None
    result: str | None = None


@dataclass(slots=True)
class Task:
    """One created task as the producer and the listeners recorded it."""

    i: int
    kind: str
    via: str
    created_ms: int
    due_ms: int  # as created
    # (t_ms, due_ms) of each reschedule, oldest first; a tuple: most tasks have none, and
    # millions of tasks make every empty list count.
    reschedules: tuple[tuple[int, int], ...] = ()
    cancels: tuple[tuple[int, bool], ...] = ()
    tag_cancel_ms: int | None = (
        None  # the latest cancel_tag naming it (which ones it took is unknown)
    )
    runs: list[Run] = field(default_factory=list)
    ambiguous: bool = False
    """Its create or a reschedule was retried after a call that may have committed (the
    ledger's answer was lost), or retried past its due: a run between the two is followed by
    another (GUARANTEES window 3)."""
    unarmed: bool = False
    """Its create recorded the row but could not set its key (`RedisUnavailableError`): it
    waits for the listeners' overdue repair (`stuck_after_s`), as the error says."""

    def due_at(self, t_ms: int) -> int:
        """The due the producer had last set at `t_ms` (its first one if none was set yet)."""
        for set_ms, due_ms in reversed(self.reschedules):
            if set_ms <= t_ms:
                return due_ms
        return self.due_ms

    @property
    def final_due_ms(self) -> int:
        """The due the producer set last."""
        return self.reschedules[-1][1] if self.reschedules else self.due_ms

    @property
    def cancel_ok_ms(self) -> int | None:
        """When the first cancel that took effect returned."""
        return next((t for t, ok in self.cancels if ok), None)


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault."""

    kind: str
    start_ms: int
    end_ms: int
    pids: frozenset[int]
    detail: str
    hit_ms: int = 0
    """When a signal fault's signal was sent (after the driver's wait for its fleet lock); its
    start stamp is taken before. 0: not recorded (other faults, older histories): `start_ms`."""


@dataclass(frozen=True, slots=True)
class TagCancel:
    """One `cancel_tag` call: the tasks under the tag and how many it cancelled."""

    t_ms: int
    ids: tuple[int, ...]
    cancelled: int


@dataclass
class History:
    """Everything a soak run recorded, joined per task."""

    tasks: dict[int, Task]
    faults: list[Fault]
    samples: list[dict[str, Any]]
    tag_cancels: list[TagCancel]
    anomalies: Counter[str] = field(default_factory=Counter)


# --- reading -------------------------------------------------------------------------------


def _lines(path: Path, anomalies: Counter[str]) -> Iterator[dict[str, Any]]:
    # A process killed mid-write leaves a torn last line: count it rather than fail the verdict.
    if not path.exists():
        return
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                anomalies["unparsable_lines"] += 1
                continue
            if isinstance(row, dict):
                yield row


def _read_produced(path: Path, anomalies: Counter[str]) -> tuple[dict[int, Task], list[TagCancel]]:
    tasks: dict[int, Task] = {}
    tags: list[TagCancel] = []
    for row in _lines(path, anomalies):
        op = row.get("op")
        if op == "create":
            i = int(row["i"])
            tasks[i] = Task(
                i=i,
                # Interned: json.loads makes a new string per line, millions of "normal"s.
                kind=sys.intern(str(row["kind"])),
                via=sys.intern(str(row.get("via", ""))),
                created_ms=int(row["t_ms"]),
                due_ms=int(row["due_ms"]),
                ambiguous=bool(row.get("ambiguous", False)),
                unarmed=bool(row.get("unarmed", False)),
            )
        elif op == "cancel_tag":
            tags.append(TagCancel(int(row["t_ms"]), tuple(map(int, row["ids"])), row["cancelled"]))
        elif op in ("reschedule", "cancel"):
            task = tasks.get(int(row["i"]))
            if task is None:
                anomalies[f"{op}_of_unknown_task"] += 1
            elif op == "reschedule":
                task.reschedules += ((int(row["t_ms"]), int(row["due_ms"])),)
                task.ambiguous = task.ambiguous or bool(row.get("ambiguous", False))
            else:
                task.cancels += ((int(row["t_ms"]), bool(row["ok"])),)
    for tag in tags:
        for i in tag.ids:
            task = tasks.get(i)
            if task is not None:
                task.tag_cancel_ms = max(task.tag_cancel_ms or tag.t_ms, tag.t_ms)
    return tasks, tags


def _read_runs(run_dir: Path, tasks: dict[int, Task], anomalies: Counter[str]) -> None:
    for path in sorted(run_dir.glob("runs-*.jsonl")):
        # Ends are matched to their start by (task, attempt, pid), first in first out.
        open_runs: dict[tuple[int, int, int], list[Run]] = defaultdict(list)
        for row in _lines(path, anomalies):
            i, attempt, pid = int(row["i"]), int(row["attempt"]), int(row["pid"])
            task = tasks.get(i)
            if task is None:
                anomalies["run_of_unknown_task"] += 1
                continue
            if row.get("ev") == "start":
                seen = row.get("due_ms")
                run = Run(int(row["t_ms"]), attempt, pid, None if seen is None else int(seen))
                task.runs.append(run)
                open_runs[(i, attempt, pid)].append(run)
            elif row.get("ev") == "end":
                waiting = open_runs.get((i, attempt, pid))
                if not waiting:
                    anomalies["end_without_start"] += 1
                    continue
                run = waiting.pop(0)
                if not waiting:  # only open runs stay indexed: millions of keys otherwise
                    del open_runs[(i, attempt, pid)]
                run.end_ms, run.result = int(row["t_ms"]), sys.intern(str(row["result"]))
    for task in tasks.values():
        task.runs.sort(key=lambda r: r.start_ms)


def _read_faults(path: Path, anomalies: Counter[str]) -> list[Fault]:
    faults = [
        Fault(
            kind=str(row["fault"]),
            start_ms=int(row["start_ms"]),
            end_ms=int(row.get("end_ms") or row["start_ms"]),
            pids=frozenset(int(p) for p in row.get("pids") or ()),
            detail=str(row.get("detail", "")),
            hit_ms=int(row.get("hit_ms") or row["start_ms"]),
        )
        for row in _lines(path, anomalies)
    ]
    return sorted(faults, key=lambda f: f.start_ms)


def load(run_dir: Path) -> History:
    """Read a soak run's files from `run_dir` and join them per task."""
    anomalies: Counter[str] = Counter()
    tasks, tags = _read_produced(run_dir / "produced.jsonl", anomalies)
    _read_runs(run_dir, tasks, anomalies)
    faults = _read_faults(run_dir / "faults.jsonl", anomalies)
    samples = sorted(_lines(run_dir / "samples.jsonl", anomalies), key=lambda s: s["t_ms"])
    return History(tasks, faults, samples, tags, anomalies)


# --- fault windows -------------------------------------------------------------------------


class FaultWindows:
    """Which faults' windows ([start, end + settle]) contain a time, in O(log n) per lookup."""

    def __init__(self, faults: list[Fault], settle_s: float) -> None:
        """Index `faults`, each window extended by `settle_s` after the fault's end."""
        settle_ms = int(settle_s * 1000)
        spans = sorted((f.start_ms, f.end_ms + settle_ms, i) for i, f in enumerate(faults))
        self.faults = faults
        self._starts = [s for s, _, _ in spans]
        self._spans = spans
        self._longest_ms = max((e - s for s, e, _ in spans), default=0)

    def at(self, t_ms: int, until_ms: int | None = None) -> list[int]:
        """The positions in `faults` of the faults whose window meets [`t_ms`, `until_ms`]
        (default: the instant `t_ms`); empty: outside every window."""
        until_ms = t_ms if until_ms is None else until_ms
        found: list[int] = []
        idx = bisect.bisect_right(self._starts, until_ms) - 1
        # Windows starting earlier than the longest one's length cannot reach t_ms.
        while idx >= 0 and self._starts[idx] >= t_ms - self._longest_ms:
            start_ms, end_ms, i = self._spans[idx]
            if start_ms <= until_ms and t_ms <= end_ms:
                found.append(i)
            idx -= 1
        return found

    def kinds_at(self, t_ms: int, until_ms: int | None = None) -> set[str]:
        """The kinds of fault whose window meets [`t_ms`, `until_ms`] (see `at`)."""
        return {self.faults[i].kind for i in self.at(t_ms, until_ms)}
