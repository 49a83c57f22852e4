"""The accepted range of every number that enters keyexpiry, and the checks that enforce them.

Each value is checked where it enters (API arguments, CLI options, `KEYEXPIRY_*` settings,
`@exposed` options, rows read back from the ledger), so the listener's threads only ever see
finite numbers in range: a NaN or 1e300 there would kill a thread, not fail a task.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from decimal import Decimal
from typing import Any

from keyexpiry.errors import KeyExpiryError
from keyexpiry.keys import shorten

DAY_S = 86_400
MAX_HORIZON_S = 100 * 365 * DAY_S
"""How far ahead a task may be due: 100 years (every due time then prints as a date)."""
MAX_DELAY_S = 365 * DAY_S
"""Longest retry delay or handler timeout: one year."""
MAX_RETRIES = 100
"""Longest retry schedule (each entry is one more attempt)."""
MIN_INTERVAL_S = 0.05
"""Shortest interval of a loop setting (heartbeat, lease check, canary, reconnect, prune, ...):
shorter ones only burn CPU (1e-300 made a listener spin at 100 %); the tests' fastest is this."""
MIN_TIMEOUT_S = 0.01
"""Shortest handler timeout: anything shorter fails every run before it starts."""
MAX_LIST_ROWS = 100_000
"""Most rows one `list` returns (`Client.list_tasks`, `keyexpiry list --limit`)."""
MIN_DUE_MS = 0
"""Earliest due time accepted (1970-01-01 UTC): anything earlier is due now anyway."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects in JSON keyexpiry stores (a payload, a result) or reads
back (from the ledger or Redis): Python's decoder recurses once per level, and a document ~1000
deep raised RecursionError wherever it was read (a listener, on every attempt; `show`)."""


def number(
    value: object,
    field: str,
    *,
    low: float,
    high: float,
    error: type[KeyExpiryError],
    above_low: bool = False,
) -> float:
    """`value` as a finite float within [low, high] (or (low, high] with `above_low`), else
    `error` naming `field` and the accepted range in one line."""
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal):
        raise error(
            f"{field} must be a number, got {type(value).__name__} {shorten(repr(value), 80)}"
        )
    try:
        as_float = float(value)
    except (OverflowError, ValueError):
        as_float = math.inf
    low_ok = as_float > low if above_low else as_float >= low
    if not (math.isfinite(as_float) and low_ok and as_float <= high):
        bound = "above" if above_low else "from"
        raise error(
            f"{field} must be {bound} {_num(low)} to {_num(high)}, got {shorten(repr(value), 80)}"
        )
    return as_float


# A JSON string, escapes included: what it holds is no nesting.
_JSON_STRING = re.compile(r'"(?:[^"\\]+|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def json_too_deep(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON `text` nests arrays and objects deeper than `max_depth`, told without
    decoding it (decoding is what fails). Brackets inside strings do not count."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if text.count("[") + text.count("{") <= max_depth:
        return False  # the common case, at C speed: too few brackets to nest that deep
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    depth = 0
    for c in brackets:
        if c in "[{":
            depth += 1
            if depth > max_depth:
                return True
        else:
            depth -= 1
    return False


def json_loads(text: str | bytes) -> Any:
    """`json.loads` for JSON read back from the ledger or Redis: ValueError (as for text that
    is not JSON) for a document nested deeper than MAX_JSON_DEPTH, never RecursionError."""
    if json_too_deep(text):
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return json.loads(text)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def delays(
    values: Iterable[object] | None, field: str, error: type[KeyExpiryError]
) -> tuple[float, ...] | None:
    """A retry schedule: `None` stays None (use the next default), `[]` means no retries, and
    every delay is a finite number of seconds from 0 to MAX_DELAY_S."""
    if values is None:
        return None
    if isinstance(values, str | bytes):
        raise error(f"{field} must be a list of seconds, got {shorten(repr(values), 80)}")
    try:
        items = list(values)
    except TypeError:
        raise error(f"{field} must be a list of seconds, got {shorten(repr(values), 80)}") from None
    if len(items) > MAX_RETRIES:
        raise error(f"{field} may hold at most {MAX_RETRIES} delays, got {len(items)}")
    return tuple(
        number(v, f"{field}[{i}]", low=0, high=MAX_DELAY_S, error=error)
        for i, v in enumerate(items)
    )
