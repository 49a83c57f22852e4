"""In-place, idempotent upgrades of an existing ledger: columns and indexes the model has and a
table lacks.

`metadata.create_all` creates missing tables but never touches an existing one. A ledger created
by an older keyexpiry gets each later column here, by `ALTER TABLE … ADD COLUMN`, with the
column's default for the rows already there: nothing is rewritten or dropped. Running it again
finds nothing to add. A new column must therefore be nullable or carry a server default.
Indexes are added the same way, by name; on a big table only `keyexpiry init-db` builds them (on
PostgreSQL concurrently, so that writes go on).
An index a later version no longer needs is dropped only by `keyexpiry init-db`, and only once the
index that replaced it exists: until every listener runs the new version, an old one may still
read through it.
"""

from __future__ import annotations

import re

from loguru import logger
from sqlalchemy import Column, Connection, Index, Integer, MetaData, Table, inspect, text
from sqlalchemy.schema import CreateColumn, CreateIndex

from keyexpiry.ledger.table import RETIRED_INDEXES, T, index_on, metadata


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


BUILD_ON_START_MAX_ROWS = 100_000
"""Above this many rows a missing index is built only by `keyexpiry init-db`, never by a client
or listener start: building one on millions of rows takes minutes, which a web process's first
request or a listener's restart must not wait for."""


def missing_indexes(conn: Connection, table: Table) -> list[Index]:
    """The model's indexes of `table` that the database's table lacks, by name (none if no
    table). Indexes are compared by name only: keyexpiry never renames one."""
    insp = inspect(conn)
    if not insp.has_table(table.name):
        return []
    present = {i["name"] for i in insp.get_indexes(table.name)}
    return [
        i
        for i in sorted(table.indexes, key=lambda i: str(i.name))
        if i.name not in present and index_on(str(i.name), conn.dialect)
    ]


def rows_upper_bound(conn: Connection, table: Table) -> int:
    """A cheap upper bound of the rows in `table`: its largest id (a primary-key lookup), or 0
    for a table without an integer `id`."""
    id_column = table.columns.get("id")
    if id_column is None or not isinstance(id_column.type, Integer):
        return 0
    quoted = conn.dialect.identifier_preparer.quote(table.name)
    return int(conn.execute(text(f"SELECT COALESCE(MAX(id), 0) FROM {quoted}")).scalar_one())


def add_missing_indexes(
    conn: Connection,
    meta: MetaData = metadata,
    *,
    max_rows: int | None = None,
    concurrently: bool = False,
) -> tuple[list[str], list[str]]:
    """Create every missing index of every table in `meta`; return (built, deferred) index names.

    An index of a table with more than `max_rows` rows (None: no limit) is deferred, not built:
    the caller says so and `keyexpiry init-db` builds it. InnoDB builds a secondary index online
    (reads and writes go on meanwhile); SQLite locks the file while it builds. On PostgreSQL a
    plain CREATE INDEX blocks every write to the table until it is built: with `concurrently`
    (`conn` must then be in autocommit: PostgreSQL refuses it inside a transaction) it is
    built with CREATE INDEX CONCURRENTLY, which lets writes go on, and said before it starts.
    """
    built: list[str] = []
    deferred: list[str] = []
    for table in meta.sorted_tables:
        missing = missing_indexes(conn, table)
        if not missing:
            continue
        too_big = max_rows is not None and rows_upper_bound(conn, table) > max_rows
        for index in missing:
            if too_big:
                deferred.append(str(index.name))
                continue
            if concurrently:
                logger.info(
                    "building index {} on {} concurrently: writes go on meanwhile (a big table "
                    "takes minutes)",
                    index.name,
                    table.name,
                )
                ddl = str(CreateIndex(index).compile(dialect=conn.dialect))
                conn.execute(text(re.sub(r"^CREATE (UNIQUE )?INDEX ", _CONCURRENT, ddl)))
            else:
                index.create(conn)
            built.append(str(index.name))
    return built, deferred


_CONCURRENT = r"CREATE \1INDEX CONCURRENTLY "


def drop_invalid_indexes(conn: Connection, meta: MetaData = metadata) -> list[str]:
    """PostgreSQL: drop the indexes of `meta`'s tables left invalid by a concurrent build that
    failed or was interrupted (its name is taken, so it would never be built again, and an
    invalid index is never used yet slows every write); return their names. Only `keyexpiry
    init-db` calls it: an invalid index may also be one another process is building right now."""
    names = [str(t.name) for t in meta.sorted_tables]
    rows = conn.execute(
        text(
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " JOIN pg_class t ON t.oid = i.indrelid"
            " WHERE NOT i.indisvalid AND t.relname = ANY(:tables)"
            " AND t.relnamespace = to_regnamespace(current_schema())::oid"
        ),
        {"tables": names},
    ).all()
    dropped: list[str] = []
    quote = conn.dialect.identifier_preparer.quote
    for (name,) in rows:
        logger.warning("dropping index {}: left invalid by a build that did not finish", name)
        conn.execute(text(f"DROP INDEX CONCURRENTLY IF EXISTS {quote(name)}"))
        dropped.append(str(name))
    return dropped


def drop_retired_indexes(conn: Connection, retired: dict[str, str] | None = None) -> list[str]:
    """Drop each index of `time_limit_task` named in `retired` (default `RETIRED_INDEXES`) whose
    replacement the table has; return the names dropped. Dropping a secondary index is quick on
    InnoDB (in place, no copy) and SQLite; rows are untouched."""
    retired = RETIRED_INDEXES if retired is None else retired
    insp = inspect(conn)
    if not insp.has_table(T.name):
        return []
    present = {i["name"] for i in insp.get_indexes(T.name)}
    dropped: list[str] = []
    for name, replacement in sorted(retired.items()):
        if name in present and replacement in present:
            quote = conn.dialect.identifier_preparer.quote
            # MySQL/MariaDB name an index within its table; SQLite and PostgreSQL, the schema.
            on_table = f" ON {quote(T.name)}" if conn.dialect.name in ("mysql", "mariadb") else ""
            conn.execute(text(f"DROP INDEX {quote(name)}{on_table}"))
            dropped.append(name)
    return dropped
