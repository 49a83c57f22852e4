"""Where a run's wall time goes: `KEYEXPIRY_TEST_TIMELINE=<dir>` makes each xdist worker write
one JSON line per test (worker, test, start and end on the wall clock, seconds waited for a fault
slot) to <dir>/<worker>.jsonl. `make test` must stay under 12 minutes on 2 cores; the durations
pytest prints do not say which worker sat idle or waited, this does."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from tests.slots import SLOT_WAIT_S

_DIR = os.environ.get("KEYEXPIRY_TEST_TIMELINE")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    if not _DIR:
        yield
        return
    start_s = time.time()
    yield
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    line = {
        "worker": worker,
        "test": item.nodeid,
        "start_s": round(start_s, 3),
        "end_s": round(time.time(), 3),
        "slot_wait_s": round(item.stash.get(SLOT_WAIT_S, 0.0), 3),
    }
    Path(_DIR).mkdir(parents=True, exist_ok=True)
    with open(Path(_DIR) / f"{worker}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def read(directory: Path) -> list[dict[str, Any]]:
    """The lines every worker of a run wrote to `directory`."""
    return [json.loads(line) for f in sorted(directory.glob("*.jsonl")) for line in f.open()]


def summary(lines: list[dict[str, Any]]) -> list[str]:
    """Per worker: tests, busy seconds, seconds waited for a slot, when it ended."""
    t0 = min(r["start_s"] for r in lines)
    t1 = max(r["end_s"] for r in lines)
    out = [f"{len(lines)} tests in {t1 - t0:.0f} s"]
    workers: dict[str, list[dict[str, Any]]] = {}
    for r in lines:
        workers.setdefault(r["worker"], []).append(r)
    for name, rows in sorted(workers.items()):
        busy_s = sum(r["end_s"] - r["start_s"] for r in rows)
        wait_s = sum(r["slot_wait_s"] for r in rows)
        end_s = max(r["end_s"] for r in rows) - t0
        out.append(
            f"{name}: {len(rows)} tests, busy {busy_s:.0f} s of which {wait_s:.0f} s waiting "
            f"for a fault slot, done at {end_s:.0f} s"
        )
    return out


def durations(lines: list[dict[str, Any]], min_s: float = 0.5) -> dict[str, float]:
    """Each test's own time (its slot wait left out) by node id without its xdist group, for
    tests that took at least `min_s` (tests/slots.py spreads the fault scenarios by them)."""
    from tests.slots import ungrouped_id

    own = {ungrouped_id(r["test"]): r["end_s"] - r["start_s"] - r["slot_wait_s"] for r in lines}
    return {test: round(s, 1) for test, s in sorted(own.items()) if s >= min_s}


def main(argv: list[str]) -> int:
    """`python -m tests.timeline <dir> [--durations]`: sum up a run's timeline; with
    `--durations`, also write its durations to tests/durations.json."""
    if not argv or argv[0].startswith("-"):
        print("usage: python -m tests.timeline <dir> [--durations]", file=sys.stderr)
        return 2
    lines = read(Path(argv[0]))
    if not lines:
        print(f"no timeline in {argv[0]}", file=sys.stderr)
        return 1
    print("\n".join(summary(lines)))
    if "--durations" in argv[1:]:
        from tests.slots import DURATIONS

        found = durations(lines)
        DURATIONS.write_text(json.dumps(found, indent=0, sort_keys=True) + "\n")
        print(f"{len(found)} durations written to {DURATIONS}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
