"""`keyexpiry init-db` (Store.create_schema) upgrades a ledger made by an older keyexpiry in
place: missing columns are added, rows are kept as they were, and a second run changes nothing."""

from __future__ import annotations

import pytest
from sqlalchemy import BigInteger, Column, MetaData, Table, inspect, text

from keyexpiry.migrations import add_missing_columns
from keyexpiry.store import Store, make_engine

# keyexpiry_listener as the first release with heartbeats created it (before partitioning).
OLD_LISTENER_DDL = """
CREATE TABLE keyexpiry_listener (
    id              VARCHAR(96)  NOT NULL,
    host            VARCHAR(255) NOT NULL,
    pid             INTEGER      NOT NULL,
    started_at_ms   BIGINT       NOT NULL,
    heartbeat_at_ms BIGINT       NOT NULL,
    running         INTEGER      NOT NULL,
    PRIMARY KEY (id)
)
"""


def test_old_listener_table_gains_the_new_columns_and_keeps_its_rows(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(OLD_LISTENER_DDL))
            conn.execute(
                text("INSERT INTO keyexpiry_listener VALUES ('h:1:ab', 'h', 1, 1000, 2000, 3)")
            )
        store = Store(engine)
        store.create_schema()
        store.create_schema()  # idempotent: nothing left to add
        columns = {c["name"] for c in inspect(engine).get_columns("keyexpiry_listener")}
        assert {"stopping_at_ms", "classes"} <= columns
        (row,) = store.listeners()
        assert (row.id, row.host, row.pid, row.started_at_ms, row.heartbeat_at_ms, row.running) == (
            "h:1:ab", "h", 1, 1000, 2000, 3,
        )  # fmt: skip
        assert row.classes is None and row.stopping_at_ms is None
        with engine.begin() as conn:
            assert add_missing_columns(conn) == []
    finally:
        engine.dispose()


def test_a_new_column_without_a_default_is_a_model_error(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    meta = MetaData()
    Table("t", meta, Column("a", BigInteger, primary_key=True))
    meta.create_all(engine)
    bad = MetaData()
    Table(
        "t", bad, Column("a", BigInteger, primary_key=True), Column("b", BigInteger, nullable=False)
    )
    try:
        with engine.begin() as conn, pytest.raises(ValueError, match="need a default"):
            add_missing_columns(conn, bad)
    finally:
        engine.dispose()
