"""Payloads: a JSON document that travels with a task in its ledger row, never in its key.

`create(..., payload=)` encodes it here, once, with the same rules for every caller: JSON only
(no NaN or infinity, which JSON does not have), valid text (no lone surrogate), nested at most
`limits.MAX_JSON_DEPTH` deep, at most `Settings.payload_max_bytes` bytes.
"""

from __future__ import annotations

import json
from typing import Any

from keyexpiry import limits
from keyexpiry.errors import ArgumentError
from keyexpiry.keys import shorten

_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))

PAYLOAD_PARAMETER = "payload"
"""A handler parameter of this name receives the task's payload, not an argument of its key."""


def encode_payload(value: Any, max_bytes: int) -> str | None:
    """The JSON text stored for `value` (None for None: no payload, or keep the task's);
    ArgumentError for a value that is not JSON-serialisable, holds text that is not valid
    Unicode, nests deeper than `limits.MAX_JSON_DEPTH` or encodes to more than `max_bytes`
    bytes of UTF-8."""
    if value is None:
        return None
    try:
        text = _ENCODER.encode(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ArgumentError(f"payload is not JSON-serialisable: {shorten(str(exc), 200)}") from None
    why = json_refused(text)
    if why is not None:
        raise ArgumentError(f"payload {why}")
    size = len(text) if text.isascii() else len(text.encode())
    if size > max_bytes:
        raise ArgumentError(
            f"payload is {size} bytes of JSON, more than KEYEXPIRY_PAYLOAD_MAX_BYTES ({max_bytes})"
        )
    return text


def json_refused(text: str) -> str | None:
    """Why JSON text keyexpiry encoded (a payload, a result) cannot be stored, or None: text
    that is not valid Unicode (a lone surrogate, from bytes Python could not decode) has no
    UTF-8 for the database, and nesting past `limits.MAX_JSON_DEPTH` could not be read back."""
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError as exc:
            bad = exc.object[exc.start : exc.end]
            return f"is not valid text: it holds a lone surrogate {bad!r} (not encodable as UTF-8)"
    if limits.json_too_deep(text):
        return f"is nested deeper than {limits.MAX_JSON_DEPTH} levels of arrays and objects"
    return None
