"""`async def` handlers in a real listener (Redis + SQLite/MariaDB): run once, retried, cancelled
at their timeout, many at once, `current()` inside."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from keyexpiry import Client, Settings, TaskRequest
from keyexpiry.bench.servers import wait_until
from keyexpiry.errors import ConfigError
from keyexpiry.ledger.store import TaskStatus
from keyexpiry.registry import Registry, exposed
from tests import async_tasks
from tests.ke import Running, wait_status

StartListener = Callable[[Settings], Running]


@pytest.fixture(autouse=True)
def _fresh_notes() -> Iterator[None]:
    async_tasks.reset()
    yield
    async_tasks.reset()


def test_an_async_handler_runs_once_and_is_recorded_done(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    running = start_listener(settings)
    key = client.create(async_tasks.AsyncProbe.record, "once", ttl_ms=50)
    row = wait_status(client, key, TaskStatus.DONE)
    assert row.attempts == 1 and row.last_error is None
    assert row.result == "once"  # kept as a sync handler's return value is
    assert async_tasks.CALLS[key] == 1
    assert running.listener.dispatcher.stats.claimed == 1
    assert running.listener.dispatcher.wait_idle(5)
    assert running.listener.dispatcher.inflight.coroutines == 0


def test_an_async_handler_that_raises_is_retried_on_its_schedule(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    start_listener(settings)
    key = client.create("AsyncProbe.fail_once", "flaky", ttl_ms=50)
    row = wait_status(client, key, TaskStatus.DONE)
    assert row.attempts == 2 and async_tasks.CALLS[key] == 2


def test_a_coroutine_past_its_timeout_is_cancelled_and_retried(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    running = start_listener(settings.replace(concurrency=1))
    key = client.create("AsyncProbe.hang_first", "slow", ttl_ms=50)
    row = wait_status(client, key, TaskStatus.DONE)
    assert row.attempts == 2 and async_tasks.CALLS[key] == 2
    # The coroutine itself saw the cancellation (a thread would have been abandoned instead).
    assert async_tasks.cancelled == [key]
    stats = running.listener.dispatcher.stats
    assert stats.timed_out == 1
    # No worker thread was replaced: a coroutine holds none.
    assert len(running.listener.dispatcher.executor.threads) == 1


def test_a_coroutine_that_swallows_its_cancellation_gives_up_its_slot_and_result(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    start_listener(settings.replace(async_concurrency=1))
    key = client.create("AsyncProbe.stubborn", "s", ttl_ms=20)
    row = wait_status(client, key, TaskStatus.DONE)
    assert row.attempts == 2
    wait_until(lambda: len(async_tasks.EVENTS) == 3, 5)
    when = dict(async_tasks.EVENTS)
    # The retry ran in the one slot while the first attempt was still going: the timed-out
    # coroutine no longer counted, and its late return changed nothing (the row stays done).
    assert when["start 2"] < when["end 1"]
    assert wait_status(client, key, TaskStatus.DONE).attempts == 2


def test_many_async_tasks_due_at_once_run_concurrently(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    # Two worker threads: run on them, 100 naps of 0.5 s would take 25 s (50 s one by one).
    start_listener(settings.replace(concurrency=2))
    keys = client.create_many(
        TaskRequest(async_tasks.AsyncProbe.nap, (i, 500), ttl_ms=300) for i in range(100)
    )
    wait_until(lambda: len(async_tasks.SPANS) == 100, 20, interval_s=0.01)
    first_start = min(s for s, _ in async_tasks.SPANS)
    last_end = max(e for _, e in async_tasks.SPANS)
    assert last_end - first_start < 5.0, f"took {last_end - first_start:.2f} s"
    assert async_tasks.peak >= 40
    for key in (keys[0], keys[-1]):
        wait_status(client, key, TaskStatus.DONE)


def test_async_concurrency_bounds_the_coroutines_in_flight(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    start_listener(settings.replace(async_concurrency=5))
    client.create_many(
        TaskRequest(async_tasks.AsyncProbe.nap, (i, 50), ttl_ms=100) for i in range(30)
    )
    wait_until(lambda: len(async_tasks.SPANS) == 30, 15, interval_s=0.01)
    assert async_tasks.peak == 5


def test_current_works_inside_a_coroutine_across_awaits_and_threads(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    start_listener(settings)
    keys = client.create_many(
        TaskRequest(async_tasks.AsyncProbe.context, (name,), ttl_ms=50) for name in "abc"
    )
    for key in keys:
        row = wait_status(client, key, TaskStatus.DONE)
        # Three coroutines interleaved on one loop: each saw its own run, before and after an
        # await, and in a thread it started.
        assert async_tasks.SEEN[key] == (key, key, key, 1, row.due_at_ms)


def test_stop_cancels_a_coroutine_still_running_and_leaves_it_to_its_lease(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    running = start_listener(settings.replace(shutdown_timeout_s=0.3))
    key = client.create("AsyncProbe.long", "stopped", ttl_ms=20)
    wait_until(lambda: async_tasks.CALLS[key] == 1, 5)
    started = time.monotonic()
    running.stop()
    assert time.monotonic() - started < 5
    assert async_tasks.cancelled == [key]
    row = client.store.get(key)
    # Not recorded as failed: as for a thread still running at shutdown, its lease decides.
    assert row is not None and row.status is TaskStatus.RUNNING and row.last_error is None


def test_stop_gives_back_runs_still_waiting_for_a_coroutine_slot(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    running = start_listener(settings.replace(async_concurrency=1, shutdown_timeout_s=0.3))
    first = client.create("AsyncProbe.long", "first", ttl_ms=20)
    wait_until(lambda: async_tasks.CALLS[first] == 1, 5)
    second = client.create("AsyncProbe.long", "second", ttl_ms=20)
    # Claimed, and waiting: the one slot is taken.
    wait_until(lambda: running.listener.dispatcher.stats.claimed == 2, 5)
    running.stop()
    assert async_tasks.CALLS[second] == 0
    row = client.store.get(second)
    # Released, not left to its lease: pending again, the attempt not counted.
    assert row is not None and row.status is TaskStatus.PENDING and row.attempts == 0


def test_a_plain_method_returning_a_coroutine_fails_with_a_clear_error(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    start_listener(settings)
    key = client.create("AsyncProbe.sync_returning_a_coroutine", "x", ttl_ms=20)
    row = wait_status(client, key, TaskStatus.DEAD)
    assert row.last_error is not None and "declare it `async def`" in row.last_error


def test_a_generator_method_is_refused_at_registration() -> None:
    class Gen:
        @exposed
        async def agen(self, name: str):  # type: ignore[no-untyped-def]
            yield name

    with pytest.raises(ConfigError, match="generator"):
        Registry().register(Gen)


def test_an_async_method_is_marked_async_in_its_spec() -> None:
    registry = Registry()

    class Mixed:
        @exposed
        async def later(self, name: str) -> None: ...

        @exposed
        def now(self, name: str) -> None: ...

    registry.register(Mixed)
    assert registry.resolve("Mixed", "later").is_async
    assert not registry.resolve("Mixed", "now").is_async
