"""`@exposed(transactional=True)`: a handler's writes through `current().tx` commit together with
its task's `done`, or roll back with a failure, a timeout or a lost claim (SQLite and MariaDB)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import insert, select, update

from keyexpiry import Client, Settings
from keyexpiry.bench.servers import wait_until
from keyexpiry.errors import ConfigError
from keyexpiry.ledger.store import T, TaskStatus
from keyexpiry.registry import exposed
from tests import sample_tasks
from tests.ke import Running, make_settings, wait_status

StartListener = Callable[[Settings], Running]
Ledgered = sample_tasks.Ledgered
Notes = Callable[[], list[tuple[str, int]]]


@pytest.fixture
def notes(client: Client) -> Notes:
    """The business table, created in the ledger's database; returns its rows."""
    sample_tasks.business.create_all(client.store.engine)

    def rows() -> list[tuple[str, int]]:
        with client.store.engine.connect() as conn:
            got = conn.execute(select(sample_tasks.NOTES).order_by("attempt")).all()
        return [(str(name), int(attempt)) for name, attempt in got]

    return rows


def test_success_commits_the_business_write_with_done_and_the_result(
    settings: Settings, client: Client, start_listener: StartListener, notes: Notes
) -> None:
    start_listener(settings)
    key = client.create(Ledgered.note, "ok", ttl_ms=20)
    row = wait_status(client, key, TaskStatus.DONE)
    assert notes() == [("ok", 1)]
    assert row.attempts == 1 and row.result == 1 and row.last_error is None
    assert row.lease_until_ms is None and row.finished_at_ms is not None


def test_an_exception_rolls_the_write_back_and_retries_per_schedule(
    settings: Settings, client: Client, start_listener: StartListener, notes: Notes
) -> None:
    sample_tasks.FAIL_FIRST.add("flaky")
    start_listener(settings)
    key = client.create(Ledgered.note, "flaky", ttl_ms=20)
    row = wait_status(client, key, TaskStatus.DONE)
    # The first attempt's write went with its failure; only the second one's is there.
    assert notes() == [("flaky", 2)]
    assert row.attempts == 2 and row.result == 2 and sample_tasks.CALLS[key] == 2


def test_a_run_past_its_timeout_is_rolled_back_even_when_it_returns_later(
    settings: Settings, client: Client, start_listener: StartListener, notes: Notes
) -> None:
    running = start_listener(settings)
    key = client.create(Ledgered.slow_first, "late", ttl_ms=20)
    assert sample_tasks.entered("late").wait(10)
    stats = running.listener.dispatcher.stats
    wait_until(lambda: stats.timed_out >= 1, 10, interval_s=0.01, message="no timeout")
    sample_tasks.gate("late").set()  # attempt 1 returns now, after its timeout
    row = wait_status(client, key, TaskStatus.DONE)
    executor = running.listener.dispatcher.executor
    concurrency = settings.concurrency

    # The abandoned worker retires once its run has returned and rolled back.
    def retired() -> bool:
        return sum(t.is_alive() for t in executor.threads) == concurrency

    wait_until(retired, 10, interval_s=0.01, message="the late run never returned")
    assert notes() == [("late", 2)]
    assert row.attempts == 2 and row.result == 2 and sample_tasks.CALLS[key] == 2


@pytest.mark.parametrize("how", ["rescheduled", "taken over"])
def test_a_lost_claim_rolls_the_write_back(
    how: str,
    settings: Settings,
    client: Client,
    start_listener: StartListener,
    notes: Notes,
) -> None:
    running = start_listener(settings)
    key = client.create(Ledgered.held, how, ttl_ms=20)
    assert sample_tasks.entered(how).wait(10)
    if how == "rescheduled":
        client.create(Ledgered.held, how, ttl_s=60)  # the row is pending again, for later
    else:
        # What a peer's takeover writes: the row runs under another claim now.
        with client.store.engine.begin() as conn:
            conn.execute(update(T).where(T.c.task_key == key).values(claimed_by="peer:1:x:1"))
    stats = running.listener.dispatcher.stats
    sample_tasks.gate(how).set()
    wait_until(lambda: stats.claims_lost >= 1, 10, interval_s=0.01, message="claim not lost")
    assert notes() == []
    row = client.store.get(key)
    assert row is not None and row.result is None
    if how == "rescheduled":
        assert row.status is TaskStatus.PENDING and row.attempts == 0
    else:
        assert row.status is TaskStatus.RUNNING and row.claimed_by == "peer:1:x:1"
    assert sample_tasks.CALLS[key] == 1


def test_on_a_server_a_hung_handlers_locks_go_with_its_timeout(
    redis_url: str, server_db_url: str, tmp_path: Path, start_listener: StartListener
) -> None:
    # SQLite has no session to end: there the hung handler's transaction ends when it returns
    # (the timeout test above).
    settings = make_settings(redis_url, server_db_url, tmp_path)
    counters = sample_tasks.COUNTERS
    with Client(settings) as client:
        sample_tasks.business.create_all(client.store.engine)
        with client.store.engine.begin() as conn:
            conn.execute(insert(counters).values(name="c", n=0))

        def count() -> int:
            with client.store.engine.connect() as conn:
                return int(conn.execute(select(counters.c.n)).scalar_one())

        running = start_listener(settings)
        key = client.create(Ledgered.hang_locked, "c", ttl_ms=20)
        assert sample_tasks.entered("c").wait(10)
        # The retry takes the row lock the hung first attempt held: its session was killed at
        # its timeout, its increment rolled back. (Without that the retry waits out the lock
        # wait timeout, fails, and the task dies.)
        row = wait_status(client, key, TaskStatus.DONE, timeout_s=4)
        assert row.attempts == 2 and row.result == 2 and count() == 1
        sample_tasks.gate("c").set()
        executor = running.listener.dispatcher.executor

        def retired() -> bool:
            return sum(t.is_alive() for t in executor.threads) == settings.concurrency

        wait_until(retired, 10, interval_s=0.01, message="the hung run never returned")
        assert count() == 1 and sample_tasks.CALLS[key] == 2


def test_a_handler_that_ends_the_transaction_itself_is_dead(
    settings: Settings, client: Client, start_listener: StartListener, notes: Notes
) -> None:
    start_listener(settings)
    key = client.create(Ledgered.commits_itself, "x", ttl_ms=20)
    row = wait_status(client, key, TaskStatus.DEAD)
    assert row.last_error is not None and "ended current().tx itself" in row.last_error
    assert sample_tasks.CALLS[key] == 1


def test_transactional_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="transactional must be True or False"):
        exposed(transactional="yes")  # type: ignore[call-overload]


def test_an_async_transactional_handler_is_refused_at_registration() -> None:
    from keyexpiry.registry import Registry

    class Hooks:
        @exposed(transactional=True)
        async def note(self, name: str) -> None: ...

    with pytest.raises(ConfigError, match=r"transactional=True.*not `async def`"):
        Registry().register(Hooks)


def test_tx_outside_a_transactional_handler_says_so(client: Client) -> None:
    from keyexpiry.context import TaskContext

    ctx = TaskContext("k", 1, 0, client.store.engine)
    with pytest.raises(RuntimeError, match="transactional=True"):
        _ = ctx.tx
