"""Statements over lists of keys or ids, compiled once per list size (`Prepared`): the sizes
(`list_size`), the padded lists (`padded_lists`) and the bind parameter names of their elements.
Shared by the claims, the outcomes and the `if_exists` creates. On PostgreSQL the hot ones bind
each list as one array instead (`array_param`).

psycopg parses a query of more than 50 parameters or 4 KB again at every execution (its cache
takes none bigger), which a statement of a few hundred named elements always is; one array
parameter keeps the statement short, and one statement serves every size."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, bindparam, cast, literal_column
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql.elements import Grouping
from sqlalchemy.types import TypeEngine

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


def array_param(name: str, item_type: TypeEngine[Any]) -> ColumnElement[Any]:
    """`(CAST(%(name)s AS item_type[]))`: a list bound as one PostgreSQL array (in parentheses:
    `CAST(…)[i]` is no SQL, `(CAST(…))[i]` is)."""
    return Grouping(cast(bindparam(name), ARRAY(item_type)))


def unindexed(column: Any) -> Any:
    """`column || ''` or `column + 0`: the same value, in an expression no index matches.

    PostgreSQL's planner chooses among indexes by its statistics, which a wave of new rows has
    not reached yet: it took a `status`-led index for "a handful of pending rows" and walked
    thousands. A hot statement whose rows are found by id or key checks their status (and due
    time) this way, leaving the planner that one index path."""
    if column.type.python_type is str:
        return column.op("||")(literal_column("''"))
    return column.op("+")(literal_column("0"))
