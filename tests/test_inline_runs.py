"""A lone short run is run by the claimer's own thread (`keyexpiry.runner.claimer`), against a
real Redis and ledger: one thread crossing fewer for a task due now, and a handler that is slow
or hangs there still holds no claim."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from keyexpiry import Client, Settings
from keyexpiry.bench.servers import wait_until
from keyexpiry.ledger.store import TaskStatus
from tests import sample_tasks
from tests.ke import Running, wait_status
from tests.sample_tasks import RAISED_ON, RAISES, STALLS, THREADS, entered, gate

StartListener = Callable[[Settings], Running]
CLAIMER = "keyexpiry-claimer"


@pytest.fixture(autouse=True)
def _fresh_notes() -> Iterator[None]:
    sample_tasks.reset()
    yield
    sample_tasks.reset()


def _claimers() -> int:
    return sum(1 for t in threading.enumerate() if t.name == CLAIMER)


def _warm_up(client: Client, running: Running, prefix: str) -> None:
    """Run `Probe.quick` one task at a time until one ran on the claimer's thread: its first
    runs (no run time measured yet) go to the workers."""
    stats = running.listener.dispatcher.stats
    for i in range(50):
        key = client.create("Probe.quick", f"{prefix}{i}", ttl_ms=0)
        wait_status(client, key, TaskStatus.DONE)
        assert running.listener.dispatcher.wait_idle(5)
        if stats.claimed_inline:
            assert THREADS[key] == CLAIMER
            return
    raise AssertionError(f"no lone quick run went to the claimer's thread: {THREADS}")


def test_lone_short_runs_are_run_by_the_claimer_and_the_first_by_a_worker(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    running = start_listener(settings)
    stats = running.listener.dispatcher.stats
    keys: list[str] = []
    # One at a time, until five ran on the claimer: how soon depends on how slow the first
    # (cold) runs were, which a loaded machine decides.
    while sum(THREADS.get(k) == CLAIMER for k in keys) < 5:
        assert len(keys) < 60, THREADS
        keys.append(client.create("Probe.quick", f"lone{len(keys)}", ttl_ms=0))
        wait_status(client, keys[-1], TaskStatus.DONE)
        assert running.listener.dispatcher.wait_idle(5)
    # Nothing is known of the method's run time before its first run: a worker runs it.
    assert THREADS[keys[0]].startswith("keyexpiry-worker"), THREADS
    assert stats.claimed_inline == sum(THREADS[k] == CLAIMER for k in keys)
    rows = [client.store.get(k) for k in keys]
    assert all(r is not None and r.attempts == 1 for r in rows)


def test_a_slow_run_on_the_claimers_thread_hands_the_claims_to_another(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    running = start_listener(settings)
    stats = running.listener.dispatcher.stats
    _warm_up(client, running, "warm")
    STALLS.add("slow")
    slow = client.create("Probe.quick", "slow", ttl_ms=0)
    assert entered("slow").wait(5)
    assert THREADS[slow] == CLAIMER  # the test must stall the claimer's own thread
    # Keys heard while it blocks are claimed by another thread at once, not after it.
    after = [client.create("Probe.record", f"after{i}", ttl_ms=0) for i in range(3)]
    for key in after:
        wait_status(client, key, TaskStatus.DONE, timeout_s=3)
    assert not gate("slow").is_set() and stats.claim_hand_offs == 1
    assert client.store.get(slow).status is TaskStatus.RUNNING  # type: ignore[union-attr]
    gate("slow").set()
    row = wait_status(client, slow, TaskStatus.DONE)
    assert row.attempts == 1
    # The old claiming thread ended with its run: one claims, and claims go on.
    wait_until(lambda: _claimers() == 1, 5, message=f"{_claimers()} claimer threads")
    more = client.create("Probe.record", "more", ttl_ms=0)
    wait_status(client, more, TaskStatus.DONE)
    # The old thread's loop started again by its supervisor (after an error) claims nothing:
    # its generation is gone, and it returns at once.
    claimer = running.listener.dispatcher.claimer
    assert claimer.generation == 1
    claimer.loop(0)


def test_a_run_hung_on_the_claimers_thread_fails_at_its_timeout_and_the_pool_keeps_its_size(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    running = start_listener(settings)
    dispatcher = running.listener.dispatcher
    _warm_up(client, running, "warm")
    workers = len(dispatcher.executor.threads)
    STALLS.add("hung")
    hung = client.create("Probe.quick", "hung", ttl_ms=0)
    assert entered("hung").wait(5)
    STALLS.discard("hung")  # its retry returns at once (this run blocks on its gate)
    assert THREADS[hung] == CLAIMER
    # Nothing else is heard: the watchdog alone sees the claimer away, then the timeout (3 s).
    wait_until(lambda: dispatcher.stats.timed_out == 1, 10)
    assert dispatcher.stats.claim_hand_offs == 1
    # Its retry runs on another thread (the hung one is abandoned) while the first still hangs.
    row = wait_status(client, hung, TaskStatus.DONE)
    assert row.attempts == 2 and not gate("hung").is_set()
    # A worker was not what hung: the pool is not grown to replace one.
    assert len(dispatcher.executor.threads) == workers
    gate("hung").set()
    wait_until(lambda: _claimers() == 1, 5, message=f"{_claimers()} claimer threads")
    assert dispatcher.wait_idle(5)


def test_a_handler_raising_on_the_claimers_thread_is_retried_and_claims_go_on(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    running = start_listener(settings)
    dispatcher = running.listener.dispatcher
    _warm_up(client, running, "warm")
    RAISES.add("raises")
    key = client.create("Probe.quick", "raises", ttl_ms=0)
    row = wait_status(client, key, TaskStatus.DONE)
    # The test must make the claimer's own thread meet the exception.
    assert RAISED_ON[key] == CLAIMER
    assert row.attempts == 2 and sample_tasks.CALLS[key] == 2
    assert dispatcher.stats.retried == 1 and dispatcher.stats.claim_hand_offs == 0
    # A handler's exception is its run's outcome, not an error around the run: the claiming
    # thread neither died nor was replaced, and claims go on.
    assert dispatcher.thread_errors.count == 0, dispatcher.thread_errors.by_thread
    assert _claimers() == 1
    after = client.create("Probe.record", "after", ttl_ms=0)
    wait_status(client, after, TaskStatus.DONE)
