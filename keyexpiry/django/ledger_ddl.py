"""The ledger's tables as `manage.py migrate` makes them: keyexpiry's own DDL and in-place
upgrade (`ledger/table.py`, `ledger/migrations.py`), run on the migration's connection, so the
schema is `keyexpiry init-db`'s on every engine and a ledger `init-db` made earlier is adopted
with its rows (every step is idempotent: existing tables, columns and indexes are kept)."""

from __future__ import annotations

from typing import Any

from loguru import logger


def create_ledger(apps: Any, schema_editor: Any) -> None:
    """RunPython: create or upgrade the ledger on the `KEYEXPIRY["DATABASE"]` alias only."""
    from keyexpiry.django.connections import joined
    from keyexpiry.django.settings import ledger_alias
    from keyexpiry.ledger.migrations import (
        add_missing_columns,
        add_missing_indexes,
        drop_retired_indexes,
    )
    from keyexpiry.ledger.table import metadata

    connection = schema_editor.connection
    if connection.alias != ledger_alias():
        return  # another database of the project: the ledger is not there
    with joined(connection) as conn:
        metadata.create_all(conn, checkfirst=True)
        for name in add_missing_columns(conn):
            logger.info("ledger upgraded: added column {}", name)
        built, _deferred = add_missing_indexes(conn)
        for name in built:
            logger.info("ledger upgraded: built index {}", name)
        drop_retired_indexes(conn)
