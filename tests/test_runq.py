"""The run queue wakes idle workers as the waiting runs need them (pure threading, no servers)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from keyexpiry.runner.runq import RunQueue, Worker

DEADLINE_S = 10.0


@dataclass(eq=False)
class Job:
    """Stands in for a claimed run: what the worker does with it."""

    name: str
    hold: threading.Event | None = None
    """The worker waits for this before it is done with the job (a handler that blocks)."""
    nap_s: float = 0.0
    """The worker sleeps this long in the job (a handler waiting on I/O)."""
    spin_s: float = 0.0
    """The worker computes this long in the job (a handler holding the GIL)."""
    taken_by: int | None = None
    taken_s: float | None = None
    done_s: float = float("inf")
    done: threading.Event = field(default_factory=threading.Event)


class Pool:
    """`n` worker threads taking jobs from `q` until it closes."""

    def __init__(self, q: RunQueue[Job], n: int) -> None:
        self.q = q
        self.workers: dict[int, Worker] = {}
        self.taken: list[Job] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(n)]
        for t in self.threads:
            t.start()

    def _loop(self, i: int) -> None:
        me = self.workers[i] = Worker()
        while (job := self.q.get(me)) is not None:
            job.taken_by, job.taken_s = i, time.monotonic()
            with self.lock:
                self.taken.append(job)
            if job.hold is not None:
                job.hold.wait(DEADLINE_S)
            if job.nap_s:
                time.sleep(job.nap_s)
            if job.spin_s:
                until = time.monotonic() + job.spin_s
                while time.monotonic() < until:
                    pass
            job.done_s = time.monotonic()
            job.done.set()

    def put(self, *jobs: Job) -> None:
        self.q.put(jobs)

    def close(self) -> None:
        self.q.close()
        for t in self.threads:
            t.join(DEADLINE_S)
        assert not any(t.is_alive() for t in self.threads)


@contextmanager
def pool(ramp_ms: float, n: int = 4, **kw: Any) -> Iterator[Pool]:
    p = Pool(RunQueue[Job](ramp_ms / 1000, **kw), n)
    try:
        yield p
    finally:
        p.close()


def wait_for(cond: Callable[[], Any], timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def backlog_workers(p: Pool, alone: int, backlog: int, **job: Any) -> int:
    """Run `alone` jobs one at a time (the queue learns their share on CPU), then `backlog` at
    once: how many workers ran the backlog."""
    for i in range(alone):
        warm = Job(f"warm{i}", **job)
        p.put(warm)
        assert warm.done.wait(DEADLINE_S)
    jobs = [Job(f"j{i}", **job) for i in range(backlog)]
    p.put(*jobs)
    wait_for(lambda: all(j.done.is_set() for j in jobs))
    return len({j.taken_by for j in jobs})


def test_a_run_given_to_an_idle_pool_wakes_one_worker_at_once() -> None:
    with pool(ramp_ms=1000) as p:
        job = Job("a")
        p.put(job)
        assert job.done.wait(DEADLINE_S)
        assert p.q.wakes == 1


def test_a_batch_of_quick_runs_is_run_in_order_without_waking_the_pool() -> None:
    with pool(ramp_ms=1000, n=8) as p:
        first = Job("first", hold=threading.Event())
        rest = [Job(f"r{i}") for i in range(200)]
        p.put(first, *rest)
        wait_for(lambda: first.taken_by is not None)
        first.hold.set()  # type: ignore[union-attr]
        wait_for(lambda: all(j.done.is_set() for j in rest))
        # Behind one active worker making progress, nobody else was woken to run them (a
        # sentry watches the deadline but runs nothing before it).
        assert p.q.wakes == 1
        assert [j.name for j in p.taken] == ["first"] + [j.name for j in rest]
        assert {j.taken_by for j in rest} == {first.taken_by}


def test_a_run_behind_a_stuck_worker_is_started_by_another_within_the_ramp() -> None:
    with pool(ramp_ms=20) as p:
        stuck = Job("stuck", hold=threading.Event())
        p.put(stuck)
        wait_for(lambda: stuck.taken_by is not None)
        behind = Job("behind")
        put_s = time.monotonic()
        p.put(behind)
        assert behind.done.wait(DEADLINE_S)
        assert not stuck.done.is_set()
        assert behind.taken_by != stuck.taken_by
        assert behind.taken_s is not None and behind.taken_s - put_s >= 0.015
        stuck.hold.set()  # type: ignore[union-attr]


def test_runs_that_wait_on_io_get_more_workers_as_they_queue_up() -> None:
    with pool(ramp_ms=5, n=4) as p:
        # Teach the queue that runs mostly wait: a few alone first.
        workers = backlog_workers(p, 20, 200, nap_s=0.002)
        assert workers == 4


def test_slow_handlers_wake_a_worker_per_run() -> None:
    with pool(ramp_ms=5, n=4) as p:
        warm = Job("warm", nap_s=0.01)  # typical run longer than the ramp
        p.put(warm)
        assert warm.done.wait(DEADLINE_S)
        holds = [Job(f"h{i}", hold=threading.Event()) for i in range(4)]
        p.put(*holds)
        wait_for(lambda: all(j.taken_by is not None for j in holds))
        assert len({j.taken_by for j in holds}) == 4
        for j in holds:
            j.hold.set()  # type: ignore[union-attr]


def test_ramp_zero_wakes_a_worker_per_run() -> None:
    with pool(ramp_ms=0, n=4) as p:
        holds = [Job(f"h{i}", hold=threading.Event()) for i in range(4)]
        p.put(*holds)
        wait_for(lambda: all(j.taken_by is not None for j in holds))
        assert p.q.wakes == 4
        for j in holds:
            j.hold.set()  # type: ignore[union-attr]


def test_close_ends_sleeping_workers_and_drain_returns_the_waiting_runs() -> None:
    q = RunQueue[Job](1.0)
    p = Pool(q, 3)
    stuck = Job("stuck", hold=threading.Event())
    p.put(stuck)
    wait_for(lambda: stuck.taken_by is not None)
    waiting = [Job("w1"), Job("w2")]
    p.put(*waiting)  # behind the stuck worker; the ramp (1 s) is far off
    assert [r.name for r in q.drain()] == ["w1", "w2"]
    assert len(q) == 0
    q.close()
    stuck.hold.set()  # type: ignore[union-attr]
    p.close()
    assert not any(j.done.is_set() for j in waiting)


def test_a_lost_worker_no_longer_holds_runs_back() -> None:
    with pool(ramp_ms=1000, n=3) as p:
        hung = Job("hung", hold=threading.Event())
        p.put(hung)
        wait_for(lambda: hung.taken_by is not None)
        assert hung.taken_by is not None
        p.q.lost(p.workers[hung.taken_by])  # the watchdog abandoned it
        nxt = Job("next")
        p.put(nxt)
        # At once, not after the 1 s ramp: no worker counts as active.
        assert nxt.done.wait(0.5)
        hung.hold.set()  # type: ignore[union-attr]
        assert hung.done.wait(DEADLINE_S)
        # Its thread came back after all: it is not counted out twice.
        assert p.q.active() == 0 or wait_for(lambda: p.q.active() == 0) is None


def test_runs_that_compute_are_run_by_two_workers_not_the_pool() -> None:
    # Their CPU time read off the clock: all on CPU, even on a machine busy with other work.
    with pool(ramp_ms=50, n=6, thread_cpu_s=time.monotonic) as p:
        workers = backlog_workers(p, 10, 300, spin_s=0.001)  # the queue learns: all CPU
        # One at once, a second after a ramp; more would only share the GIL.
        assert workers == 2


def test_a_worker_is_lost_for_the_run_it_hung_on_not_for_the_one_after() -> None:
    with pool(ramp_ms=1000, n=2) as p:
        first = Job("first")
        p.put(first)
        assert first.done.wait(DEADLINE_S)
        second = Job("second", hold=threading.Event())
        p.put(second)
        wait_for(lambda: second.taken_by is not None)
        assert second.taken_by == first.taken_by  # the last worker to go idle is woken first
        worker = p.workers[first.taken_by]
        # The watchdog gave up on `first` late, after its worker had moved on to `second`.
        p.q.lost(worker, first)
        assert p.q.active() == 1
        p.q.lost(worker, second)
        assert p.q.active() == 0
        second.hold.set()  # type: ignore[union-attr]
        assert second.done.wait(DEADLINE_S)
        wait_for(lambda: p.q.active() == 0)


def test_a_worker_woken_past_enough_goes_back_to_sleep_once_the_others_take_runs() -> None:
    # Their CPU time read off the clock: all on CPU, so two workers are enough. A long ramp: a
    # loaded machine's pauses (the suite runs in parallel) rarely reach it.
    with pool(ramp_ms=100, n=4, thread_cpu_s=time.monotonic) as p:
        backlog_workers(p, 10, 0, spin_s=0.001)
        # Three runs that wait: the second wakes a worker after a ramp (one is not enough),
        # the third another after a ramp with no run taken (stuck, as the active ones look
        # while the claimer holds the GIL), and the quick runs behind them a fourth.
        naps = [Job(f"nap{i}", nap_s=0.5) for i in range(3)]
        p.put(*naps)
        wait_for(lambda: all(j.taken_by is not None for j in naps))
        quick = [Job(f"q{i}", spin_s=0.001) for i in range(3000)]
        p.put(*quick)
        wait_for(lambda: all(j.done.is_set() for j in naps))
        wait_for(lambda: all(j.done.is_set() for j in quick))
        last_nap_s = max(j.done_s for j in naps)
        late = [j for j in quick if j.taken_s is not None and j.taken_s > last_nap_s]
        counts = sorted(sum(1 for j in late if j.taken_by == w) for w in p.workers)
        # Back from their naps, all but one go back to sleep: two workers run the rest (the
        # tree before shared them four ways, ~25 % each). A pause of the machine for a ramp
        # lets the sentry take a run now and then.
        assert len(late) > 100
        assert sum(counts[:-2]) <= len(late) // 10, counts
