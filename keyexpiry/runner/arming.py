"""Keys of rows already committed, armed off the hot threads.

The recorder arms retries and schedules' next occurrences after their rows are written, and
the claimer re-arms a pending row whose key is gone. Done on their own threads, a Redis node
that stops answering (a paused or stalled primary: a socket timeout of 10 s) held the recording
of every outcome, or every claim, of the whole listener: the Cluster soak's stalled primary
made all tasks wait, on every primary (throughput fell to a quarter, tasks due on healthy nodes
ran 8 s late). Here one thread of its own waits instead. The rows are committed before their
keys are armed, so a job that fails or is dropped loses nothing: the overdue check re-arms a
pending row whose key is missing (`stuck_after_s`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import redis
from loguru import logger

from keyexpiry.clock import monotonic_s
from keyexpiry.log import Tally
from keyexpiry.threads import ThreadErrors

MAX_JOBS = 10_000
"""Jobs waiting at most (each a batch of keys); past it a job is dropped and counted."""
_SUMMARY_EVERY_S = 60.0


class Arming:
    """One thread arming keys for the recorder and the claimer, in the order handed over."""

    def __init__(self, errors: ThreadErrors, max_jobs: int = MAX_JOBS) -> None:
        """Unexpected exceptions of jobs are counted in `errors`."""
        self._errors = errors
        self._max_jobs = max_jobs
        self._jobs: collections.deque[tuple[str, Callable[[], None]]] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._dropped_said = Tally(_SUMMARY_EVERY_S)
        self.dropped = 0
        """Jobs dropped because `max_jobs` were waiting (their rows are repaired as overdue)."""
        self.failed = 0
        """Jobs Redis refused or did not answer (their rows are repaired as overdue)."""

    def submit(self, what: str, job: Callable[[], None]) -> None:
        """Queue `job` (it arms `what`, said if it fails); never blocks."""
        with self._cond:
            if len(self._jobs) >= self._max_jobs:
                self.dropped += 1
                full = True
            else:
                self._jobs.append((what, job))
                self._cond.notify()
                full = False
        if full and self._dropped_said.add(1, monotonic_s()):
            logger.warning(
                "{} arming jobs already waiting (Redis slow or away): {} not armed; the "
                "overdue check re-arms their rows",
                self._max_jobs,
                what,
            )

    def loop(self, stopped: threading.Event) -> None:
        """Run jobs as they come until `stopped` is set and none is left."""
        while True:
            with self._cond:
                while not self._jobs and not stopped.is_set():
                    self._cond.wait(0.1)
                if not self._jobs:
                    return
                what, job = self._jobs.popleft()
                self._busy = True
            try:
                job()
            except (redis.RedisError, OSError) as exc:
                self.failed += 1
                logger.warning("could not arm {}: {}; reconciliation will", what, exc)
            except Exception:
                self.failed += 1
                self._errors.add("arming")
                logger.opt(exception=True).error("arming {} failed unexpectedly", what)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def idle(self) -> bool:
        """No job waiting or running."""
        with self._cond:
            return not self._jobs and not self._busy

    def drain(self, deadline_s: float) -> bool:
        """Wait until every job handed over so far has run, or the monotonic `deadline_s`;
        True when none is left."""
        with self._cond:
            while (self._jobs or self._busy) and monotonic_s() < deadline_s:
                self._cond.wait(0.05)
            return not self._jobs and not self._busy
