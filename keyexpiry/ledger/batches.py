"""Statements over lists of keys or ids, compiled once per list size (`Prepared`): the sizes
(`list_size`), the padded lists (`padded_lists`) and the bind parameter names of their elements.
Shared by the claims, the outcomes and the `if_exists` creates."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

X = TypeVar("X")

MAX_LIST = 1024
"""The most keys or outcomes one statement names: a bigger batch takes several statements in the
same transaction (SQLite refuses more than 32,766 parameters; fewer sizes to compile)."""

# Bind parameter names of list elements, by position.
KEY_PARAMS = tuple(f"k{i}" for i in range(MAX_LIST))
ID_PARAMS = tuple(f"i{i}" for i in range(MAX_LIST))
TOKEN_PARAMS = tuple(f"t{i}" for i in range(MAX_LIST))
RESULT_PARAMS = tuple(f"r{i}" for i in range(MAX_LIST))


def list_size(n: int) -> int:
    """The list size a statement for `n` values is compiled for: 1, 2, 3, 4, 6, 8, 12, 16, 24, …
    (powers of two and halfway between), so a handful of statements serve every batch and a
    list is padded by at most half."""
    if n <= 4:
        return n
    power = 1 << (n - 1).bit_length()
    return power * 3 // 4 if n <= power * 3 // 4 else power


def padded_lists(values: Sequence[X]) -> Iterator[list[X]]:
    """`values` in lists of at most `MAX_LIST`, each padded to its statement's size with its own
    last value again: a value named twice in an IN list (or a CASE) matches its row once."""
    for start in range(0, len(values), MAX_LIST):
        part = list(values[start : start + MAX_LIST])
        part += part[-1:] * (list_size(len(part)) - len(part))
        yield part
