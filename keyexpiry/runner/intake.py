"""The intake: task keys heard expiring (or found due), waiting for their claim.

Bounded, because anyone who may PUBLISH can announce a million keys: a key past the bound is
dropped and counted, and the claimer reads the due tasks from the ledger instead (`put_first`),
ahead of every event's key.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterable

from keyexpiry.runner.inflight import DispatchStats

INTAKE_MAX_KEYS = 16_384
"""Keys the intake holds at most (or 16 claims' worth, for a `claim_batch` above 1,024): a
couple of MB, claimed in well under a second. Past it events (a flood, forged or not) are
dropped, counted, and the due tasks among them read from the ledger instead."""


class Intake:
    """Keys waiting for their claim, each queued once however often it is seen (its event and
    a reconciliation after a reconnect); `submit` never blocks.

    Bounded: past `max_queued` keys an event is dropped and counted, and `overflowed` is set,
    for the claimer to look the due tasks up in the ledger instead (`put_first`): a flood of
    events for keys with no row (forged, or rows deleted) costs neither unbounded memory nor
    the due tasks' place in the queue."""

    def __init__(self, stats: DispatchStats, max_backlog: int, max_queued: int) -> None:
        self._stats = stats
        self._max_backlog = max_backlog
        self._max_queued = max_queued
        self._incoming: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._backlog: collections.deque[str] = collections.deque()
        self._queued: set[str] = set()  # keys in _incoming or _backlog
        self._first: collections.deque[str] = collections.deque()
        """Due tasks found in the ledger, taken before any event's key."""
        self._stale: set[str] = set()
        """Keys taken from the front lane while their event still waited further back: that
        copy is skipped once when it comes up (claimed again, it would find the task running
        or done, a claim and a lookup for nothing: a fifth of a 30k wave's keys)."""
        self._lock = threading.Lock()
        self.overflowed = False
        """Set when a key was dropped (the intake was full); the claimer clears it."""
        self.on_queued: Callable[[], None] = _nothing
        """Called after keys were queued or a wake-up asked for (the claimer: another thread
        claims if it is away running a long handler)."""

    def submit(self, keys: Iterable[str]) -> None:
        """Queue keys not already waiting; drop (and count) those past the bound."""
        keys = list(keys)  # may be lazy: never read it under the lock
        with self._lock:
            queued = self._queued
            for key in keys:
                self._stats.submitted += 1
                if key in queued:
                    self._stats.already_queued += 1
                    continue
                if len(queued) >= self._max_queued:
                    # Nothing more per key than a count: the subscription's reader calls this
                    # for every event of a flood, and must keep up with it.
                    self._stats.intake_full += 1
                    self.overflowed = True
                    continue
                queued.add(key)
                self._incoming.put(key)
        self.on_queued()

    def put_first(self, keys: list[str]) -> None:
        """Queue due tasks read from the ledger ahead of every event's key. One also waiting
        further back is claimed twice: the second claim finds it taken and does nothing."""
        with self._lock:
            self._first.extend(keys)

    def first_count(self) -> int:
        """Keys waiting in the front lane (`put_first`)."""
        return len(self._first)

    def wake(self) -> None:
        """End a `wait` now (flow control: held keys may be offered); never blocks."""
        self._incoming.put("")
        self.on_queued()

    def wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for a key; True when one waits."""
        if self._backlog or self._first:
            return True
        try:
            self._backlog.append(self._incoming.get(timeout=timeout_s))
        except queue.Empty:
            return False
        return True

    def take(self, room: int) -> list[str]:
        """Up to `room` keys, the front lane's first, off the queue: a sighting during their
        claim (the task moved and fell due again) queues a key anew."""
        while len(self._backlog) < self._max_backlog:
            try:
                self._backlog.append(self._incoming.get_nowait())
            except queue.Empty:
                break
        batch: list[str] = []
        with self._lock:
            first, queued, stale = self._first, self._queued, self._stale
            while first and len(batch) < room:
                key = first.popleft()
                batch.append(key)
                # Bounded: past it, a copy is claimed twice, as before (harmless, a moment).
                if key in queued and len(stale) < self._max_queued:
                    queued.discard(key)  # a sighting from now on queues it anew
                    stale.add(key)
            while self._backlog and len(batch) < room:
                key = self._backlog.popleft()
                if key in stale:
                    stale.discard(key)
                elif key:  # not a wake-up
                    batch.append(key)
                    queued.discard(key)
        return batch

    def requeue(self, keys: list[str]) -> None:
        """Put keys whose claim failed back at the head of the queue (unless queued again)."""
        with self._lock:
            again = [k for k in keys if k not in self._queued]
            self._queued.update(again)
            self._backlog.extendleft(reversed(again))

    def __len__(self) -> int:
        return self._incoming.qsize() + len(self._backlog) + len(self._first)


def _nothing() -> None:
    pass
