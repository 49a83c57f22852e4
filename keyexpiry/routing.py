"""Routing one message heard on the subscription: a task key to the claimer, our own canary and
sentinels to loss control, a wake message to the driver; other applications' keys dropped without
a word, keys that claim to be ours but cannot be logged once (as a short excerpt) and dropped.

Nothing here decodes a key longer than the key limit or queues one that is not a task's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from loguru import logger

from keyexpiry.arming import WAKE_MAX_BYTES, parse_wake
from keyexpiry.errors import KeyFormatError
from keyexpiry.health import Health
from keyexpiry.keys import (
    INTERNAL_MARK,
    MAX_KEY_BYTES,
    SENTINEL_MARK,
    excerpt,
    parse_key,
    task_class_of,
    wake_channel,
)
from keyexpiry.runtime import Runtime


class Router:
    """Turns expired, evicted and wake messages into work for the claimer, driver and health."""

    def __init__(
        self,
        rt: Runtime,
        health: Health,
        *,
        submit: Callable[[Iterable[str]], None],
        note_due: Callable[[Iterable[tuple[str, int]]], None],
        request_reconcile: Callable[[str], None],
    ) -> None:
        self.rt = rt
        self._health = health
        self._submit = submit
        self._note_due = note_due
        self._request_reconcile = request_reconcile
        prefix = rt.settings.key_prefix
        self._prefix = prefix.encode()
        self._internal = (prefix + INTERNAL_MARK).encode()
        self._sentinel = (prefix + SENTINEL_MARK).encode()
        self._canary = health.canary.encode()
        self._wake_channel = wake_channel(rt.db, prefix)
        self._eviction_warned = False
        self.events = 0
        """Expired events heard, of any key."""
        self.foreign = 0
        """Expired keys of other applications, dropped without a word."""
        self.refused = 0
        """Keys that claimed to be tasks but cannot be (logged once each)."""
        self.evicted = 0
        """Task keys Redis evicted (maxmemory) that were handed back to the ledger."""
        self.wakes_refused = 0
        """Wake messages too long to be keyexpiry's, dropped undecoded."""

    def handle_key(self, raw: bytes | str) -> None:
        """Route one expired key: sentinel → reconcile; task key → claimer; else ignore.

        Keys of other applications sharing the database are dropped silently (counted in
        `foreign`): those outside the prefix and, with no prefix, those not shaped like
        `Class@...` for a registered class (an unregistered class's well-formed key may be a
        task for another listener: the claimer logs it once). A key that claims to be ours but
        cannot be a task key is logged once, as a short excerpt; one over the key limit is never
        decoded or queued.
        """
        self.events += 1
        data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogateescape")
        prefix = self._prefix
        if not data.startswith(prefix):
            self.foreign += 1
            return
        if data.startswith(self._internal):
            self._handle_internal(data)
            return
        class_name = task_class_of(data, prefix)
        registered = class_name is not None and self.rt.registry.has_class(class_name)
        ours = bool(prefix) or registered
        if len(data) > MAX_KEY_BYTES:
            self._refuse(data, f"longer than the {MAX_KEY_BYTES}-byte key limit", ours=ours)
            return
        try:
            key = data.decode("utf-8")
        except UnicodeDecodeError:
            self._refuse(data, "not valid UTF-8", ours=ours)
            return
        if not ours and not _well_formed(key):
            self.foreign += 1
            return
        # Parsed (and refused if malformed) once, by the claimer: not here as well.
        self._submit([key])

    def handle_evicted(self, raw: bytes | str) -> None:
        """A key Redis evicted under maxmemory: its `expired` event will never come, so hand a
        task key to the claimer now: it runs it if due, else re-arms its missing key."""
        data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogateescape")
        if len(data) > MAX_KEY_BYTES or not data.startswith(self._prefix):
            return  # not ours (and never decode a huge foreign key)
        if data == self._canary:
            self._health.canary_arrived(expired=False)  # evicted first: events do arrive
            return
        if data.startswith(self._internal):
            return  # another listener's canary, a sentinel: the self-checks notice those
        try:
            key = data.decode("utf-8")
            parse_key(key, prefix=self.rt.settings.key_prefix)
        except (UnicodeDecodeError, KeyFormatError):
            return  # the application's own keys are evicted too: not ours, not worth a line
        self.evicted += 1
        # Under noeviction Redis evicts nothing: such a message was published by someone else.
        # The claimer still checks the key (harmless), but no maxmemory alarm is raised.
        if self._health.eviction_possible and not self._eviction_warned:
            self._eviction_warned = True
            logger.warning(
                "Redis is evicting task keys (maxmemory): each is re-armed or run from the "
                "ledger; set maxmemory-policy noeviction"
            )
        logger.bind(key=key, attempt=0).debug("task key evicted: handed to the claimer")
        self._submit([key])

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

    def _handle_internal(self, data: bytes) -> None:
        if data == self._canary:
            self._health.canary_arrived(expired=True)
        elif data.startswith(self._sentinel):
            logger.info("sentinel {} fired: reconciling", excerpt(data))
            self._request_reconcile("sentinel")
        # Else another listener's canary, an expired driver lock: ours, not a task.

    def _refuse(self, data: bytes, reason: str, *, ours: bool) -> None:
        if not ours:
            self.foreign += 1
            return
        self.refused += 1
        logger.bind(key=excerpt(data), attempt=0).warning("ignored key: {}", reason)


def _well_formed(key: str) -> bool:
    try:
        parse_key(key)
    except KeyFormatError:
        return False
    return True
