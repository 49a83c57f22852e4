"""Text from outside (a handler's error, a tag, a ledger row written by hand) made safe to print
on a terminal, in the text log and on the dashboard: one place, so no surface forgets one.

Control characters are shown as Python escapes (`\\x1b`, `\\x07`, `\\n`) instead of being sent
raw: an ESC or BEL would drive the reader's terminal, a CR or newline would let the text pass for
a log line or a field of its own. Printable non-ASCII text (names, emoji) is left as it is.
JSON output needs none of this: JSON escapes every control character and keeps the data exact.
"""

from __future__ import annotations

import re

# C0 controls, DEL and the C1 controls (\x9b is a one-byte CSI to some terminals), the Unicode
# line and paragraph separators (a new line to some log viewers) and the bidirectional
# overrides and isolates (text that displays in another order than it reads).
_OTHER_CONTROLS = "\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069"
_ANY_CONTROL = re.compile(f"[\x00-\x1f{_OTHER_CONTROLS}]")
_CONTROL_BUT_NEWLINE = re.compile(f"[\x00-\x09\x0b-\x1f{_OTHER_CONTROLS}]")


def _escaped(match: re.Match[str]) -> str:
    return match.group().encode("unicode_escape").decode("ascii")


def printable(text: str, *, newlines: bool = False) -> str:
    """`text` with every control character escaped (`\\x1b`, `\\n`, `\\u202e`); with
    `newlines`, line breaks are kept (a traceback shown as a block) and the rest escaped."""
    pattern = _CONTROL_BUT_NEWLINE if newlines else _ANY_CONTROL
    if pattern.search(text) is None:  # nearly always: no copy
        return text
    return pattern.sub(_escaped, text)


def printable_lines(text: str, indent: str) -> str:
    """`text` for a block under a label: controls escaped, each line after the first indented
    by `indent`, so no line of it can pass for a line of what surrounds it."""
    return printable(text, newlines=True).replace("\n", "\n" + indent)


def for_html(value: object) -> object:
    """A template value made printable (Jinja's `finalize`, before autoescaping): text gets
    its control characters escaped, line breaks kept (an error's traceback is a block there,
    and HTML gives a line break no power over the page); markup the templates built
    (`Markup`, a subclass of str) and every other value are left as they are."""
    if type(value) is str:
        return printable(value, newlines=True)
    return value
