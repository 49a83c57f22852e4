"""At most `SLOTS` fault scenarios at once across the xdist workers of one run.

The fault scenarios kill, pause and load listeners and hold them to timing bounds (a takeover in
seconds, a recovery within 15 s, a lease that must not run out); on a 2-core machine four of
them at once starved each other past those bounds, two at once left half the suite's workers
idle (a `make test` of 22 minutes, mostly waiting). So the suite runs four workers, and a
worker about to start a fault scenario (marker `faults`) first takes one of `SLOTS` file locks
shared by the run's workers; the other workers go on with the rest of the suite meanwhile.
(The tests that load the machine for half a minute or more, fault scenarios or not, share the
xdist group `heavy`: `--dist loadgroup` runs them on one worker, one after another.)

The lock is taken around the whole test (setup, call and teardown) and before pytest-timeout
starts its clock: time spent waiting for a slot is not the test's.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import tempfile
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import TypeVar

import pytest

SLOT_WAIT_S = pytest.StashKey[float]()
"""How long a test waited for its slot (read by tests/timeline.py)."""
SLOTS = int(os.environ.get("KEYEXPIRY_TEST_FAULT_SLOTS", "2"))
"""Fault scenarios that may run at once (0: no limit)."""
DURATIONS = Path(__file__).with_name("durations.json")
"""Seconds each test of half a second or more took in a recent `make test` (written by
`python -m tests.timeline <dir> --durations`): where the slot takers go in the run."""
TAKER_S = 10.0
"""A slot taker's expected time when no duration of any taker is known."""
QUICK_S = 0.05
"""Any other test's expected time when its own is not known (most take milliseconds)."""
T = TypeVar("T")


def _takes_a_slot(item: pytest.Item) -> bool:
    return item.get_closest_marker("faults") is not None


def _slot_dir(config: pytest.Config) -> Path | None:
    """A directory the workers of this run share (and no other run): named by xdist's run id."""
    workerinput = getattr(config, "workerinput", None)
    if not workerinput:
        return None  # one process: nothing runs beside it
    path = Path(tempfile.gettempdir()) / f"keyexpiry-test-slots-{workerinput['testrunuid']}"
    path.mkdir(exist_ok=True)
    return path


def _take(directory: Path) -> int:
    """An open, locked slot file's descriptor; waits until one is free."""
    while True:
        for n in range(SLOTS):
            fd = os.open(directory / f"slot{n}", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return fd
        time.sleep(0.05)


def pytest_configure(config: pytest.Config) -> None:
    """Refuse, with a message, the one pairing known not to group (`_check_grouped` catches
    others on the workers, where pytest-xdist only says INTERNALERROR)."""
    if (
        getattr(config, "workerinput", None) is not None
        or config.getoption("dist", default=None) != "loadgroup"
    ):
        return
    xdist = importlib.metadata.version("pytest-xdist")
    if _release(pytest.__version__) >= (9, 2) and _release(xdist) <= (3, 8):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist {xdist} does not group tests "
            "(--dist loadgroup spreads the heavy ones over every worker; "
            "pytest-dev/pytest-xdist#1386): pip install -e '.[test]' installs a pytest below 9.2"
        )


def _release(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string ("9.2.0.dev1" -> (9, 2))."""
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


def _check_grouped(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With `--dist loadgroup`, pytest-xdist marks a grouped test's node id (`…@heavy`) for the
    scheduler to keep the group on one worker. When that mark does not take (pytest 9.2 with
    pytest-xdist 3.8, pytest-dev/pytest-xdist#1386), the heavy tests run beside each other on
    every worker and the suite's timing bounds and length suffer unseen: refuse the run."""
    if not config.getoption("loadgroup", default=False):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid:
            raise pytest.UsageError(
                f"pytest-xdist did not group {item.nodeid} (pytest {pytest.__version__}): "
                "--dist loadgroup would spread the heavy tests over every worker; "
                "install the pytest pyproject.toml names (pip install -e '.[test]')"
            )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Spread the slot takers through the run by their expected time: xdist hands each worker
    its next tests in this order, and a worker waiting for a slot runs nothing else meanwhile.
    A run that began with every fault scenario in a row (tests/faults sorts early) kept half its
    workers waiting at the start; spread evenly by count, the takers (5-45 s each, against
    milliseconds for most others) still met each other in clusters, and 11 % of the workers'
    time went to waiting for a slot (`make test` on 20304f3, tests/timeline.py). Here each taker
    is followed by a share of the other tests' expected time in proportion to its own
    (durations.json). Replayed on that run's durations the waits fell from 340 s to about 120 s
    and the run from 756 s to about 700 s; measured in a fresh clone's CI on ea86926, the
    waits fell from 346 s to 170 s but the run only from 782 s to 761 s: with fewer workers
    waiting, the tests' own time rose (2,765 -> 2,855 worker-seconds; two cores shared by four
    workers). Each list keeps its order."""
    if getattr(config, "workerinput", None) is None:
        return
    _check_grouped(config, items)
    if SLOTS <= 0:
        return
    items[:] = spread_by_time(items, _takes_a_slot, expected_durations())


def expected_durations() -> dict[str, float]:
    """Seconds each test took in a recent run (those of half a second or more), by node id
    without its xdist group (`ungrouped_id`); empty if durations.json is missing or unreadable."""
    try:
        durations = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in durations.items()} if isinstance(durations, dict) else {}


def ungrouped_id(nodeid: str) -> str:
    """`nodeid` without the `@<group>` pytest-xdist's loadgroup appends to a grouped test's id.
    A parameter may hold an `@` too (`[sqlite-os@system@ls-...]`): a group's suffix is what
    follows the last `@` when it holds neither `]` nor `::`."""
    head, at, tail = nodeid.rpartition("@")
    return head if at and "]" not in tail and "::" not in tail else nodeid


def spread_by_time(
    items: list[T], takes_a_slot: Callable[[T], bool], durations: dict[str, float]
) -> list[T]:
    """`items` with the slot takers spread among the others by expected time: after each
    taker, the others whose expected time adds up to its share (its expected time over all
    takers', times all the others'). Grouped tests (xdist_group: one worker runs them, whatever
    their place) go first, untouched. A test missing from `durations` is expected to take the
    median of the known takers (a taker) or `QUICK_S` (any other)."""

    def base(item: T) -> str:
        return ungrouped_id(str(getattr(item, "nodeid", item)))

    def grouped(item: T) -> bool:
        return base(item) != str(getattr(item, "nodeid", item))

    first = [i for i in items if grouped(i)]
    takers = [i for i in items if not grouped(i) and takes_a_slot(i)]
    others = [i for i in items if not grouped(i) and not takes_a_slot(i)]
    if not takers or not others:
        return first + takers + others
    known = sorted(durations[base(i)] for i in takers if base(i) in durations)
    taker_s = known[len(known) // 2] if known else TAKER_S

    def expected_s(item: T, default_s: float) -> float:
        return durations.get(base(item), default_s)

    takers_s = sum(expected_s(i, taker_s) for i in takers)
    others_s = sum(expected_s(i, QUICK_S) for i in others)
    spread: list[T] = []
    ahead = iter(others)
    owed_s = 0.0
    for taker in takers:
        spread.append(taker)
        owed_s += expected_s(taker, taker_s) / takers_s * others_s
        while owed_s > 0 and (other := next(ahead, None)) is not None:
            spread.append(other)
            owed_s -= expected_s(other, QUICK_S)
    spread.extend(ahead)
    return first + spread


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    directory = _slot_dir(item.config) if SLOTS > 0 and _takes_a_slot(item) else None
    if directory is None:
        yield
        return
    asked_s = time.monotonic()
    fd = _take(directory)
    item.stash[SLOT_WAIT_S] = time.monotonic() - asked_s
    try:
        yield
    finally:
        os.close(fd)  # closing the descriptor releases its lock
