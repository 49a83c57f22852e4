"""Tags: the one short business key a task may carry (`create(..., tag="order:218")`), by which
business code lists and cancels its tasks; what a tag may be, checked where it enters."""

from __future__ import annotations

from keyexpiry.errors import KeyExpiryError
from keyexpiry.keys import shorten

TAG_MAX_CHARS = 128
"""Longest tag, in characters (the column is VARCHAR(128), indexed)."""


def check_tag(value: object, error: type[KeyExpiryError]) -> str | None:
    """`value` as a tag (None: no tag), else `error` saying what a tag may be.

    A tag is 1 to 128 characters, none of them control characters, and no blank at either end:
    MariaDB's comparisons ignore trailing spaces (`'a' = 'a '`) where SQLite's do not, so such a
    tag would find other tasks on one backend than on the other.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise error(f"tag must be a string, got {type(value).__name__} {shorten(repr(value), 80)}")
    if not value or len(value) > TAG_MAX_CHARS:
        raise error(f"tag must be 1 to {TAG_MAX_CHARS} characters, got {len(value)}")
    if value != value.strip() or not value.isprintable():
        raise error(
            f"tag {shorten(repr(value), 80)} must not start or end with a blank "
            "or hold control characters"
        )
    return value
