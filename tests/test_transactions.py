"""`tx=`: tasks created and cancelled inside the caller's transaction (SQLite and MariaDB).

The row is written on the caller's connection, the key is set only after that commits, and a
rollback (of the transaction or of a SAVEPOINT) leaves neither behind.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.orm import Session

from keyexpiry import Client, Settings, TaskRequest
from keyexpiry.bench.servers import MariaDBServer, PostgresServer
from keyexpiry.errors import ArgumentError
from keyexpiry.ledger.store import TaskStatus
from keyexpiry.ledger.transactions import pending_for
from tests import sample_tasks
from tests.ke import Running, make_settings, wait_status

StartListener = Callable[[Settings], Running]


@pytest.fixture
def app_engine(client: Client, settings: Settings) -> Iterator[Engine]:
    """The business code's own engine on the ledger's database (not the ledger's engine)."""
    assert settings.database_url is not None
    engine = create_engine(settings.database_url)
    yield engine
    engine.dispose()


def _key_ttl_ms(client: Client, key: str) -> int:
    return int(client.redis.pttl(key))


def _committed_in_another_session(client: Client, key: str) -> bool:
    return client.store.get(key) is not None


def test_commit_writes_the_row_then_arms_the_key_and_the_task_runs(
    client: Client, settings: Settings, app_engine: Engine, start_listener: StartListener
) -> None:
    start_listener(settings)
    with app_engine.begin() as conn:
        key = client.create("Probe.record", "paid", ttl_ms=1500, tx=conn)
        # Inside the transaction: nobody else sees the row, and no key exists yet.
        assert not _committed_in_another_session(client, key)
        assert client.redis.exists(key) == 0
        assert pending_for(conn)
    row = client.store.get(key)
    assert row is not None and row.status is TaskStatus.PENDING
    ttl_ms = _key_ttl_ms(client, key)
    if ttl_ms == -2:  # a machine stalled past 1.5 s: fired already, so claimed or run
        wait_status(client, key, TaskStatus.DONE)
        assert sample_tasks.CALLS[key] == 1
        return
    assert 0 < ttl_ms <= 1500  # armed at the commit
    done = wait_status(client, key, TaskStatus.DONE)
    assert done.attempts == 1 and sample_tasks.CALLS[key] == 1


def test_a_task_due_now_in_a_transaction_runs_only_after_the_commit(
    client: Client, settings: Settings, app_engine: Engine, start_listener: StartListener
) -> None:
    start_listener(settings)
    # The listener runs what is due at once...
    wait_status(client, client.create("Probe.record", "now-before", ttl_ms=0), TaskStatus.DONE)
    with app_engine.begin() as conn:
        key = client.create("Probe.record", "now-paid", ttl_ms=0, tx=conn)
        # ... but this one is not committed: it has no key, and its row is seen by no one else.
        assert client.redis.exists(key) == 0
        assert not _committed_in_another_session(client, key)
        assert sample_tasks.CALLS[key] == 0
    done = wait_status(client, key, TaskStatus.DONE)
    assert done.attempts == 1 and sample_tasks.CALLS[key] == 1


def test_rollback_leaves_no_row_and_no_key(client: Client, app_engine: Engine) -> None:
    with app_engine.connect() as conn:
        key = client.create("Probe.record", "rolled-back", ttl_s=60, tx=conn)
        conn.rollback()
        assert not pending_for(conn)
        conn.execute(text("SELECT 1"))
        conn.commit()  # a later commit of the same connection arms nothing
    assert client.store.get(key) is None
    assert client.redis.exists(key) == 0


def test_an_exception_inside_engine_begin_leaves_nothing(
    client: Client, app_engine: Engine
) -> None:
    key = ""
    with pytest.raises(RuntimeError, match="order failed"), app_engine.begin() as conn:
        key = client.create("Probe.record", "exc", ttl_s=60, tx=conn)
        raise RuntimeError("order failed")
    assert client.store.get(key) is None
    assert client.redis.exists(key) == 0


def test_a_connection_not_yet_in_a_transaction_begins_one_committed_by_the_caller(
    client: Client, app_engine: Engine
) -> None:
    with app_engine.connect() as conn:
        assert not conn.in_transaction()
        key = client.create("Probe.record", "autobegun", ttl_s=60, tx=conn)
        assert conn.in_transaction()
        assert client.redis.exists(key) == 0
        conn.commit()
        assert 59_000 < _key_ttl_ms(client, key) <= 60_000
    with app_engine.connect() as conn:
        other = client.create("Probe.record", "never-committed", ttl_s=60, tx=conn)
    # Closing without a commit rolls back, as for any statement.
    assert client.store.get(other) is None and client.redis.exists(other) == 0


def test_session_commit_and_rollback(client: Client, app_engine: Engine) -> None:
    with Session(app_engine) as session:
        kept = client.create("Probe.record", "session-commit", ttl_s=60, tx=session)
        assert client.redis.exists(kept) == 0
        session.commit()
        assert client.redis.exists(kept) == 1
        dropped = client.create("Probe.record", "session-rollback", ttl_s=60, tx=session)
        session.rollback()
        # The next transaction of the same session commits without arming anything.
        again = client.create("Probe.record", "session-again", ttl_s=60, tx=session)
        session.commit()
    assert client.store.get(dropped) is None and client.redis.exists(dropped) == 0
    assert client.redis.exists(again) == 1


def _ttl_is_due(client: Client, key: str, due_at_ms: int) -> bool:
    """Whether `key` expires at `due_at_ms`, within a second: measured from now, not from the
    create, which a loaded machine may have made seconds ago."""
    remaining_ms = due_at_ms - int(time.time() * 1000)
    return abs(_key_ttl_ms(client, key) - remaining_ms) < 1000


def test_create_many_in_a_transaction(client: Client, app_engine: Engine) -> None:
    with app_engine.begin() as conn:
        keys = client.create_many(
            [TaskRequest("Probe.record", (f"m{i}",), ttl_s=60 + i) for i in range(5)], tx=conn
        )
        assert sum(client.redis.exists(k) for k in keys) == 0
    for i, key in enumerate(keys):
        assert (60 + i) * 1000 - 1000 < _key_ttl_ms(client, key) <= (60 + i) * 1000


def test_cancel_in_a_transaction_then_rollback_keeps_the_task(
    client: Client, app_engine: Engine
) -> None:
    key = client.create("Probe.record", "keep-me", ttl_s=60)
    with app_engine.connect() as conn:
        assert client.cancel("Probe.record", "keep-me", tx=conn) is True
        assert client.redis.exists(key) == 1  # deleted only at the commit
        conn.rollback()
    row = client.store.get(key)
    assert row is not None and row.status is TaskStatus.PENDING
    assert _ttl_is_due(client, key, row.due_at_ms)

    with app_engine.begin() as conn:
        assert client.cancel("Probe.record", "keep-me", tx=conn) is True
    row = client.store.get(key)
    assert row is not None and row.status is TaskStatus.CANCELLED
    assert client.redis.exists(key) == 0


def test_a_rolled_back_savepoint_undoes_its_tasks_and_keeps_the_old_due_time(
    client: Client, app_engine: Engine
) -> None:
    key = client.create("Probe.record", "sp", ttl_s=60)
    with app_engine.begin() as conn:
        fresh = client.create("Probe.record", "sp-new", ttl_s=30, tx=conn)
        savepoint = conn.begin_nested()
        client.create("Probe.record", "sp", ttl_s=600, tx=conn)  # reschedule, then undo it
        gone = client.create("Probe.record", "sp-gone", ttl_s=30, tx=conn)
        savepoint.rollback()
    row = client.store.get(key)
    assert row is not None and row.due_at_ms - row.created_at_ms == 60_000
    assert _ttl_is_due(client, key, row.due_at_ms)  # not the undone 600 s
    assert client.store.get(gone) is None and client.redis.exists(gone) == 0
    assert client.redis.exists(fresh) == 1


def test_a_cancel_undone_by_its_savepoint_keeps_the_key(client: Client, app_engine: Engine) -> None:
    key = client.create("Probe.record", "sp-cancel", ttl_s=60)
    with app_engine.begin() as conn:
        savepoint = conn.begin_nested()
        assert client.cancel("Probe.record", "sp-cancel", tx=conn)
        savepoint.rollback()
    row = client.store.get(key)
    assert row is not None and row.status is TaskStatus.PENDING
    assert client.redis.exists(key) == 1


def test_a_connection_to_another_database_is_refused(client: Client, tmp_path: Path) -> None:
    other = create_engine(f"sqlite:///{tmp_path / 'business.sqlite3'}")
    try:
        with other.begin() as conn, pytest.raises(ArgumentError, match="another database"):
            client.create("Probe.record", "elsewhere", ttl_s=60, tx=conn)
    finally:
        other.dispose()


def test_another_database_on_the_same_mariadb_server_is_refused(
    mariadb_server: MariaDBServer, mysql_url: str, redis_url: str, tmp_path: Path
) -> None:
    name = f"t_{secrets.token_hex(4)}"
    other = create_engine(mariadb_server.create_database(name))
    try:
        with (
            Client(make_settings(redis_url, mysql_url, tmp_path)) as client,
            other.begin() as conn,
            pytest.raises(ArgumentError, match="another database"),
        ):
            client.create("Probe.record", "x", ttl_s=60, tx=conn)
    finally:
        other.dispose()
        mariadb_server.drop_database(name)


def test_what_is_not_a_transaction_is_refused(client: Client, app_engine: Engine) -> None:
    with pytest.raises(ArgumentError, match="Connection or Session"):
        client.create("Probe.record", "x", ttl_s=60, tx=app_engine)  # type: ignore[arg-type]
    auto = app_engine.execution_options(isolation_level="AUTOCOMMIT")
    with auto.connect() as conn, pytest.raises(ArgumentError, match="AUTOCOMMIT"):
        client.create("Probe.record", "x", ttl_s=60, tx=conn)
    conn2: Connection
    with app_engine.connect() as conn2:
        pass
    with pytest.raises(ArgumentError, match="closed"):
        client.create("Probe.record", "x", ttl_s=60, tx=conn2)


def test_the_ledgers_own_engine_works_as_tx(client: Client) -> None:
    with client.store.engine.begin() as conn:
        key = client.create("Probe.record", "own-engine", ttl_s=60, tx=conn)
    assert client.redis.exists(key) == 1


def test_rows_committed_without_their_key_are_armed_by_the_listener(
    client: Client,
    settings: Settings,
    app_engine: Engine,
    start_listener: StartListener,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The process dying between the commit and the arming, simulated by an arming that fails
    (Redis unreachable at that moment): the commit stands, the row is pending without a key,
    and the listener's overdue check (every `lease_check_s`, rows due `stuck_after_s` ago)
    arms it."""
    start_listener(settings)

    def redis_gone(*_: object, **__: object) -> None:
        raise ConnectionError("Redis went away after the commit")

    monkeypatch.setattr(client.rt, "arm", redis_gone)
    with app_engine.begin() as conn:
        key = client.create("Probe.record", "orphan", ttl_ms=100, tx=conn)
    row = client.store.get(key)
    assert row is not None and row.status is TaskStatus.PENDING
    assert client.redis.exists(key) == 0
    done = wait_status(client, key, TaskStatus.DONE, timeout_s=10)
    assert done.started_at_ms is not None
    late_ms = done.started_at_ms - done.due_at_ms
    # stuck_after_s (0.5 s) + lease_check_s (0.3 s) in these settings, plus scheduling slack.
    assert late_ms < settings.stuck_after_s * 1000 + settings.lease_check_s * 1000 + 3000


def test_a_session_joined_to_an_outer_transaction_arms_at_the_outer_commit(
    client: Client, app_engine: Engine
) -> None:
    """The test-suite pattern: a Session bound to a Connection already in a transaction. Its
    commit() commits nothing (the outer transaction does), so nothing is armed until then."""
    with app_engine.connect() as conn:
        outer = conn.begin()
        with Session(bind=conn) as session:
            key = client.create("Probe.record", "joined", ttl_s=60, tx=session)
            session.commit()
            assert client.redis.exists(key) == 0 and client.store.get(key) is None
        outer.commit()
    assert client.redis.exists(key) == 1


def test_another_database_on_the_same_postgres_server_is_refused(
    postgres_server: PostgresServer, pg_url: str, redis_url: str, tmp_path: Path
) -> None:
    name = f"t_{secrets.token_hex(4)}"
    other = create_engine(postgres_server.create_database(name))
    try:
        with Client(make_settings(redis_url, pg_url, tmp_path)) as client:
            with other.begin() as conn, pytest.raises(ArgumentError, match="another database"):
                client.create("Probe.record", "x", ttl_s=60, tx=conn)
            # The same database by another URL (a host name for the address) is the ledger's.
            same = create_engine(pg_url.replace("127.0.0.1", "localhost"))
            with same.begin() as conn:
                key = client.create("Probe.record", "y", ttl_s=60, tx=conn)
            same.dispose()
            assert client.store.get(key) is not None
    finally:
        other.dispose()
        postgres_server.drop_database(name)
