"""The soak producer's retries: what it tells the verdict when a create or reschedule failed.

Pure harness logic: a stand-in client answers as keyexpiry's does (the calls' real behaviour is
tested against real servers elsewhere); what is checked is that the producer never re-creates
a task the ledger already recorded, and flags a retry that may have run a task twice.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from keyexpiry.bench import soak
from keyexpiry.bench.soak_tasks import Soak
from keyexpiry.errors import RedisUnavailableError, StoreError


@dataclass
class _Row:
    due_at_ms: int


@dataclass
class _Store:
    rows: dict[str, _Row] = field(default_factory=dict)

    def get_many(self, keys: list[str]) -> dict[str, _Row]:
        return {k: self.rows[k] for k in keys if k in self.rows}


@dataclass
class _Client:
    """Records a create in `store`, then raises the next of `failures` (after it, if it says
    the create was recorded)."""

    failures: list[BaseException] = field(default_factory=list)
    store: _Store = field(default_factory=_Store)
    creates: int = 0

    def key_for(self, target: Any, *args: Any) -> str:
        return "Soak@run@" + "@".join(map(str, args))

    def create(self, target: Any, *args: Any, ttl_ms: int) -> _Row:
        self.creates += 1
        failure = self.failures.pop(0) if self.failures else None
        if isinstance(failure, StoreError) and not failure.maybe_applied:
            raise failure
        row = _Row(int(time.time() * 1000) + ttl_ms)
        self.store.rows[self.key_for(target, *args)] = row
        if failure is not None:
            raise failure
        return row


@pytest.fixture
def out(tmp_path: Path) -> Iterator[soak._Lines]:
    lines = soak._Lines(tmp_path / "produced.jsonl")
    yield lines
    lines.close()


def _producer(out: soak._Lines, client: _Client, due_in_ms: int = 60_000) -> soak.Producer:
    cfg = soak.SoakConfig(min_due_s=1.0, max_due_s=2.0)
    producer = soak.Producer(client, cfg, out, stop_at=time.monotonic() + 60)  # type: ignore[arg-type]
    producer._recent.append(soak._Recent(7, int(time.time() * 1000) + due_in_ms, None))
    return producer


def _lines(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (tmp_path / "produced.jsonl").read_text().splitlines()]


def test_a_reschedule_recorded_without_its_key_is_read_back_not_created_again(
    tmp_path: Path, out: soak._Lines
) -> None:
    client = _Client([RedisUnavailableError("key not set")])
    producer = _producer(out, client)
    before_ms = int(time.time() * 1000)
    producer._reschedule()
    assert client.creates == 1  # a second create could re-create a task that ran meanwhile
    (line,) = _lines(tmp_path)
    assert line["op"] == "reschedule" and line["i"] == 7
    assert line["due_ms"] == client.store.rows[client.key_for(Soak.run, 7)].due_at_ms
    assert before_ms <= line["t_ms"] <= before_ms + 1000  # when the due changed: the call
    assert "ambiguous" not in line


def test_a_reschedule_retried_after_a_lost_answer_is_flagged(
    tmp_path: Path, out: soak._Lines
) -> None:
    lost = StoreError("answer lost")
    lost.maybe_applied = True
    client = _Client([lost])
    producer = _producer(out, client)
    producer._reschedule()
    assert client.creates == 2
    (line,) = _lines(tmp_path)
    assert line["ambiguous"] is True


def test_a_reschedule_refused_before_the_old_due_is_not_flagged(
    tmp_path: Path, out: soak._Lines
) -> None:
    client = _Client([StoreError("refused")])
    producer = _producer(out, client)
    producer._reschedule()
    assert client.creates == 2
    (line,) = _lines(tmp_path)
    assert "ambiguous" not in line


def test_a_reschedule_retried_past_the_old_due_is_flagged(tmp_path: Path, out: soak._Lines) -> None:
    # Refused until the old due passed: the task ran at it, and the retry creates it again.
    client = _Client([StoreError("refused")])
    producer = _producer(out, client, due_in_ms=100)
    producer.MARGIN_MS = 0  # let it pick a task due within the retry's 200 ms pause
    producer._reschedule()
    assert client.creates == 2
    (line,) = _lines(tmp_path)
    assert line["ambiguous"] is True


def test_a_soak_stopped_by_sigterm_unwinds_as_on_ctrl_c() -> None:
    # `Soak.run` runs inside it: its `finally` blocks stop the listeners and the servers. With
    # SIGTERM's default action the process ended at once and they ran on.
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), soak.sigterm_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the handler runs between this thread's bytecodes
            time.sleep(0.01)
    assert signal.getsignal(signal.SIGTERM) is before
