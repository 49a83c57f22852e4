"""`keyexpiry init-db` (Store.create_schema) upgrades a ledger made by an older keyexpiry in
place: missing columns and indexes are added, rows are kept as they were, and a second run changes
nothing."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import BigInteger, Column, Engine, MetaData, Table, inspect, text

from keyexpiry.bench.servers import wait_until
from keyexpiry.flow.pauses import Pause
from keyexpiry.ledger.migrations import (
    add_missing_columns,
    add_missing_indexes,
    drop_retired_indexes,
)
from keyexpiry.ledger.recurring import ScheduleRow
from keyexpiry.ledger.store import NewTask, Store, make_engine
from keyexpiry.ledger.table import keyexpiry_listener, keyexpiry_pause, metadata, time_limit_task
from keyexpiry.schedules.recurrence import Recurrence

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


def _drop_index(engine: Engine, name: str) -> None:
    with engine.begin() as conn:
        if engine.dialect.name in ("mysql", "mariadb"):
            conn.execute(text(f"DROP INDEX {name} ON time_limit_task"))
        else:  # SQLite, PostgreSQL: an index is named in the schema
            conn.execute(text(f"DROP INDEX {name}"))


def _index_names(engine: Engine) -> set[str]:
    return {str(i["name"]) for i in inspect(engine).get_indexes("time_limit_task")}


def test_a_missing_index_is_built_in_place_and_rows_are_kept(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        store = Store(engine)
        store.create_schema()
        store.upsert_pending([NewTask("A@m@1", "A", "m", ("1",), 5_000)], now_ms=1_000)
        _drop_index(engine, "ix_time_limit_task_status_lease")
        assert "ix_time_limit_task_status_lease" not in _index_names(engine)
        assert store.create_schema() == []
        assert "ix_time_limit_task_status_lease" in _index_names(engine)
        row = store.get("A@m@1")
        assert row is not None and (row.due_at_ms, row.args) == (5_000, ("1",))
        with engine.begin() as conn:
            assert add_missing_indexes(conn) == ([], [])  # idempotent
    finally:
        engine.dispose()


def test_on_a_big_table_only_init_db_builds_a_missing_index(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        store = Store(engine)
        store.create_schema()
        store.upsert_pending(
            [NewTask(f"A@m@{i}", "A", "m", (str(i),), 5_000) for i in range(3)], now_ms=1_000
        )
        _drop_index(engine, "ix_time_limit_task_status_finished")
        with engine.begin() as conn:
            # Three rows are "big" when the limit is two: deferred, not built.
            assert add_missing_indexes(conn, max_rows=2) == (
                [], ["ix_time_limit_task_status_finished"],
            )  # fmt: skip
        assert "ix_time_limit_task_status_finished" not in _index_names(engine)
        assert store.create_schema(all_indexes=True) == []
        assert "ix_time_limit_task_status_finished" in _index_names(engine)
    finally:
        engine.dispose()


def _create_index(engine: Engine, name: str, columns: str) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"CREATE INDEX {name} ON time_limit_task ({columns})"))


def test_init_db_drops_retired_indexes_once_their_replacements_exist(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        store = Store(engine)
        store.create_schema()
        store.upsert_pending([NewTask("A@m@1", "A", "m", ("1",), 5_000)], now_ms=1_000)
        # A ledger of an older keyexpiry: the two indexes it had that no query needs now.
        _create_index(engine, "ix_time_limit_task_status_due", "status, due_at_ms")
        _create_index(engine, "ix_time_limit_task_claimed_by", "claimed_by")
        store.create_schema()  # a start: an older listener may still read through them
        assert {"ix_time_limit_task_status_due", "ix_time_limit_task_claimed_by"} <= _index_names(
            engine
        )
        # Without its replacement a retired index stays.
        _drop_index(engine, "ix_time_limit_task_status_lease")
        with engine.begin() as conn:
            assert drop_retired_indexes(conn) == ["ix_time_limit_task_status_due"]
        assert "ix_time_limit_task_claimed_by" in _index_names(engine)
        # init-db builds the replacement, then drops what it replaced; a second run finds nothing.
        assert store.create_schema(all_indexes=True) == []
        names = _index_names(engine)
        assert "ix_time_limit_task_status_lease" in names
        assert not {"ix_time_limit_task_status_due", "ix_time_limit_task_claimed_by"} & names
        with engine.begin() as conn:
            assert drop_retired_indexes(conn) == []
        row = store.get("A@m@1")
        assert row is not None and (row.status, row.due_at_ms, row.args) == (
            "pending",
            5_000,
            ("1",),
        )
    finally:
        engine.dispose()


# time_limit_task as keyexpiry created it before tags and results.
OLD_TASK_DDL = """
CREATE TABLE time_limit_task (
    id               {id},
    task_key         VARCHAR(512) NOT NULL UNIQUE,
    class_name       VARCHAR(128) NOT NULL,
    method           VARCHAR(128) NOT NULL,
    args             TEXT         NOT NULL,
    status           VARCHAR(16)  NOT NULL,
    attempts         INTEGER      NOT NULL,
    retry_schedule_s TEXT         NULL,
    due_at_ms        BIGINT       NOT NULL,
    created_at_ms    BIGINT       NOT NULL,
    updated_at_ms    BIGINT       NOT NULL,
    started_at_ms    BIGINT       NULL,
    finished_at_ms   BIGINT       NULL,
    claimed_by       VARCHAR(96)  NULL,
    lease_until_ms   BIGINT       NULL,
    last_error       TEXT         NULL
)
"""


def test_old_task_table_gains_tag_and_result_and_the_tag_index_and_keeps_its_rows(
    db_url: str,
) -> None:
    engine = make_engine(db_url)
    try:
        id_ddl = {
            "sqlite": "INTEGER PRIMARY KEY",
            "postgresql": "BIGSERIAL PRIMARY KEY",
        }.get(engine.dialect.name, "BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY")
        with engine.begin() as conn:
            conn.execute(text(OLD_TASK_DDL.format(id=id_ddl)))
            conn.execute(
                text(
                    "INSERT INTO time_limit_task VALUES (7, 'A@m@1', 'A', 'm', '[\"1\"]', "
                    "'done', 1, NULL, 5000, 1000, 6000, 5001, 6000, 'h:1:x:1', NULL, NULL)"
                )
            )
        store = Store(engine)
        store.create_schema()
        store.create_schema()  # idempotent: nothing left to add
        columns = {c["name"] for c in inspect(engine).get_columns("time_limit_task")}
        assert {"tag", "result"} <= columns
        assert "ix_time_limit_task_tag" in _index_names(engine)
        row = store.get("A@m@1")
        assert row is not None and (row.id, row.status, row.due_at_ms, row.claimed_by) == (
            7, "done", 5000, "h:1:x:1",
        )  # fmt: skip
        assert row.tag is None and row.result is None
        with engine.begin() as conn:
            assert add_missing_columns(conn) == []
            assert add_missing_indexes(conn) == ([], [])
        # The upgraded table takes tags: a reschedule of the old row with one, listed by it.
        store.upsert_pending([NewTask("A@m@1", "A", "m", ("1",), 9_000, tag="t:1")], now_ms=8_000)
        (tagged,) = store.list_tasks(tag="t:1")
        assert (tagged.id, tagged.status, tagged.tag) == (7, "pending", "t:1")
    finally:
        engine.dispose()


def test_a_ledger_from_before_pauses_gains_their_table_and_keeps_its_rows(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        # The ledger as the release before pauses made it: the tasks' and listeners' tables.
        metadata.create_all(engine, tables=[time_limit_task, keyexpiry_listener])
        store = Store(engine)
        store.upsert_pending([NewTask("A@m@1", "A", "m", ("1",), 5_000)], now_ms=1_000)
        assert not inspect(engine).has_table("keyexpiry_pause")
        assert store.create_schema() == []  # a client or listener start
        assert inspect(engine).has_table("keyexpiry_pause")
        store.pause("A.m", until_ms=None, now_ms=2_000, reason="kept")
        store.create_schema(all_indexes=True)  # init-db later: idempotent, the pause stays
        assert store.pauses(3_000) == [Pause("A.m", None, 2_000, "kept")]
        row = store.get("A@m@1")
        assert row is not None and (row.status, row.due_at_ms) == ("pending", 5_000)
        with engine.begin() as conn:
            assert add_missing_columns(conn) == []
            assert add_missing_indexes(conn) == ([], [])
    finally:
        engine.dispose()


def test_a_ledger_from_before_schedules_gains_their_column_and_table_and_keeps_its_rows(
    db_url: str,
) -> None:
    engine = make_engine(db_url)
    try:
        # The ledger as the release before schedules made it: no schedule table, and no
        # schedule_name in the tasks' table.
        metadata.create_all(engine, tables=[time_limit_task, keyexpiry_listener, keyexpiry_pause])
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE time_limit_task DROP COLUMN schedule_name"))
        store = Store(engine)
        store.upsert_pending([NewTask("A@m@1", "A", "m", ("1",), 5_000)], now_ms=1_000)
        assert not inspect(engine).has_table("keyexpiry_schedule")
        assert store.create_schema() == []  # a client or listener start
        assert inspect(engine).has_table("keyexpiry_schedule")
        columns = {c["name"] for c in inspect(engine).get_columns("time_limit_task")}
        assert "schedule_name" in columns
        row = store.get("A@m@1")
        assert row is not None and (row.status, row.due_at_ms, row.schedule_name) == (
            "pending", 5_000, None,
        )  # fmt: skip
        # The upgraded ledger takes a schedule: its row, and its occurrence's marked with it.
        wanted = ScheduleRow(
            name="daily", task_key="A@m@2", class_name="A", method="m", args=("2",),
            recurrence=Recurrence(cron="0 9 * * *", tz="Europe/Berlin"), anchor_ms=1_000,
            catch_up="latest", catch_up_max=100, overlap="skip", retry_schedule_s=None,
            source="api",
        )  # fmt: skip
        declared = store.declare_schedule(wanted, now_ms=1_000)
        assert declared.did == "created" and declared.arm is not None
        occurrence = store.get("A@m@2")
        assert occurrence is not None and occurrence.schedule_name == "daily"
        store.create_schema(all_indexes=True)  # init-db later: idempotent, the schedule stays
        assert [s.name for s in store.list_schedules()] == ["daily"]
        with engine.begin() as conn:
            assert add_missing_columns(conn) == []
            assert add_missing_indexes(conn) == ([], [])
    finally:
        engine.dispose()


def _valid_indexes(engine: Engine) -> dict[str, bool]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT c.relname, i.indisvalid FROM pg_index i"
                " JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_class t ON t.oid = i.indrelid"
                " WHERE t.relname = 'time_limit_task'"
            )
        ).all()
    return {str(name): bool(valid) for name, valid in rows}


def test_on_postgresql_init_db_builds_a_missing_index_while_writes_go_on(pg_url: str) -> None:
    # A plain CREATE INDEX waits for the table's SHARE lock behind an open writer, and every new
    # write queues behind it; CONCURRENTLY takes a lock writers do not wait for.
    engine = make_engine(pg_url)
    writer = engine.connect()
    try:
        store = Store(engine)
        store.create_schema()
        store.upsert_pending([NewTask("A@m@1", "A", "m", ("1",), 5_000)], now_ms=1_000)
        _drop_index(engine, "ix_time_limit_task_status_finished")
        writer.begin()
        writer.execute(text("UPDATE time_limit_task SET updated_at_ms = 2 WHERE id > 0"))
        built = threading.Thread(target=store.create_schema, kwargs={"all_indexes": True})
        built.start()

        def building() -> bool:
            with engine.connect() as conn:
                return bool(
                    conn.execute(
                        text(
                            "SELECT count(*) FROM pg_stat_activity"
                            " WHERE query LIKE 'CREATE INDEX%' AND wait_event IS NOT NULL"
                        )
                    ).scalar_one()
                )

        wait_until(building, 10)
        with engine.begin() as conn:
            conn.execute(text("SET LOCAL lock_timeout = '3s'"))
            conn.execute(
                text(
                    "INSERT INTO time_limit_task (task_key, class_name, method, args, status,"
                    " attempts, due_at_ms, created_at_ms, updated_at_ms)"
                    " VALUES ('A@m@2', 'A', 'm', '[\"2\"]', 'pending', 0, 6000, 1000, 1000)"
                )
            )
        writer.commit()
        built.join(timeout=30)
        assert not built.is_alive()
        assert _valid_indexes(engine)["ix_time_limit_task_status_finished"] is True
        assert store.get("A@m@2") is not None
    finally:
        writer.close()
        engine.dispose()


def test_on_postgresql_init_db_rebuilds_an_index_a_failed_concurrent_build_left_invalid(
    pg_url: str,
) -> None:
    engine = make_engine(pg_url)
    try:
        store = Store(engine)
        store.create_schema()
        store.upsert_pending(
            [NewTask(f"A@m@{i}", "A", "m", (str(i),), 5_000) for i in range(2)], now_ms=1_000
        )
        _drop_index(engine, "ix_time_limit_task_status_finished")
        # A unique build over duplicates fails half-way and leaves an invalid index behind, with
        # the name the model's index would take.
        autocommit = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        with autocommit as conn, pytest.raises(Exception, match="could not create unique index"):
            conn.execute(
                text(
                    "CREATE UNIQUE INDEX CONCURRENTLY ix_time_limit_task_status_finished"
                    " ON time_limit_task (status)"
                )
            )
        assert _valid_indexes(engine)["ix_time_limit_task_status_finished"] is False
        assert store.create_schema() == []  # a start leaves it: another may be building it
        assert _valid_indexes(engine)["ix_time_limit_task_status_finished"] is False
        assert store.create_schema(all_indexes=True) == []
        assert _valid_indexes(engine)["ix_time_limit_task_status_finished"] is True
        assert len(store.list_tasks()) == 2
    finally:
        engine.dispose()
