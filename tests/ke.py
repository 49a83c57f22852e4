"""Fixtures and helpers for tests that run keyexpiry against real servers."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from loguru import logger

from keyexpiry import Client, Listener, Settings
from keyexpiry.bench.servers import wait_until
from keyexpiry.ledger.store import Store, TaskRow, TaskStatus, make_engine
from keyexpiry.log import _format
from keyexpiry.registry import Registry
from tests import flow_tasks, sample_tasks

FAST = {
    "retry_schedule_s": (0.05, 0.05),
    "sentinel_count": 0,
    "reconnect_initial_s": 0.05,
    "reconnect_max_s": 0.5,
    "shutdown_timeout_s": 5.0,
    "lease_grace_s": 1.0,
    "handler_timeout_s": 10.0,
    "health_check_interval_s": 1.0,
    "canary_interval_s": 0.5,
    "lease_check_s": 0.3,
    "stuck_after_s": 0.5,
}
"""Short retries, leases and backoffs, so no test waits long."""


def live_connections(pool: Any) -> int:
    """Open sockets of a redis-py pool, idle or in use."""
    conns = [*pool._available_connections, *pool._in_use_connections]
    return sum(1 for c in conns if getattr(c, "_sock", None) is not None)


def make_settings(redis_url: str, db_url: str, tmp: Path, **overrides: Any) -> Settings:
    """Settings for a test: real server URLs and fast timings."""
    values: dict[str, Any] = {**FAST, **overrides}
    return Settings(redis_url=redis_url, database_url=db_url, state_dir=tmp / "state", **values)


class Running:
    """A listener running on a background thread, stopped at teardown."""

    def __init__(self, settings: Settings, registry: Registry | None = None) -> None:
        self.listener = Listener(settings, registry)
        self.thread = threading.Thread(target=self.listener.run, daemon=True)
        self.thread.start()
        try:
            # 30 s: a start-up reconciliation over a test's 60,000 rows on a Cluster took over
            # 15 s twice on a slow machine (the waits end as soon as the listener is ready).
            if not self.listener.subscribed.wait(30):
                raise AssertionError("listener did not subscribe within 30 s")
            assert self.listener.wait_reconciled(30), "start-up reconciliation did not finish"
            # Done beside the subscription: waited for, so a test starts on a settled listener.
            assert self.listener.warmed.wait(30), "the warm-up did not finish"
        except BaseException:
            # Not handed to the fixture that stops it: left running, its threads would log
            # their retries against servers the test tears down for the rest of the worker's
            # run (a CI run drowned in them, its failure report lost with it).
            self.listener.stop()
            self.thread.join(timeout=30)
            raise

    def stop(self) -> None:
        self.listener.stop()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "listener did not stop"


@pytest.fixture
def log_lines() -> Iterator[list[str]]:
    """Every line keyexpiry logs at INFO and above during the test, formatted as users see it."""
    lines: list[str] = []
    sink = logger.add(lines.append, level="INFO", format=_format, colorize=False)
    yield lines
    logger.remove(sink)


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    """A ledger (SQLite and MariaDB) with its tables, without Redis."""
    s = Store(make_engine(db_url))
    s.create_schema()
    yield s
    s.engine.dispose()


@pytest.fixture
def settings(redis_url: str, db_url: str, tmp_path: Path) -> Settings:
    """Fast settings on the session Redis and a fresh ledger (SQLite and MariaDB)."""
    return make_settings(redis_url, db_url, tmp_path)


@pytest.fixture
def cli_env(redis_url: str, sqlite_url: str, tmp_path: Path) -> dict[str, str]:
    """Environment for a `keyexpiry` command on the session Redis and a fresh SQLite ledger."""
    return {
        "KEYEXPIRY_REDIS_URL": redis_url,
        "KEYEXPIRY_DATABASE_URL": sqlite_url,
        "KEYEXPIRY_STATE_DIR": str(tmp_path / "state"),
        "KEYEXPIRY_TASKS": "tests.sample_tasks",
        "KEYEXPIRY_SENTINEL_COUNT": "0",
    }


@pytest.fixture
def client(settings: Settings) -> Iterator[Client]:
    """A client on `settings`, closed at teardown."""
    sample_tasks.reset()
    c = Client(settings)
    yield c
    sample_tasks.reset()
    c.close()


@pytest.fixture
def sampling(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Handlers of `tests.flow_tasks` and `tests.schedule_tasks` sample themselves in the
    session Redis (runs in any listener process counted together)."""
    monkeypatch.setenv(flow_tasks.SAMPLE_REDIS_ENV, redis_url)
    flow_tasks.reset()
    yield
    flow_tasks.reset()


@pytest.fixture
def start_listener() -> Iterator[Callable[..., Running]]:
    """Start listeners on demand (`start_listener(settings)`, or with a registry of their
    own); all are stopped at teardown."""
    started: list[Running] = []

    def start(settings: Settings, registry: Registry | None = None) -> Running:
        running = Running(settings, registry)
        started.append(running)
        return running

    yield start
    sample_tasks.reset()
    failed: list[AssertionError] = []
    for running in started:
        try:
            running.stop()
        except AssertionError as exc:  # the others are stopped all the same
            failed.append(exc)
    if failed:
        raise failed[0]


def wait_status(client: Client, key: str, status: TaskStatus, timeout_s: float = 10.0) -> TaskRow:
    """Wait on a deadline until `key`'s row has `status`; return the row."""
    found: list[TaskRow] = []

    def ready() -> bool:
        row = client.store.get(key)
        if row is not None and row.status is status:
            found.append(row)
            return True
        return False

    # wait_until's own interval: 5 ms at first, then backing off to 25 ms, so a long wait does
    # not load the ledger the listener under test writes to.
    wait_until(
        ready,
        timeout_s,
        message=f"{key} never became {status}: {client.store.get(key)}",
    )
    return found[-1]


def see_raw_outcomes(store: Store, seen: Callable[[str, Any], None]) -> None:
    """Call `seen(statement, params)` for each statement the store sends through
    `_autocommitted_each` (PostgreSQL's outcomes: straight to psycopg, no cursor event)."""
    each = store._autocommitted_each

    def autocommitted_each(sql: str, params_list: Any) -> int:
        for params in params_list:
            seen(sql, params)
        return each(sql, params_list)

    store._autocommitted_each = autocommitted_each  # type: ignore[method-assign]
