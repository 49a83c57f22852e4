"""Routing one message heard on the subscription: what a key is (pure), then where it goes.

`KeyShapes.expired` / `KeyShapes.evicted` classify one key without I/O: a task key (for the
claimer), our own canary or a sentinel (for loss control), another keyexpiry key that is not a
task, another application's key (dropped without a word), or one that claims to be ours but
cannot be (logged once, as a short excerpt, and dropped). `Router` acts on that: claimer, driver,
health, counters and the log lines. Nothing here decodes a key longer than the key limit or queues
one that is not a task's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from loguru import logger

from keyexpiry.clock import monotonic_s
from keyexpiry.errors import KeyFormatError
from keyexpiry.keys import (
    INTERNAL_MARK,
    MAX_KEY_BYTES,
    SENTINEL_MARK,
    excerpt,
    parse_key,
    task_class_of,
    wake_channel,
)
from keyexpiry.listener.health import Health
from keyexpiry.log import SaidOnce
from keyexpiry.redis.arming import WAKE_MAX_BYTES, parse_wake
from keyexpiry.registry import Registry

SENTINEL_LINE_EVERY_S = 60.0
"""At most one INFO line a minute for sentinel expiries (each is counted: `Router.sentinels`)."""


class Route(Enum):
    """What one expired or evicted key is, to this listener."""

    TASK = "task"
    """A task key (or one the claimer refuses once, when it parses it): to the claimer."""
    CANARY = "canary"
    """This listener's own canary: events do arrive."""
    SENTINEL = "sentinel"
    """A loss-control sentinel fired: reconcile."""
    INTERNAL = "internal"
    """Another listener's canary, the driver lock: keyexpiry's, not a task."""
    FOREIGN = "foreign"
    """Another application's key: dropped without a word."""
    REFUSED = "refused"
    """Claims to be a task key of ours but cannot be one: logged once and dropped."""


class Verdict(NamedTuple):
    """A route, with the decoded key of a task and the reason for a refusal."""

    # A tuple, not a frozen dataclass: the subscriber thread builds one for every task key, and a
    # frozen dataclass nearly doubled the cost of routing a key (2.6 → 4.9 µs, measured).
    route: Route
    key: str = ""
    reason: str = ""
    class_name: str | None = None
    """The class a task key names (None when it does not parse as one)."""


_FOREIGN = Verdict(Route.FOREIGN)
_CANARY = Verdict(Route.CANARY)
_SENTINEL = Verdict(Route.SENTINEL)
_INTERNAL = Verdict(Route.INTERNAL)
_TASK = Route.TASK  # the common case, compared once per event without an Enum class lookup


@dataclass(frozen=True)
class KeyShapes:
    """The byte prefixes that tell this listener's keys from everyone else's."""

    prefix: bytes
    internal: bytes
    sentinel: bytes
    canary: bytes
    registered: Callable[[str], bool]
    """Whether a task class is registered here (decides, without a prefix, what is ours)."""

    @classmethod
    def of(cls, prefix: str, canary: str, registered: Callable[[str], bool]) -> KeyShapes:
        """The shapes for keys under `prefix`, with `canary` this listener's canary key."""
        return cls(
            prefix=prefix.encode(),
            internal=(prefix + INTERNAL_MARK).encode(),
            sentinel=(prefix + SENTINEL_MARK).encode(),
            canary=canary.encode(),
            registered=registered,
        )

    def is_node_canary(self, data: bytes) -> bool:
        """Whether `data` is this listener's canary on one cluster primary (`canary{tag}`)."""
        return (
            data.startswith(self.canary) and data[len(self.canary) : len(self.canary) + 1] == b"{"
        )

    def expired(self, data: bytes) -> Verdict:
        """What an expired key is.

        Keys of other applications sharing the database are foreign: those outside the prefix
        and, with no prefix, those not shaped like `Class@...` for a registered class (an
        unregistered class's well-formed key may be a task for another listener: the claimer
        logs it once). A key that claims to be ours but cannot be a task key is refused; one
        over the key limit is never decoded.
        """
        prefix = self.prefix
        if not data.startswith(prefix):
            return _FOREIGN
        if data.startswith(self.internal):
            if data == self.canary or self.is_node_canary(data):
                return _CANARY
            if data.startswith(self.sentinel):
                return _SENTINEL
            return _INTERNAL
        class_name = task_class_of(data, prefix)
        ours = bool(prefix) or (class_name is not None and self.registered(class_name))
        if len(data) > MAX_KEY_BYTES:
            return _refused(f"longer than the {MAX_KEY_BYTES}-byte key limit", ours=ours)
        try:
            key = data.decode("utf-8")
        except UnicodeDecodeError:
            return _refused("not valid UTF-8", ours=ours)
        if not ours and not _well_formed(key):
            return _FOREIGN
        # Parsed (and refused if malformed) once, by the claimer: not here as well.
        return Verdict(_TASK, key, "", class_name)

    def evicted(self, data: bytes) -> Verdict:
        """What an evicted key is: only a well-formed task key under the prefix is a task; the
        application's own keys are evicted too, so anything else is foreign, not refused."""
        if len(data) > MAX_KEY_BYTES or not data.startswith(self.prefix):
            return _FOREIGN  # never decode a huge foreign key
        if data == self.canary or self.is_node_canary(data):
            return _CANARY
        if data.startswith(self.internal):
            return _INTERNAL
        try:
            key = data.decode("utf-8")
            parsed = parse_key(key, prefix=self.prefix.decode())
        except (UnicodeDecodeError, KeyFormatError):
            return _FOREIGN
        return Verdict(_TASK, key, "", parsed.class_name)


def as_bytes(raw: bytes | str) -> bytes:
    """A message's payload as bytes (a str only comes from a test or a hand-driven call)."""
    return raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogateescape")


def _refused(reason: str, *, ours: bool) -> Verdict:
    return Verdict(Route.REFUSED, reason=reason) if ours else _FOREIGN


def _well_formed(key: str) -> bool:
    try:
        parse_key(key)
    except KeyFormatError:
        return False
    return True


class Router:
    """Turns expired, evicted and wake messages into work for the claimer, driver and health."""

    def __init__(
        self,
        health: Health,
        *,
        key_prefix: str,
        db: int,
        registry: Registry,
        submit: Callable[[Iterable[str]], None],
        note_due: Callable[[Iterable[tuple[str, int]]], None],
        request_reconcile: Callable[[str], None],
        owns: Callable[[str | None, bytes], bool] | None = None,
        leads: Callable[[bytes], bool] | None = None,
    ) -> None:
        self._health = health
        self._owns = owns or (lambda _class, _key: True)
        self._leads = leads or (lambda _key: True)
        self._submit = submit
        self._note_due = note_due
        self._request_reconcile = request_reconcile
        # Keys read under `key_prefix`, classes known by `registry`, wakes on `db`'s channel.
        self.shapes = KeyShapes.of(key_prefix, health.canary, registry.has_class)
        self._wake_channel = wake_channel(db, key_prefix)
        self._eviction_warned = False
        self.events = 0
        """Expired events heard, of any key."""
        self.foreign = 0
        """Expired keys of other applications, dropped without a word."""
        self.refused = 0
        """Keys that claimed to be tasks but cannot be (logged once each)."""
        self._refused_said = SaidOnce(limit=1_000)
        self.sentinels = 0
        """Sentinel expiries heard (a forged publish counts too)."""
        self._sentinel_said_s = -SENTINEL_LINE_EVERY_S
        self.evicted = 0
        """Task keys Redis evicted (maxmemory) that were handed back to the ledger."""
        self.wakes_refused = 0
        """Wake messages too long to be keyexpiry's, dropped undecoded."""
        self.others_share = 0
        """Task keys heard that belong to another live listener's share (`partition`)."""

    def handle_key(self, raw: bytes | str) -> None:
        """Route one expired key (see `KeyShapes.expired`): task key → claimer, canary →
        health, sentinel → reconcile; foreign keys counted, refused ones logged once."""
        self.events += 1
        data = as_bytes(raw)
        verdict = self.shapes.expired(data)
        route = verdict.route
        if route is _TASK:
            if self._owns(verdict.class_name, data):
                self._submit([verdict.key])
            else:
                self.others_share += 1
        elif route is Route.FOREIGN:
            self.foreign += 1
        elif route is Route.REFUSED:
            self.refused += 1
            # Its row (if any) is re-armed by every overdue check and expires again: say it once.
            log = logger.bind(key=excerpt(data), attempt=0)
            # Remembered by its first bytes: a refused key may be 33 MB long.
            if self._refused_said.first(data[:MAX_KEY_BYTES]):
                log.warning("ignored key: {}", verdict.reason)
            else:
                log.debug("ignored key again: {}", verdict.reason)
        elif route is Route.CANARY:
            self._health.canary_arrived(expired=True, key=data)
        elif route is Route.SENTINEL:
            # Every listener hears it; one of them reconciles (its walk re-arms lost keys of
            # every share, and each listener's own overdue check runs its overdue rows).
            self.sentinels += 1
            if self._leads(data):
                # A real one fires every sentinel_interval_s; anyone may publish the event, so
                # at most one line a minute (the reconciliations it asks for are coalesced).
                now_s = monotonic_s()
                if now_s - self._sentinel_said_s >= SENTINEL_LINE_EVERY_S:
                    self._sentinel_said_s = now_s
                    logger.info("sentinel {} fired: reconciling", excerpt(data))
                else:
                    logger.debug("sentinel {} fired: reconciling", excerpt(data))
                self._request_reconcile("sentinel")
            else:
                logger.debug("sentinel {} fired: another listener reconciles", excerpt(data))
        # Route.INTERNAL: another listener's canary, an expired driver lock: nothing to do.

    def handle_evicted(self, raw: bytes | str) -> None:
        """A key Redis evicted under maxmemory: its `expired` event will never come, so hand a
        task key to the claimer now: it runs it if due, else re-arms its missing key."""
        verdict = self.shapes.evicted(as_bytes(raw))
        if verdict.route is Route.CANARY:
            # Evicted first: events do arrive.
            self._health.canary_arrived(expired=False, key=as_bytes(raw))
            return
        if verdict.route is not Route.TASK:
            # Another listener's canary, a sentinel (the self-checks notice those), or the
            # application's own keys: not ours, not worth a line.
            return
        if not self._owns(verdict.class_name, as_bytes(raw)):
            self.others_share += 1
            return
        self.evicted += 1
        # Under noeviction Redis evicts nothing: such a message was published by someone else.
        # The claimer still checks the key (harmless), but no maxmemory alarm is raised.
        if self._health.eviction_possible and not self._eviction_warned:
            self._eviction_warned = True
            logger.warning(
                "Redis is evicting task keys (maxmemory): each is re-armed or run from the "
                "ledger; set maxmemory-policy noeviction"
            )
        logger.bind(key=verdict.key, attempt=0).debug("task key evicted: handed to the claimer")
        self._submit([verdict.key])

    def handle_wake(self, data: bytes) -> None:
        """Hand the tasks a wake message announces to the driver; a message longer than any
        keyexpiry sends is dropped undecoded (logged the first time)."""
        if len(data) > WAKE_MAX_BYTES:
            self.wakes_refused += 1
            if self.wakes_refused == 1:
                logger.warning(
                    "ignored a {}-byte message on {}: longer than keyexpiry sends",
                    len(data),
                    self._wake_channel,
                )
            return
        self._note_due(parse_wake(data))
