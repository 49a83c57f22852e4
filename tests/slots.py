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
import os
import tempfile
import time
from collections.abc import Generator
from pathlib import Path

import pytest

SLOT_WAIT_S = pytest.StashKey[float]()
"""How long a test waited for its slot (read by tests/timeline.py)."""
SLOTS = int(os.environ.get("KEYEXPIRY_TEST_FAULT_SLOTS", "2"))
"""Fault scenarios that may run at once (0: no limit)."""


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
    """Spread the slot takers evenly through the run: xdist hands each worker its first tests
    round-robin in this order, and a worker waiting for a slot runs nothing else meanwhile, so
    a run that began with every fault scenario in a row (tests/faults sorts early) kept half
    its workers waiting at the start and left the end to the rest. Each list keeps its order."""
    if getattr(config, "workerinput", None) is None:
        return
    _check_grouped(config, items)
    if SLOTS <= 0:
        return
    takers = [i for i in items if _takes_a_slot(i)]
    if not takers or len(takers) == len(items):
        return
    others = [i for i in items if not _takes_a_slot(i)]
    spread: list[pytest.Item] = []
    step = len(items) / len(takers)
    ahead = iter(others)
    for n, taker in enumerate(takers):
        while len(spread) < int(n * step):
            spread.append(next(ahead))
        spread.append(taker)
    spread.extend(ahead)
    items[:] = spread


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
