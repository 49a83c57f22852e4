"""A listener opens its ledger connections and compiles its claim statements before the first
event: neither may happen while due tasks wait (each was a 10-90 ms stall of the first wave)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from keyexpiry import Client, TaskRequest
from keyexpiry.bench.servers import wait_until
from keyexpiry.ledger.base import Prepared
from keyexpiry.ledger.store import TaskStatus
from tests import sample_tasks
from tests.ke import Running, make_settings


def test_the_first_wave_opens_no_connection_and_compiles_no_claim(
    redis_url: str,
    server_db_url: str,
    tmp_path: Path,
    start_listener: Callable[..., Running],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compiled: list[str] = []
    real_compile = Prepared.compile

    def counting(statement: Any, dialect: Any) -> Prepared:
        compiled.append(str(statement).split(None, 1)[0])
        return real_compile(statement, dialect)

    monkeypatch.setattr(Prepared, "compile", staticmethod(counting))
    settings = make_settings(redis_url, server_db_url, tmp_path, claim_batch=64)
    running = start_listener(settings)
    assert running.listener.warmed.wait(15), "no warm-up"  # done beside the subscription
    engine = running.listener.store.engine
    assert engine.pool.checkedin() + engine.pool.checkedout() >= 8  # type: ignore[attr-defined]
    opened: list[str] = []
    invalidated: list[str] = []

    def connected(_conn: Any, _record: Any) -> None:
        if not invalidated:
            opened.append(threading.current_thread().name)

    def lost(_conn: Any, _record: Any, exc: BaseException | None) -> None:
        invalidated.append(f"{threading.current_thread().name}: {exc!r}")

    # A connection the server dropped is replaced (and SQLAlchemy replaces the pool's older ones
    # with it): no warm-up avoids that, so connections opened after it are not counted.
    event.listen(engine, "connect", connected)
    event.listen(engine, "invalidate", lost)
    compiled.clear()
    sample_tasks.reset()
    with Client(settings) as client:
        keys = client.create_many(
            TaskRequest("Probe.record", (f"w{i}",), ttl_ms=300 + i % 50) for i in range(200)
        )

        def all_done() -> bool:
            rows = [client.store.get(k) for k in keys]
            return all(r is not None and r.status is TaskStatus.DONE for r in rows)

        wait_until(all_done, 20)
    assert opened == [], f"ledger connections opened while tasks were due, by {opened}"
    if invalidated:
        print(f"pool invalidated during the wave: {invalidated}")
    claim_or_record = [c for c in compiled if c in ("UPDATE", "SELECT")]
    assert claim_or_record == [], f"statements compiled while tasks were due: {compiled}"
    assert {k: sample_tasks.CALLS[k] for k in keys} == dict.fromkeys(keys, 1)
