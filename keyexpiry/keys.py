"""Task keys (`Class@method@arg1@arg2`) and every other Redis name keyexpiry uses.

Arguments are percent-escaped so `@`, `%`, spaces, control characters and non-ASCII text round-trip
exactly; the escaped key is pure printable ASCII, which keeps it readable in `redis-cli` and
lets the ledger index it with a binary (case-sensitive) ASCII collation.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from urllib.parse import quote, unquote_to_bytes

from keyexpiry.errors import KeyFormatError

SEPARATOR = "@"
MAX_KEY_BYTES = 512
"""Longest task key accepted, prefix included; the ledger's unique index is sized for it."""

# Printable ASCII that needs no escaping; `@` separates, `%` escapes, space would confuse shells,
# and `{` `}` would make a Redis Cluster hash the key by what they enclose (a hash tag): a user
# argument must not pile tasks onto one slot.
_SAFE = "!$&'()*+,-./:;<=>?[]^_`|~#"
_LEGACY_SAFE = _SAFE + "{}"
"""What keys were escaped with before braces were: such keys (tasks created then) still parse."""
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
# What `quote(arg, safe=_SAFE)` leaves as it is (its own always-safe letters, digits and `_.-~`,
# and _SAFE): an argument of these alone is its own escape, without quote's per-byte work.
_PLAIN = re.compile(r"[A-Za-z0-9_.\-~!$&'()*+,/:;<=>?\[\]^`|#]*\Z")
_ESCAPED = re.compile(r"(?:[A-Za-z0-9!$&'()*+,\-./:;<=>?\[\]^_`{|}~#]|%[0-9A-F]{2})*\Z")

INTERNAL_MARK = "#keyexpiry#"
"""Every key keyexpiry keeps for itself starts with `{prefix}#keyexpiry#` (no task class can)."""
SENTINEL_MARK = "#keyexpiry#sentinel#"
"""Sentinel keys are `{prefix}#keyexpiry#sentinel#{n}`: `#` cannot start a task class name."""


@dataclass(frozen=True, slots=True)
class TaskKey:
    """A parsed task key: class name, method name and the decoded argument strings."""

    class_name: str
    method: str
    args: tuple[str, ...]

    def format(self, prefix: str = "") -> str:
        """The Redis key for this task under `prefix`."""
        return format_key(self.class_name, self.method, self.args, prefix=prefix)


def clip(text: str, limit: int = 80) -> str:
    """`repr(text)`, cut to about `limit` characters: error messages quote what they refuse,
    and what they refuse may be megabytes long."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def shorten(text: str, limit: int = 200) -> str:
    """`text` cut to about `limit` characters, noting its full length when cut."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def excerpt(key: bytes | str, limit: int = 80) -> str:
    """A key fit for one log line, whatever it holds: at most `limit` characters of it, every
    non-ASCII or control character escaped (a key may hold newlines or terminal escapes), and
    its full size when it was cut."""
    shown = ascii(key[:limit])
    return shown if len(key) <= limit else f"{shown}... ({len(key)} bytes)"


def check_name(name: str, what: str) -> str:
    """Return `name` if it is a plain public identifier (no leading `_`, no dots), else raise."""
    if not _NAME.match(name):
        raise KeyFormatError(
            f"{what} {clip(name)} is not allowed: use letters, digits and _ , starting with a "
            "letter"
        )
    return name


def escape_arg(arg: str, *, safe: str = _SAFE) -> str:
    """Percent-escape one argument for use inside a key."""
    if safe is _SAFE and _PLAIN.match(arg):
        return arg
    try:
        return quote(arg, safe=safe, encoding="utf-8", errors="strict")
    except UnicodeEncodeError:
        # Lone surrogates: what Python makes of command-line bytes that are not UTF-8.
        raise KeyFormatError(
            f"argument {clip(arg)} is not valid text (not encodable as UTF-8)"
        ) from None


def unescape_arg(segment: str) -> str:
    """Decode one escaped key segment strictly: bad escapes or bad UTF-8 raise KeyFormatError."""
    if not _ESCAPED.match(segment):
        raise KeyFormatError(f"argument segment {segment[:80]!r} has characters keys never contain")
    try:
        return unquote_to_bytes(segment).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KeyFormatError("argument segment is not valid UTF-8 once unescaped") from exc


def format_key(
    class_name: str, method: str, args: tuple[str, ...] | list[str], *, prefix: str = ""
) -> str:
    """Build `{prefix}Class@method@arg…`, refusing bad names and keys over MAX_KEY_BYTES."""
    key = SEPARATOR.join([_key_head(class_name, method, prefix), *map(escape_arg, args)])
    size = len(key) if key.isascii() else len(key.encode("utf-8"))
    if size > MAX_KEY_BYTES:
        raise KeyFormatError(
            f"task key would be {size} bytes; the limit is {MAX_KEY_BYTES} (shorten the arguments, "
            "or keep large data in your own table and pass its id)"
        )
    return key


@functools.lru_cache(maxsize=1024)
def _key_head(class_name: str, method: str, prefix: str) -> str:
    # A bulk create names a few task methods many times over: their names are checked once.
    check_name(class_name, "class name")
    check_name(method, "method name")
    return f"{prefix}{class_name}{SEPARATOR}{method}"


def parse_key(key: str, *, prefix: str = "") -> TaskKey:
    """Parse a Redis key into a TaskKey; KeyFormatError if it is not a well-formed task key."""
    if not key.startswith(prefix):
        raise KeyFormatError(f"key does not start with the prefix {prefix!r}")
    if len(key.encode("utf-8")) > MAX_KEY_BYTES:
        raise KeyFormatError(f"key is longer than {MAX_KEY_BYTES} bytes")
    parts = key[len(prefix) :].split(SEPARATOR)
    if len(parts) < 2:
        raise KeyFormatError("key has no '@' between class and method")
    class_name = check_name(parts[0], "class name")
    method = check_name(parts[1], "method name")
    args = tuple(unescape_arg(p) for p in parts[2:])
    parsed = TaskKey(class_name, method, args)
    # One task, one key: a key spelled differently for the same arguments is not ours. A key
    # with literal braces was canonical before braces were escaped: it still names its task.
    if parsed.format(prefix) != key and not (
        ("{" in key or "}" in key) and _legacy_format(parsed, prefix) == key
    ):
        raise KeyFormatError("key is not in canonical form (escaping differs)")
    return parsed


def braces_unescaped(key: str, prefix: str = "") -> str:
    """`key` as it was spelled before `{` and `}` were escaped (a task created then is still
    pending under that key). `%7B`/`%7D` in an escaped key only ever stand for braces."""
    rest = key[len(prefix) :].replace("%7B", "{").replace("%7D", "}")
    return prefix + rest


def _legacy_format(parsed: TaskKey, prefix: str) -> str:
    args = (escape_arg(a, safe=_LEGACY_SAFE) for a in parsed.args)
    return prefix + SEPARATOR.join([parsed.class_name, parsed.method, *args])


_CLASS_HEAD = re.compile(rb"([A-Za-z][A-Za-z0-9_]*)@")


def task_class_of(raw: bytes, prefix: bytes = b"") -> str | None:
    """The class name `raw` would name as a task key (`{prefix}Class@...`), or None when it is
    not shaped like one; reads at most MAX_KEY_BYTES of it, however long it is."""
    if not raw.startswith(prefix):
        return None
    match = _CLASS_HEAD.match(raw[len(prefix) : len(prefix) + MAX_KEY_BYTES])
    return match.group(1).decode("ascii") if match else None


def sentinel_key(index: int, prefix: str = "") -> str:
    """Name of loss-control sentinel number `index` (1-based)."""
    return f"{prefix}{SENTINEL_MARK}{index}"


def is_sentinel(key: str, prefix: str = "") -> bool:
    """Whether `key` is one of our loss-control sentinels."""
    return key.startswith(prefix + SENTINEL_MARK)


CANARY_MARK = "#keyexpiry#canary#"


def canary_key(owner: str, prefix: str = "") -> str:
    """A listener's canary: a key it expires itself to prove events still arrive."""
    return f"{prefix}{CANARY_MARK}{owner}"


MARKER_MARK = "#keyexpiry#marker"


def marker_key(prefix: str = "") -> str:
    """A key without expiry holding a random token, one per Redis primary (with its hash tag):
    a listener that finds another token there (or none) knows Redis lost its keys (FLUSHALL, a
    restart without persistence) even when no event and no reconnect said so."""
    return f"{prefix}{MARKER_MARK}"


def driver_lock_key(prefix: str = "") -> str:
    """The lock that elects one listener to drive expiries (so lookups are not multiplied)."""
    return f"{prefix}#keyexpiry#driver"


def wake_channel(db: int, prefix: str = "") -> str:
    """Channel on which creators announce tasks due soon, so the driver needs no polling."""
    return f"{prefix}#keyexpiry#wake@{db}"


def expired_channel(db: int) -> str:
    """The keyevent channel on which Redis announces expired keys of database `db`."""
    return f"__keyevent@{db}__:expired"


def evicted_channel(db: int) -> str:
    """The keyevent channel on which Redis announces keys evicted from database `db`."""
    return f"__keyevent@{db}__:evicted"
