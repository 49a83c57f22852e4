"""sql/time_limit_task.sql and the SQLAlchemy model describe the same table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, inspect, text

from keyexpiry.bench.servers import MariaDBServer, PostgresServer
from keyexpiry.ledger.recurring import ScheduleRow
from keyexpiry.ledger.store import NewTask, Store, TaskStatus, make_engine, metadata
from keyexpiry.schedules.recurrence import Recurrence

DDL = Path(__file__).resolve().parents[1] / "sql" / "time_limit_task.sql"
LISTENER_DDL = DDL.with_name("keyexpiry_listener.sql")
PAUSE_DDL = DDL.with_name("keyexpiry_pause.sql")
SCHEDULE_DDL = DDL.with_name("keyexpiry_schedule.sql")


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
            c.execute(text(PAUSE_DDL.read_text()))
            c.execute(text(SCHEDULE_DDL.read_text()))
        engine.dispose()
        model_engine = create_engine(other)
        metadata.create_all(model_engine)
        model_engine.dispose()
        from_sql = _describe(mysql_url)
        assert len(from_sql[0]) == 21 and len(from_sql[1]) >= 4 and from_sql[2]
        assert "utf8mb4_bin" in from_sql[0]["schedule_name"]
        assert from_sql == _describe(other)
        listeners = _describe(mysql_url, "keyexpiry_listener")
        assert len(listeners[0]) == 8 and listeners[1]
        assert listeners == _describe(other, "keyexpiry_listener")
        pauses = _describe(mysql_url, "keyexpiry_pause")
        assert len(pauses[0]) == 4 and "ascii_bin" in pauses[0]["target"]
        assert pauses == _describe(other, "keyexpiry_pause")
        schedules = _describe(mysql_url, "keyexpiry_schedule")
        assert len(schedules[0]) == 25 and schedules[2] == {"task_key"}
        assert "utf8mb4_bin" in schedules[0]["name"] and "ascii_bin" in schedules[0]["task_key"]
        assert schedules == _describe(other, "keyexpiry_schedule")
    finally:
        mariadb_server.drop_database(other.rsplit("/", 1)[1])


def _commented_statement(path: Path, start: str) -> str:
    """The SQL statement a DDL file's comments show, from the line starting with `start` to its
    semicolon, without the comment marks."""
    lines = [line.removeprefix("--").strip() for line in path.read_text().splitlines()]
    first = next(i for i, line in enumerate(lines) if line.startswith(start))
    last = next(i for i in range(first, len(lines)) if lines[i].endswith(";"))
    return " ".join(lines[first : last + 1]).rstrip(";")


def _schedule_through_the_model(store: Store) -> None:
    """A schedule declared on tables made from the files: its row, and its occurrence's row
    marked with its name (a name any schedule may have: not ASCII)."""
    wanted = ScheduleRow(
        name="reports:eu-🎈", task_key="Report@build@eu", class_name="Report", method="build",
        args=("eu",), recurrence=Recurrence(every_s=60), anchor_ms=1_000, catch_up="latest",
        catch_up_max=100, overlap="skip", retry_schedule_s=None, source="api",
    )  # fmt: skip
    declared = store.declare_schedule(wanted, now_ms=1_000)
    assert (declared.did, declared.arm) == ("created", ("Report@build@eu", 61_000))
    (stored,) = store.list_schedules()
    assert (stored.name, stored.occurrence_ms, stored.paused) == ("reports:eu-🎈", 61_000, False)
    occurrence = store.get("Report@build@eu")
    assert occurrence is not None and occurrence.schedule_name == "reports:eu-🎈"
    assert store.get_schedule("reports:eu-🎈".upper()) is None  # byte for byte


def test_table_from_sql_file_works_through_the_model(mysql_url: str) -> None:
    engine = make_engine(mysql_url)
    with engine.begin() as c:
        c.execute(text(DDL.read_text()))
        c.execute(text(SCHEDULE_DDL.read_text()))
    store = Store(engine)
    store.upsert_pending([NewTask("A@m@0", "A", "m", ("0",), 1000)], 1)  # a ledger in use
    store.create_schema()  # on a ledger from before heartbeats and pauses: adds them, twice
    store.create_schema()
    assert inspect(engine).has_table("keyexpiry_listener")
    assert inspect(engine).has_table("keyexpiry_pause") and store.pauses(0) == []
    assert store.get("A@m@0") is not None and store.listeners() == []
    # The pause the file's comments write by hand, twice (an upsert), read through the model.
    by_hand = _commented_statement(PAUSE_DDL, "INSERT INTO keyexpiry_pause")
    with engine.begin() as c:
        c.execute(text(by_hand))
        c.execute(text(by_hand))
    (pause,) = store.pauses(0)
    assert (pause.target, pause.until_ms, pause.reason) == (
        "OrderTimeout.close_unpaid", None, "payment provider down",
    )  # fmt: skip
    store.upsert_pending([NewTask("A@m@%F0%9F%8E%88", "A", "m", ("🎈",), 1000)], 1)
    (row,) = store.claim(["A@m@%F0%9F%8E%88"], now_ms=1000, lease_until_ms=2000, token="t")
    assert row.args == ("🎈",) and row.status is TaskStatus.RUNNING
    _schedule_through_the_model(store)
    engine.dispose()


PG_DDL = DDL.parent / "postgresql" / "time_limit_task.sql"
PG_LISTENER_DDL = PG_DDL.with_name("keyexpiry_listener.sql")
PG_PAUSE_DDL = PG_DDL.with_name("keyexpiry_pause.sql")
PG_SCHEDULE_DDL = PG_DDL.with_name("keyexpiry_schedule.sql")
PG_FILES = (PG_DDL, PG_LISTENER_DDL, PG_PAUSE_DDL, PG_SCHEDULE_DDL)


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
            for ddl in PG_FILES:
                raw.execute(ddl.read_text())
            for ddl in PG_FILES:  # IF NOT EXISTS: run again, changes nothing
                raw.execute(ddl.read_text())
        engine.dispose()
        model_engine = create_engine(other)
        metadata.create_all(model_engine)
        model_engine.dispose()
        from_sql = _describe(pg_url)
        assert len(from_sql[0]) == 21 and len(from_sql[1]) >= 4 and from_sql[2]
        assert from_sql == _describe(other)
        assert _describe(pg_url, "keyexpiry_listener") == _describe(other, "keyexpiry_listener")
        pauses = _describe(pg_url, "keyexpiry_pause")
        assert len(pauses[0]) == 4 and pauses == _describe(other, "keyexpiry_pause")
        schedules = _describe(pg_url, "keyexpiry_schedule")
        assert len(schedules[0]) == 25 and schedules[2] == {"task_key"}
        assert schedules == _describe(other, "keyexpiry_schedule")
        # Keys and tags compare byte for byte, whatever the database's locale.
        model = create_engine(pg_url)
        columns = inspect(model).get_columns("time_limit_task")
        model.dispose()
        collations = {c["name"]: getattr(c["type"], "collation", None) for c in columns}
        assert collations["task_key"] == collations["tag"] == collations["schedule_name"] == "C"
        model = create_engine(pg_url)
        columns = inspect(model).get_columns("keyexpiry_pause")
        model.dispose()
        assert {c["name"]: getattr(c["type"], "collation", None) for c in columns}["target"] == "C"
        model = create_engine(pg_url)
        columns = inspect(model).get_columns("keyexpiry_schedule")
        model.dispose()
        collations = {c["name"]: getattr(c["type"], "collation", None) for c in columns}
        assert collations["name"] == collations["task_key"] == "C"
    finally:
        postgres_server.drop_database(name)


def test_postgres_table_from_sql_file_works_through_the_model(pg_url: str) -> None:
    engine = make_engine(pg_url)
    with engine.begin() as c:
        raw: Any = c.connection.driver_connection
        raw.execute(PG_DDL.read_text())
        raw.execute(PG_SCHEDULE_DDL.read_text())
    store = Store(engine)
    store.create_schema()  # adds the listeners' and the pauses' tables
    assert inspect(engine).has_table("keyexpiry_listener")
    assert inspect(engine).has_table("keyexpiry_pause") and store.pauses(0) == []
    # The pause the file's comments write by hand, twice (an upsert), read through the model.
    by_hand = _commented_statement(PG_PAUSE_DDL, "INSERT INTO keyexpiry_pause")
    with engine.begin() as c:
        c.execute(text(by_hand))
        c.execute(text(by_hand))
    (pause,) = store.pauses(0)
    assert (pause.target, pause.until_ms, pause.reason) == (
        "OrderTimeout.close_unpaid", None, "payment provider down",
    )  # fmt: skip
    store.upsert_pending([NewTask("A@m@%F0%9F%8E%88", "A", "m", ("🎈",), 1000)], 1)
    (row,) = store.claim(["A@m@%F0%9F%8E%88"], now_ms=1000, lease_until_ms=2000, token="t")
    assert row.args == ("🎈",) and row.status is TaskStatus.RUNNING
    _schedule_through_the_model(store)
    engine.dispose()
