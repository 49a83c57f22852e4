"""Fixtures of the fault suite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.spawn import Spawned


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawned]:
    """Start listener subprocesses; they are stopped (or killed) at teardown."""
    spawned = Spawned(tmp_path)
    yield spawned
    spawned.stop_all()
