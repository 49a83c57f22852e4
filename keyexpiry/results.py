"""Results: a handler's return value, kept with its row as JSON (`result`), capped in size.

Every kind of handler ends through `encode_result`, so what is kept, and the error recorded when
it cannot be, is the same whoever ran it.
"""

from __future__ import annotations

import json
from typing import Any

from keyexpiry.keys import shorten
from keyexpiry.payloads import json_refused

_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False)


def encode_result(value: Any, max_bytes: int) -> tuple[str | None, str | None]:
    """(JSON text, None) for a value to keep; (None, None) for None; (None, why) for a value
    that is not JSON-serialisable, not valid text, nested deeper than `limits.MAX_JSON_DEPTH`
    or encodes to more than `max_bytes` bytes of UTF-8.

    The why is a one-line `result not kept: …` for the row's `last_error`.
    """
    if value is None:
        return None, None
    try:
        text = _ENCODER.encode(value)
    except (TypeError, ValueError, RecursionError) as exc:
        # RecursionError: nested deeper than the interpreter's stack; ValueError: NaN, a
        # circular reference, an int too long to print.
        return None, f"result not kept: not JSON-serialisable: {shorten(str(exc), 200)}"
    why = json_refused(text)
    if why is not None:
        return None, f"result not kept: it {why}"
    size = len(text) if text.isascii() else len(text.encode())
    if size > max_bytes:
        return None, (
            f"result not kept: {size} bytes of JSON, more than KEYEXPIRY_RESULT_MAX_BYTES "
            f"({max_bytes})"
        )
    return text, None
