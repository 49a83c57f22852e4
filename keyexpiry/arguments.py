"""The argument types a task method may take, and each one's canonical string inside a key:
`Converter`, `CONVERTERS`, and encoding an argument by its own type when no signature is known.

Equal values give equal strings, so a key names one task however its arguments were spelled."""

from __future__ import annotations

import datetime as dt
import math
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from keyexpiry.errors import ArgumentError
from keyexpiry.keys import shorten

_INT = re.compile(r"[+-]?\d+\Z")
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


@dataclass(frozen=True, slots=True)
class Converter:
    """Turns one argument between its Python type and its one canonical string inside a key.

    Equal values give equal strings (`5`, `5.0` and `"5"` for an int; `19.9` and `19.90` for a
    Decimal), so `cancel(m, 5.0)` finds the task `create(m, 5)` made.
    """

    type_name: str
    parse: Callable[[str], Any]
    """Key or CLI text to value; ValueError when it is not one."""
    coerce: Callable[[Any], Any]
    """A Python value to the annotated type; TypeError/ValueError when it cannot be one."""
    encode: Callable[[Any], str]
    """A value of the annotated type to its canonical text."""


_MAX_DIGITS = 600
"""More digits than any key can hold (keys are at most 512 bytes): refused before formatting."""


def _kind(value: Any, *types: type) -> Any:
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        huge = isinstance(value, int) and value.bit_length() > 256  # repr may refuse it
        shown = "" if huge else f" {shorten(repr(value), 80)}"
        raise TypeError(f"got {type(value).__name__}{shown}")
    return value


def _parse_int(text: str) -> int:
    if not _INT.match(text) or len(text) > _MAX_DIGITS:
        raise ValueError(f"{text!r} is not an integer (or has too many digits)")
    return int(text)


def _coerce_int(value: Any) -> int:
    _kind(value, int, float, Decimal)
    if isinstance(value, int) and value.bit_length() > _MAX_DIGITS * 3:
        raise ValueError("the integer has too many digits for a task key")
    if isinstance(value, float | Decimal):
        if not value.is_finite() if isinstance(value, Decimal) else not math.isfinite(value):
            raise ValueError(f"{value!r} is not a finite number")
        if value != int(value):
            raise ValueError(f"{value!r} is not a whole number")
        value = int(value)
    return int(value)


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{text!r} is not a boolean (true/false)")


def _coerce_decimal(value: Any) -> Decimal:
    _kind(value, Decimal, int)
    number = Decimal(_coerce_int(value)) if isinstance(value, int) else value
    if not number.is_finite():
        raise ValueError(f"{value!r} is not a finite decimal")
    sign, digits, exponent = number.as_tuple()
    assert isinstance(exponent, int)
    if len(digits) + abs(exponent) > _MAX_DIGITS:
        raise ValueError("the decimal has too many digits for a task key")
    # Trailing zeros carry no value (19.90 == 19.9) and -0 == 0: one value, one key.
    kept = list(digits)
    while exponent < 0 and len(kept) > 1 and kept[-1] == 0:
        kept.pop()
        exponent += 1
    if not any(kept):
        return Decimal(0)
    return Decimal((sign, tuple(kept), exponent))


def _parse_decimal(text: str) -> Decimal:
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise ValueError(f"{text!r} is not a decimal number") from None
    return _coerce_decimal(value)


def _coerce_float(value: Any) -> float:
    _kind(value, float, int)
    try:
        number = float(value)
    except OverflowError:
        raise ValueError("the integer is too large for a float") from None
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not a finite number")
    if isinstance(value, int) and number != value:
        raise ValueError(f"{value} has no exact float value")
    return number + 0.0  # -0.0 becomes 0.0: equal values, one key


def _parse_float(text: str) -> float:
    return _coerce_float(float(text))


def _coerce_date(value: Any) -> dt.date:
    if isinstance(value, dt.datetime):
        raise TypeError("a datetime is not a date (pass .date())")
    return _kind(value, dt.date)  # type: ignore[no-any-return]


CONVERTERS: dict[Any, Converter] = {
    str: Converter("str", str, lambda v: _kind(v, str), str),
    int: Converter("int", _parse_int, _coerce_int, str),
    float: Converter("float", _parse_float, _coerce_float, repr),
    bool: Converter(
        "bool", _parse_bool, lambda v: _kind(v, bool), lambda v: "true" if v else "false"
    ),
    Decimal: Converter("Decimal", _parse_decimal, _coerce_decimal, lambda v: format(v, "f")),
    uuid.UUID: Converter("UUID", uuid.UUID, lambda v: _kind(v, uuid.UUID), str),
    dt.date: Converter("date", dt.date.fromisoformat, _coerce_date, lambda v: v.isoformat()),
}
"""Argument types a task method may annotate; anything else is refused at registration."""


def encode_by_type(label: str, position: int, value: object) -> str:
    """Argument `position` of a task known only by name (`Registry.by_name`), encoded by its
    own type; ArgumentError when no converter takes it."""
    # The exact type: a bool is no int here, a datetime no date (refused, as in a signature).
    conv = CONVERTERS.get(type(value))
    if conv is None:
        names = ", ".join(c.type_name for c in CONVERTERS.values())
        raise ArgumentError(
            f"{label}: argument {position + 1} is a {type(value).__name__}; a task created "
            f"without its handler's code takes {names} (or declare its signature: "
            "keyexpiry.signature)"
        )
    try:
        return conv.encode(conv.coerce(value))
    except (TypeError, ValueError) as exc:  # NaN, infinity
        raise ArgumentError(f"{label}: argument {position + 1}: {shorten(str(exc), 120)}") from None
