"""Pausing task classes and methods fleet-wide: what a pause is, what it names, how long it lasts,
and the wake message that tells the listeners to read the pauses again.

A pause lives in the ledger (`keyexpiry_pause`, `keyexpiry.ledger.pauses`), so it outlives every
listener's restart; listeners read the pauses every second, and at once when a pause or resume
publishes `PAUSE_WAKE` on the wake channel. A paused task is held back, not failed: it runs once
the pause ends.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import redis
from redis.cluster import RedisCluster

from keyexpiry import limits
from keyexpiry.errors import ArgumentError, KeyFormatError
from keyexpiry.keys import INTERNAL_MARK, check_name, clip, wake_channel
from keyexpiry.redis.arming import redis_db

PAUSE_WAKE = f"{INTERNAL_MARK}pause"
"""The line a pause or resume publishes on the wake channel (`keys.wake_channel`): a listener
that reads exactly this re-reads the pauses at once. No task key can be it (`#` cannot start a
class name), and an older listener's `parse_wake` skips it (it has no due time)."""

NAME_MAX_CHARS = 128
"""Longest class or method name a pause may name: the ledger's `class_name` and `method` columns
hold as much, so a longer name cannot be a task's."""
TARGET_MAX_CHARS = 2 * NAME_MAX_CHARS + 1
"""Longest target, `Class.method` (the `keyexpiry_pause.target` column)."""
REASON_MAX_CHARS = 255
"""Longest reason (the `keyexpiry_pause.reason` column)."""


@dataclass(frozen=True, slots=True)
class Pause:
    """A class or a method held back across the fleet (times in epoch ms, Redis's clock)."""

    target: str
    """`Class` (each of its methods) or `Class.method`."""
    until_ms: int | None
    """When the pause ends by itself; None: until resumed."""
    paused_at_ms: int
    """When it was paused (last paused: pausing again replaces until and reason)."""
    reason: str | None = None
    """What the operator said, if anything (shown by `keyexpiry paused` and the dashboard)."""

    def active(self, now_ms: int) -> bool:
        """Whether the pause still holds at `now_ms`."""
        return self.until_ms is None or self.until_ms > now_ms

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict: times as epoch seconds (as `TaskRow.to_json`), None stays None."""
        return {
            "target": self.target,
            "paused_at": self.paused_at_ms / 1000,
            "until": None if self.until_ms is None else self.until_ms / 1000,
            "reason": self.reason,
        }


def parse_target(text: str) -> str:
    """`text` as a pause target: `Class` or `Class.method` (names as in task keys: letters,
    digits and `_`, starting with a letter, each at most `NAME_MAX_CHARS`); ArgumentError
    otherwise. Surrounding whitespace is dropped."""
    if not isinstance(text, str):
        raise ArgumentError(f"a pause names 'Class' or 'Class.method', got {type(text).__name__}")
    target = text.strip()
    class_name, dot, method = target.partition(".")
    names = [(class_name, "class name")] + ([(method, "method name")] if dot else [])
    try:
        for name, what in names:
            check_name(name, what)
            if len(name) > NAME_MAX_CHARS:
                raise KeyFormatError(f"{what} {clip(name)} is longer than {NAME_MAX_CHARS}")
    except KeyFormatError as exc:
        raise ArgumentError(
            f"cannot pause {clip(text)}: {exc} ('Class' or 'Class.method')"
        ) from None
    return target


def target_matches(target: str, class_name: str, method: str) -> bool:
    """Whether pausing `target` holds back `class_name.method`: the class's own pause or the
    method's."""
    return target == class_name or target == f"{class_name}.{method}"


def is_paused(pauses: Iterable[Pause], class_name: str, method: str, now_ms: int) -> Pause | None:
    """The pause that holds `class_name.method` back at `now_ms`, or None. Of several (the
    class's and the method's), the one that lasts longest: it says when the task may run."""
    found: Pause | None = None
    for pause in pauses:
        if not pause.active(now_ms) or not target_matches(pause.target, class_name, method):
            continue
        if found is None or _ends_later(pause, found):
            found = pause
    return found


def _ends_later(a: Pause, b: Pause) -> bool:
    if b.until_ms is None:
        return False
    return a.until_ms is None or a.until_ms > b.until_ms


_UNITS_S = {"w": 7 * limits.DAY_S, "d": limits.DAY_S, "h": 3600, "m": 60, "s": 1}
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)([wdhms]))+\Z")
_PART = re.compile(r"(\d+(?:\.\d+)?)([wdhms])")


def parse_duration(text: str) -> float:
    """Seconds in a duration written as `30m`, `90s`, `2h`, `1d`, `1w` or a sum such as `1h30m`
    (each unit once, largest first; decimals allowed: `1.5h`): above 0, at most
    `limits.MAX_HORIZON_S`. ArgumentError otherwise."""
    if not isinstance(text, str):
        raise ArgumentError(f"a duration is text such as 30m, got {type(text).__name__}")
    compact = text.strip().lower().replace(" ", "")
    parts = _PART.findall(compact) if _DURATION.match(compact) else []
    units = [unit for _, unit in parts]
    order = list(_UNITS_S)
    if not parts or units != sorted(set(units), key=order.index):
        raise ArgumentError(
            f"duration {clip(text)} is not understood: use a number and a unit (s, m, h, d, w), "
            "e.g. 90s, 30m, 2h, 1d, 1h30m"
        )
    seconds = sum(float(amount) * _UNITS_S[unit] for amount, unit in parts)
    return limits.number(
        seconds,
        f"duration {clip(text)}",
        low=0,
        high=limits.MAX_HORIZON_S,
        error=ArgumentError,
        above_low=True,
    )


def check_reason(reason: str | None) -> str | None:
    """`reason` as the ledger keeps it: None or blank is None; at most `REASON_MAX_CHARS`
    characters of valid text on one line (ArgumentError otherwise)."""
    if reason is None:
        return None
    if not isinstance(reason, str):
        raise ArgumentError(f"reason must be text, got {type(reason).__name__}")
    text = reason.strip()
    if not text:
        return None
    if len(text) > REASON_MAX_CHARS:
        raise ArgumentError(
            f"reason is {len(text)} characters; at most {REASON_MAX_CHARS} are kept"
        )
    # One line of text every ledger stores alike: PostgreSQL refuses NUL, and a control
    # character would let a reason pass for something else where it is printed.
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise ArgumentError(f"reason {clip(text)} holds control characters (one line of text)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ArgumentError(f"reason {clip(text)} is not valid text") from None
    return text


def announce(client: redis.Redis, prefix: str = "") -> None:
    """Publish `PAUSE_WAKE` on the wake channel of `client`'s database, so every listener reads
    the pauses now rather than at its next poll. Sharded (`SPUBLISH`) on a cluster, as
    `redis.arming` publishes: a plain PUBLISH would be copied to every node over the bus.
    Raises redis.RedisError; the caller decides what a lost announcement costs."""
    channel = wake_channel(redis_db(client), prefix)
    if isinstance(client, RedisCluster):
        client.spublish(channel, PAUSE_WAKE)
    else:
        client.publish(channel, PAUSE_WAKE)
