"""The base of every ledger query: one transaction per call, driver errors turned into
StoreError (disconnected, lock timeout), and the once-more retry that is safe for all of them."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from keyexpiry.errors import StoreError
from keyexpiry.settings import mask_url
from keyexpiry.table import upsert_statement

R = TypeVar("R")


_MYSQL_LOCK_WAIT_TIMEOUT = 1205  # ER_LOCK_WAIT_TIMEOUT: only the statement was rolled back


def _error_code(exc: SQLAlchemyError) -> int | None:
    """The MySQL/MariaDB error number behind `exc` (PyMySQL puts it first in `args`)."""
    args = getattr(getattr(exc, "orig", None), "args", ())
    return args[0] if args and isinstance(args[0], int) else None


# InnoDB deadlock: the server rolled the transaction back and expects the client to run it again
# (a create rescheduling a key deadlocks with a claim of the same row). A lock wait timeout is
# not retried here: the claimer splits its batch around the locked row instead.
_ROLLED_BACK_BY_SERVER = {1213}


def _rolled_back_by_server(exc: StoreError) -> bool:
    args: tuple[object, ...] = getattr(getattr(exc.__cause__, "orig", None), "args", ())
    return bool(args) and args[0] in _ROLLED_BACK_BY_SERVER


def retried_once(method: Callable[..., R]) -> Callable[..., R]:
    """Run a Store method once more when its connection turned out to be dead, or MariaDB chose
    it as a deadlock's victim.

    Safe because every method is idempotent or keyed by a claim token: a claim repeated after an
    ambiguous commit finds its rows by token, a repeated record or cancel changes nothing more.
    """

    @functools.wraps(method)
    def wrapper(self: Ledger, *args: Any, **kwargs: Any) -> R:
        try:
            return method(self, *args, **kwargs)
        except StoreError as exc:
            if not (exc.disconnected or _rolled_back_by_server(exc)):
                raise
            return method(self, *args, **kwargs)

    return wrapper


class Ledger:
    """An engine on `time_limit_task` and the transaction every query runs in."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._upsert = upsert_statement(engine.dialect.name)
        self._url = mask_url(engine.url.render_as_string(hide_password=True))
        self._schema_lock = threading.Lock()

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        try:
            with self.engine.begin() as conn:
                yield conn
        except SQLAlchemyError as exc:
            detail = str(getattr(exc, "orig", None) or exc).splitlines()[0][:300]
            error = StoreError(f"database {self._url}: {detail}")
            error.disconnected = bool(getattr(exc, "connection_invalidated", False))
            error.lock_timeout = _error_code(exc) == _MYSQL_LOCK_WAIT_TIMEOUT
            raise error from exc


def like_prefix(text: str) -> str:
    """A LIKE pattern (with `escape="\\"`) matching strings that start with `text`, its own
    `%` and `_` taken literally: a prefix range of an index, never a wildcard from a user."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
