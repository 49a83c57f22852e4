"""sql/time_limit_task.sql and the SQLAlchemy model describe the same table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, inspect, text

from keyexpiry.bench.servers import MariaDBServer, PostgresServer
from keyexpiry.ledger.store import NewTask, Store, TaskStatus, make_engine, metadata

DDL = Path(__file__).resolve().parents[1] / "sql" / "time_limit_task.sql"
LISTENER_DDL = DDL.with_name("keyexpiry_listener.sql")


def _describe(
    url: str, table: str = "time_limit_task"
) -> tuple[dict[str, str], set[tuple[str, tuple[str, ...]]], set[str]]:
    engine = create_engine(url)
    try:
        insp = inspect(engine)
        cols = {c["name"]: f"{c['type']!r}|{c['nullable']}" for c in insp.get_columns(table)}
        idx = {
            (i["name"], tuple(str(c) for c in i["column_names"])) for i in insp.get_indexes(table)
        }
        uniq = {
            ",".join(str(c) for c in u["column_names"]) for u in insp.get_unique_constraints(table)
        }
    finally:
        engine.dispose()
    return cols, idx, uniq


def test_sql_file_and_model_create_the_same_table(
    mariadb_server: MariaDBServer, mysql_url: str
) -> None:
    other = mysql_url.rsplit("/", 1)[0] + "/" + mysql_url.rsplit("/", 1)[1] + "_model"
    conn = mariadb_server.admin_connection()
    try:
        conn.cursor().execute(f"CREATE DATABASE `{other.rsplit('/', 1)[1]}`")
    finally:
        conn.close()
    try:
        engine = create_engine(mysql_url)
        with engine.begin() as c:
            c.execute(text(DDL.read_text()))
            c.execute(text(LISTENER_DDL.read_text()))
        engine.dispose()
        model_engine = create_engine(other)
        metadata.create_all(model_engine)
        model_engine.dispose()
        from_sql = _describe(mysql_url)
        assert len(from_sql[0]) == 20 and len(from_sql[1]) >= 4 and from_sql[2]
        assert from_sql == _describe(other)
        listeners = _describe(mysql_url, "keyexpiry_listener")
        assert len(listeners[0]) == 8 and listeners[1]
        assert listeners == _describe(other, "keyexpiry_listener")
    finally:
        mariadb_server.drop_database(other.rsplit("/", 1)[1])


def test_table_from_sql_file_works_through_the_model(mysql_url: str) -> None:
    engine = make_engine(mysql_url)
    with engine.begin() as c:
        c.execute(text(DDL.read_text()))
    store = Store(engine)
    store.upsert_pending([NewTask("A@m@0", "A", "m", ("0",), 1000)], 1)  # a ledger in use
    store.create_schema()  # on a ledger from before heartbeats: adds their table, twice
    store.create_schema()
    assert inspect(engine).has_table("keyexpiry_listener")
    assert store.get("A@m@0") is not None and store.listeners() == []
    store.upsert_pending([NewTask("A@m@%F0%9F%8E%88", "A", "m", ("🎈",), 1000)], 1)
    (row,) = store.claim(["A@m@%F0%9F%8E%88"], now_ms=1000, lease_until_ms=2000, token="t")
    assert row.args == ("🎈",) and row.status is TaskStatus.RUNNING
    engine.dispose()


PG_DDL = DDL.parent / "postgresql" / "time_limit_task.sql"
PG_LISTENER_DDL = PG_DDL.with_name("keyexpiry_listener.sql")


def test_postgres_sql_files_and_model_create_the_same_tables(
    postgres_server: PostgresServer, pg_url: str
) -> None:
    name = pg_url.rsplit("/", 1)[1] + "_model"
    other = postgres_server.create_database(name)
    try:
        engine = create_engine(pg_url)
        with engine.begin() as c:
            # As psql would run the file: no placeholders (its comments hold a `%`).
            raw: Any = c.connection.driver_connection
            for ddl in (PG_DDL, PG_LISTENER_DDL):
                raw.execute(ddl.read_text())
            for ddl in (PG_DDL, PG_LISTENER_DDL):  # IF NOT EXISTS: run again, changes nothing
                raw.execute(ddl.read_text())
        engine.dispose()
        model_engine = create_engine(other)
        metadata.create_all(model_engine)
        model_engine.dispose()
        from_sql = _describe(pg_url)
        assert len(from_sql[0]) == 20 and len(from_sql[1]) >= 4 and from_sql[2]
        assert from_sql == _describe(other)
        assert _describe(pg_url, "keyexpiry_listener") == _describe(other, "keyexpiry_listener")
        # Keys and tags compare byte for byte, whatever the database's locale.
        model = create_engine(pg_url)
        columns = inspect(model).get_columns("time_limit_task")
        model.dispose()
        collations = {c["name"]: getattr(c["type"], "collation", None) for c in columns}
        assert collations["task_key"] == collations["tag"] == "C"
    finally:
        postgres_server.drop_database(name)


def test_postgres_table_from_sql_file_works_through_the_model(pg_url: str) -> None:
    engine = make_engine(pg_url)
    with engine.begin() as c:
        raw: Any = c.connection.driver_connection
        raw.execute(PG_DDL.read_text())
    store = Store(engine)
    store.create_schema()  # adds the listeners' table
    assert inspect(engine).has_table("keyexpiry_listener")
    store.upsert_pending([NewTask("A@m@%F0%9F%8E%88", "A", "m", ("🎈",), 1000)], 1)
    (row,) = store.claim(["A@m@%F0%9F%8E%88"], now_ms=1000, lease_until_ms=2000, token="t")
    assert row.args == ("🎈",) and row.status is TaskStatus.RUNNING
    engine.dispose()
