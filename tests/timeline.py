"""Where a run's wall time goes: `KEYEXPIRY_TEST_TIMELINE=<dir>` makes each xdist worker write
one JSON line per test (worker, test, start and end on the wall clock, seconds waited for a fault
slot) to <dir>/<worker>.jsonl. `make test` must stay under 12 minutes on 2 cores; the durations
pytest prints do not say which worker sat idle or waited, this does."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Generator
from pathlib import Path

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
