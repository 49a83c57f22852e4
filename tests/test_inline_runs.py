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
    before = stats.claimed_inline
    for i in range(50):
        key = client.create("Probe.quick", f"{prefix}{i}", ttl_ms=0)
        wait_status(client, key, TaskStatus.DONE)
        assert running.listener.dispatcher.wait_idle(5)
        if stats.claimed_inline > before:
            assert THREADS[key] == CLAIMER
            return
    raise AssertionError(f"no lone quick run went to the claimer's thread: {THREADS}")


def _stall_the_claimer(client: Client, running: Running, name: str) -> tuple[str, str]:
    """A `Probe.quick` run blocked on its gate on the claimer's own thread: (its name, key).

    A lone run goes there while the method's runs average 1 ms or less and every worker is
    idle; on a loaded machine a slow run in between can lift the average, and the next run
    goes to a worker: that one is let go and another tried, after warming up again."""
    for i in range(5):
        _warm_up(client, running, f"{name}-warm{i}-")
        tried = f"{name}{i}"
        STALLS.add(tried)
        key = client.create("Probe.quick", tried, ttl_ms=0)
        assert entered(tried).wait(5)
        if THREADS[key] == CLAIMER:
            return tried, key
        STALLS.discard(tried)
        gate(tried).set()
        wait_status(client, key, TaskStatus.DONE)
        assert running.listener.dispatcher.wait_idle(5)
    raise AssertionError(f"no stalled run went to the claimer's thread in 5 tries: {THREADS}")


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
    name, slow = _stall_the_claimer(client, running, "slow")
    # Keys heard while it blocks are claimed by another thread at once, not after it.
    after = [client.create("Probe.record", f"after{i}", ttl_ms=0) for i in range(3)]
    for key in after:
        wait_status(client, key, TaskStatus.DONE, timeout_s=3)
    assert not gate(name).is_set() and stats.claim_hand_offs == 1
    assert client.store.get(slow).status is TaskStatus.RUNNING  # type: ignore[union-attr]
    gate(name).set()
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
    workers = len(dispatcher.executor.threads)
    name, hung = _stall_the_claimer(client, running, "hung")
    STALLS.discard(name)  # its retry returns at once (this run blocks on its gate)
    # Nothing else is heard: the watchdog alone sees the claimer away, then the timeout (3 s).
    wait_until(lambda: dispatcher.stats.timed_out == 1, 10)
    assert dispatcher.stats.claim_hand_offs == 1
    # Its retry runs on another thread (the hung one is abandoned) while the first still hangs.
    row = wait_status(client, hung, TaskStatus.DONE)
    assert row.attempts == 2 and not gate(name).is_set()
    # A worker was not what hung: the pool is not grown to replace one.
    assert len(dispatcher.executor.threads) == workers
    gate(name).set()
    wait_until(lambda: _claimers() == 1, 5, message=f"{_claimers()} claimer threads")
    assert dispatcher.wait_idle(5)


def test_a_handler_raising_on_the_claimers_thread_is_retried_and_claims_go_on(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    running = start_listener(settings)
    dispatcher = running.listener.dispatcher
    # The test must make the claimer's own thread meet the exception: tried until a run that
    # raises went there (`_stall_the_claimer` says why one may not).
    for tries in range(1, 6):
        _warm_up(client, running, f"warm{tries}-")
        RAISES.add(f"raises{tries}")
        key = client.create("Probe.quick", f"raises{tries}", ttl_ms=0)
        row = wait_status(client, key, TaskStatus.DONE)
        if RAISED_ON[key] == CLAIMER:
            break
    else:
        raise AssertionError(f"no raising run went to the claimer's thread: {RAISED_ON}")
    assert row.attempts == 2 and sample_tasks.CALLS[key] == 2
    assert dispatcher.stats.retried == tries
    # A handler's exception is its run's outcome, not an error around the run: no claiming
    # thread died, one claims (a run that took long there, its traceback formatted on a loaded
    # machine while its retry's key came, may have handed the claims to another), and claims go
    # on.
    assert dispatcher.thread_errors.count == 0, dispatcher.thread_errors.by_thread
    wait_until(lambda: _claimers() == 1, 5, message=f"{_claimers()} claimer threads")
    after = client.create("Probe.record", "after", ttl_ms=0)
    wait_status(client, after, TaskStatus.DONE)
