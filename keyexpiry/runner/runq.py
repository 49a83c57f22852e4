"""Claimed runs waiting for a worker, and which idle worker to wake for them.

A queue that wakes an idle worker for every run it is given (a `SimpleQueue` did) wakes the
whole pool for one claim of a hundred runs, and eight threads then fight over the GIL for
handlers that one or two would have run: the listener spent a fifth more CPU on a burst with 8
workers than with 2 (docs/PERFORMANCE.md). Here idle workers are woken as the waiting runs need
them, with `ramp_s` the longest a run waits behind busy workers for no reason:

- a run given while no worker is active wakes one at once;
- handlers that typically take `ramp_s` or longer wake an idle worker per run, as before
  (waiting behind one would cost more than a wake-up);
- otherwise one more worker is woken each time the oldest waiting run has waited `ramp_s` (at
  most one per `ramp_s`), up to as many as keep one CPU busy (one more than 1 / the share of a
  run spent on CPU: a burst of handlers waiting on I/O has the whole pool within a few ramps,
  trivial ones are run by two), and past that only when no run was taken for `ramp_s` (the
  active ones are stuck): another thread would only fight for the GIL;
- a worker back from a run goes back to sleep, rather than take the next, while that many others
  are active and taking runs: a worker woken because the others looked stuck (the claimer held
  the GIL for a switch interval, say) would otherwise stay awake for the rest of the backlog,
  and how many stayed awake varied from wave to wave (throughput waves of the same 30k tasks
  took 2.7 to 4.4 s of listener CPU, with 14k to 41k worker context switches);
- an idle worker woken as the *sentry* sleeps until the oldest run's deadline, so a run behind
  workers that all hang still starts within `ramp_s`; no thread polls an idle queue (behind a
  backlog the sentry wakes once a ramp, to find the deadline moved on).

The share on CPU is read from runs that had the interpreter nearly to themselves: beside many
workers, a run is mostly waiting for the GIL, which would read as I/O and wake more still.
`ramp_s` 0 wakes one idle worker per run.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from keyexpiry.clock import monotonic_s

Run = TypeVar("Run")

_SMOOTHING = 0.05
"""Weight of the newest run in the moving averages of run time."""
_ALONE = 1
"""Runs measured for their share on CPU: those with at most this many workers active."""


@dataclass(eq=False)
class Worker:
    """One worker thread's place in the queue: whether it is active, and how it is woken."""

    active: bool = False
    """Running a run (counted in the queue's active workers)."""
    reserved: bool = False
    """Woken to run the oldest waiting run, and counted active for it already."""
    sentry: bool = False
    """Woken to watch the oldest waiting run's deadline rather than to run it at once."""
    woken: bool = False
    """Rung since it last went to sleep (set under the queue's lock)."""
    bell: threading.Lock = field(default_factory=threading.Lock)
    """Held while the worker sleeps; released to wake it."""
    took_s: float = 0.0
    took_cpu_s: float = 0.0
    """When it took its run, by the clock and by its thread's CPU time."""
    crowd: int = 0
    """Workers active when it took its run (itself included)."""
    run: object = None
    """The run it took last."""

    def __post_init__(self) -> None:
        self.bell.acquire()


class RunQueue(Generic[Run]):
    """First in, first out; workers woken as the waiting runs need them (module docstring)."""

    def __init__(self, ramp_s: float, thread_cpu_s: Callable[[], float] = time.thread_time) -> None:
        """`thread_cpu_s`: the calling thread's CPU time, from which runs' share on CPU is read
        (tests give the clock, for runs all on CPU whatever else the machine runs)."""
        self._thread_cpu_s = thread_cpu_s
        self._lock = threading.Lock()
        self._runs: collections.deque[tuple[Run, float]] = collections.deque()
        self._idle: list[Worker] = []  # the last to go idle is woken first: its caches are warm
        self._sentry: Worker | None = None
        self._active = 0  # workers running a run, or woken to run one and on their way
        self._woke_s = float("-inf")  # when a worker was last woken to run
        self._ramp_s = ramp_s
        self._took_s = float("-inf")  # when a worker last took a run
        self._took_by: Worker | None = None  # and which
        self._before_s = float("-inf")  # when another worker than that one last took a run
        self._run_s: float | None = None  # moving average of a run's time
        self._cpu_share = 1.0  # moving average of the share of a run spent on CPU
        self._closed = False
        self.wakes = 0
        """Idle workers woken to run (for tests and the benchmark)."""

    def __len__(self) -> int:
        return len(self._runs)

    def active(self) -> int:
        """Workers running a run or woken to run one."""
        return self._active

    def put(self, runs: Iterable[Run]) -> None:
        """Queue `runs` (in order); wake what they need."""
        with self._lock:
            now = monotonic_s()
            self._runs.extend((run, now) for run in runs)
            self._arrange(now)

    def get(self, worker: Worker) -> Run | None:
        """The next run for `worker` (which is done with its previous one, if any), sleeping
        while there is none for it; None once the queue is closed: the worker ends."""
        with self._lock:
            if worker.active:
                worker.active = False
                self._active -= 1
                self._ran(worker)
            while not self._closed:
                now = monotonic_s()
                if worker.reserved:
                    worker.reserved = False
                    if self._runs:
                        return self._take(worker, now)
                    self._active -= 1  # another worker took it meanwhile
                elif self._runs and not worker.sentry and not self._surplus(worker, now):
                    self._active += 1  # awake already: running the next costs no wake-up
                    return self._take(worker, now)
                if worker.sentry:
                    if self._runs and self._due_s(now) > now:
                        self._wait(worker, self._due_s(now) - now)
                        continue
                    self._sentry, worker.sentry = None, False
                    if self._runs:  # its deadline passed: it runs the oldest
                        self._active += 1
                        self._woke_s = now
                        self.wakes += 1
                        return self._take(worker, now)
                self._idle.append(worker)
                self._wait(worker, None)
            if worker.reserved:  # woken to run just as the queue closed
                worker.reserved = False
                self._active -= 1
            return None

    def drain(self) -> list[Run]:
        """Take every waiting run out (they will not be run here)."""
        with self._lock:
            runs = [run for run, _ in self._runs]
            self._runs.clear()
            return runs

    def close(self) -> None:
        """Wake every sleeping worker to end; active ones end after their run."""
        with self._lock:
            self._closed = True
            sleeping = [*self._idle, *([self._sentry] if self._sentry is not None else [])]
            self._idle.clear()
            self._sentry = None
            for worker in sleeping:
                self._ring(worker)

    def lost(self, worker: Worker, run: object = None) -> None:
        """`worker` no longer counts as active: abandoned to `run`, a handler that hung (the
        watchdog starts another worker), or ending for good (any run). Nothing when it has
        moved on from `run` already, or is not active."""
        with self._lock:
            if worker.active and (run is None or worker.run is run):
                worker.active = False
                self._active -= 1

    # --- under the lock -----------------------------------------------------------------------
    def _take(self, worker: Worker, now: float) -> Run:
        run, _queued_s = self._runs.popleft()
        worker.active, worker.run = True, run
        worker.took_s, worker.took_cpu_s = now, self._thread_cpu_s()
        worker.crowd = self._active
        if self._took_by is not worker:
            self._before_s, self._took_by = self._took_s, worker
        self._took_s = now
        self._arrange(now)
        return run

    def _ran(self, worker: Worker) -> None:
        """`worker` is back from a run: fold its time into the averages."""
        took_s = monotonic_s() - worker.took_s
        if self._run_s is None:
            self._run_s = took_s
        else:
            self._run_s += _SMOOTHING * (took_s - self._run_s)
        if worker.crowd <= _ALONE and self._active < _ALONE:
            # Beside many workers a run's time is mostly waiting for the GIL, which would
            # read as I/O and wake more workers still: the share on CPU is taken from runs
            # that had the interpreter nearly to themselves.
            share = (self._thread_cpu_s() - worker.took_cpu_s) / max(took_s, 1e-9)
            self._cpu_share += _SMOOTHING * (min(share, 1.0) - self._cpu_share)

    def _enough(self) -> int:
        """Workers that keep one CPU busy with runs of the measured share on CPU (one more for
        slack): another only adds a thread fighting for the GIL."""
        return round(1 / max(self._cpu_share, 0.01)) + 1

    def _surplus(self, worker: Worker, now: float) -> bool:
        """Whether `worker`, awake and idle, should sleep rather than take the next run: runs
        are short, enough other workers are active, and one of them took a run within a ramp
        (they are not stuck)."""
        run_s = self._run_s
        if run_s is None or run_s >= self._ramp_s or self._active < self._enough():
            return False
        others_took_s = self._before_s if self._took_by is worker else self._took_s
        return now - others_took_s < self._ramp_s

    def _due_s(self, now: float) -> float:
        """When one more worker should take the oldest waiting run (now or earlier: at once)."""
        run_s = self._run_s
        if self._active == 0 or (run_s is not None and run_s >= self._ramp_s):
            return now
        if self._active < self._enough():
            # Fewer workers than it takes to keep one CPU busy with runs this share on CPU
            # (one more for slack): another adds throughput.
            return max(self._runs[0][1], self._woke_s) + self._ramp_s
        # Enough to keep the interpreter busy: another only adds a thread fighting for the GIL,
        # unless the active ones are stuck (no run taken for a ramp).
        return max(self._runs[0][1], self._took_s, self._woke_s) + self._ramp_s

    def _arrange(self, now: float) -> None:
        """Wake a sleeping worker to run the oldest waiting run, or one to watch its deadline."""
        if not self._runs:
            return
        sentry = self._sentry
        if self._due_s(now) <= now:
            if sentry is not None:
                self._sentry, sentry.sentry = None, False
                worker = sentry
            elif self._idle:
                worker = self._idle.pop()
            else:
                return
            worker.reserved = True
            self._active += 1
            self._woke_s = now
            self.wakes += 1
            self._ring(worker)
        elif sentry is None and self._idle:
            worker = self._idle.pop()
            worker.sentry = True
            self._sentry = worker
            self._ring(worker)

    def _ring(self, worker: Worker) -> None:
        if not worker.woken:  # rung twice before it woke: it reads its flags once awake
            worker.woken = True
            worker.bell.release()

    def _wait(self, worker: Worker, timeout_s: float | None) -> None:
        """Sleep, the queue's lock let go, until rung (or `timeout_s` passed)."""
        worker.woken = False
        self._lock.release()
        try:
            rang = worker.bell.acquire(timeout=-1 if timeout_s is None else max(0.0, timeout_s))
        finally:
            self._lock.acquire()
        if worker.woken and not rang:
            worker.bell.acquire()  # rung between its timeout and now: take the ring back
