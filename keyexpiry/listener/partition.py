"""Live listeners share the task keys instead of racing for each one.

Every listener hears every expired event (pub/sub is a broadcast), but claims only its share: a
key's bucket is `crc32(key) % BUCKETS`, and each (class, bucket) belongs to one live listener
that registers the class, chosen by rendezvous hashing over the listeners' ids. Each listener
computes the same answer from the heartbeat table, so there is nothing to coordinate, and a
listener joining or leaving moves only the buckets it gains or gives up.

Membership is read at each heartbeat, so listeners may briefly disagree:
- two own a bucket (a newcomer before the others have read its row; a listener keeps buckets it
  gave up for `hold_s`): harmless, a claim is atomic and only one of them wins it;
- nobody owns a bucket: a peer died and is not yet silent for `takeover_after_s`. Its share of
  events is lost until then; whoever gains those buckets runs their overdue rows from the ledger
  (`Fleet` does this catch-up), so a dead listener's share waits about `takeover_after_s`.
A graceful stop marks the listener's row `stopping` and keeps serving for `hold_s`, so its peers
take its share without a gap. A listener whose row names no classes (an older keyexpiry) is no
one's partner: it still hears and claims every key, as before.
"""

from __future__ import annotations

import functools
import hashlib
import zlib
from collections.abc import Mapping

from keyexpiry.keys import task_class_of

BUCKETS = 1024
_MASK = BUCKETS - 1
_ALL = b"\x01" * BUCKETS


def bucket_of(key: bytes) -> int:
    """The bucket of a task key (its exact bytes as Redis names it)."""
    return zlib.crc32(key) & _MASK


def _score(member: str, bucket: int) -> int:
    digest = hashlib.blake2b(f"{member}/{bucket}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@functools.lru_cache(maxsize=64)
def assign(members: frozenset[str], me: str) -> bytes:
    """One byte per bucket, 1 where `me` wins the rendezvous among `members` (`me` included)."""
    if members <= {me}:
        return _ALL
    ordered = sorted(members | {me})
    out = bytearray(BUCKETS)
    for bucket in range(BUCKETS):
        winner = max(ordered, key=lambda m: _score(m, bucket))
        out[bucket] = winner == me
    return bytes(out)


Members = Mapping[str, frozenset[str] | None]
"""Live listeners by id, with the task classes each registers (None: an older keyexpiry)."""


def shares(members: Members) -> dict[str, float]:
    """Each live listener's share of the keys of the classes it registers, 0..1 (averaged over
    its classes; what `keyexpiry listeners` shows). None-class listeners hear everything: 1."""
    out: dict[str, float] = {}
    for me, classes in members.items():
        if not classes:
            out[me] = 1.0
            continue
        owned = 0
        for cls in classes:
            partners = frozenset(m for m, cs in members.items() if cs is not None and cls in cs)
            owned += assign(partners, me).count(1)
        out[me] = owned / (BUCKETS * len(classes))
    return out


class Partition:
    """This listener's share of the key space, one table of owned buckets per task class.

    `owns` is read by the subscriber thread on every event and `update` runs on the heartbeat
    thread: the tables are replaced whole, never changed in place, so no lock is needed.
    """

    def __init__(self, me: str, classes: frozenset[str], *, hold_s: float) -> None:
        self.me = me
        self.classes = classes
        self.hold_s = hold_s
        self._tables: dict[str, bytes] = {}
        """Owned buckets by class; a class absent (before the first update) is wholly ours."""
        self._owned_at: dict[str, list[float]] = {}
        self._members: dict[str, frozenset[str] | None] | None = None
        self._held_until: float | None = None
        """When the buckets given up and still held may be dropped (None: none held)."""
        self.peers = 0
        """Other live listeners that share at least one class with this one."""
        self.moves = 0
        """Updates that changed which buckets this listener owns."""

    def set_classes(self, classes: frozenset[str]) -> None:
        """The classes this listener registers changed (a test, a late import): recompute at
        the next update."""
        if classes != self.classes:
            self.classes = classes
            self._members = None

    def owns(self, class_name: str | None, key: bytes) -> bool:
        """Whether this listener claims `key` (of `class_name`); keys of classes it does not
        register, and unparsable ones, stay with the claimer, which knows what to say of them."""
        table = self._tables.get(class_name) if class_name is not None else None
        return table is None or table[zlib.crc32(key) & _MASK] != 0

    def leads(self, key: bytes) -> bool:
        """Whether this listener, of every live one whatever its classes, is the one to act on
        `key` (a sentinel firing: one reconciliation for the fleet, not one per listener),
        by the same rendezvous as the buckets. True until the first heartbeat read."""
        members = self._members
        if not members:
            return True
        return assign(frozenset(members), self.me)[bucket_of(key)] == 1

    def owns_key(self, key: str, prefix: str = "") -> bool:
        """`owns` for a task key read from the ledger."""
        raw = key.encode()
        return self.owns(task_class_of(raw, prefix.encode()), raw)

    def owned_buckets(self) -> int:
        """Buckets owned, summed over classes (for metrics and `keyexpiry listeners`)."""
        tables = self._tables
        return sum(t.count(1) for t in tables.values()) if tables else BUCKETS * len(self.classes)

    def update(self, members: Members, now_s: float) -> dict[str, set[int]]:
        """Recompute the share from the live `members`; return the buckets gained, by class
        (their overdue rows were nobody's: the caller runs them)."""
        members = dict(members)
        release_due = self._held_until is not None and now_s >= self._held_until
        if members == self._members and not release_due:
            return {}
        self._members = members
        self._held_until = None
        gained: dict[str, set[int]] = {}
        tables: dict[str, bytes] = {}
        peers: set[str] = set()
        for cls in self.classes:
            partners = frozenset(m for m, cs in members.items() if cs is not None and cls in cs)
            peers |= partners - {self.me}
            mine = assign(partners, self.me)
            owned_at = self._owned_at.setdefault(cls, [now_s] * BUCKETS)
            before = self._tables.get(cls, _ALL)
            table = bytearray(BUCKETS)
            for b in range(BUCKETS):
                if mine[b]:
                    owned_at[b] = now_s
                    table[b] = 1
                    if not before[b]:
                        gained.setdefault(cls, set()).add(b)
                elif now_s - owned_at[b] < self.hold_s:
                    # Given up: kept a while, so a peer slow to read the change leaves no gap.
                    table[b] = 1
                    until = owned_at[b] + self.hold_s
                    self._held_until = max(self._held_until or until, until)
            tables[cls] = bytes(table)
        if tables != self._tables:
            self.moves += 1
        self._tables = tables
        self.peers = len(peers)
        return gained
