"""In-place, idempotent upgrades of an existing ledger: columns the model has and a table lacks.

`metadata.create_all` creates missing tables but never touches an existing one. A ledger created
by an older keyexpiry gets each later column here, by `ALTER TABLE … ADD COLUMN`, with the
column's default for the rows already there: nothing is rewritten or dropped. Running it again
finds nothing to add. A new column must therefore be nullable or carry a server default.
"""

from __future__ import annotations

from sqlalchemy import Column, Connection, MetaData, Table, inspect, text
from sqlalchemy.schema import CreateColumn

from keyexpiry.table import metadata


def missing_columns(conn: Connection, table: Table) -> list[Column[object]]:
    """The model's columns of `table` that the database's table lacks (none if no table)."""
    insp = inspect(conn)
    if not insp.has_table(table.name):
        return []
    present = {c["name"] for c in insp.get_columns(table.name)}
    return [c for c in table.columns if c.name not in present]


def add_missing_columns(conn: Connection, meta: MetaData = metadata) -> list[str]:
    """Add every missing column of every table in `meta` (keyexpiry's); return the
    `table.column` names added."""
    added: list[str] = []
    for table in meta.sorted_tables:
        for column in missing_columns(conn, table):
            if not column.nullable and column.server_default is None:
                # A model error, caught by tests/test_migrations.py, never by a user.
                raise ValueError(f"{table.name}.{column.name}: new columns need a default")
            ddl = CreateColumn(column).compile(dialect=conn.dialect)
            quoted = conn.dialect.identifier_preparer.quote(table.name)
            conn.execute(text(f"ALTER TABLE {quoted} ADD COLUMN {ddl}"))
            added.append(f"{table.name}.{column.name}")
    return added
