"""The PostgreSQL test server is real and controllable: databases, crashes, a hot standby and its
promotion, and libpq's multi-host failover onto it."""

from __future__ import annotations

import contextlib

import psycopg
import pytest
import sqlalchemy as sa

from keyexpiry.bench.servers import LOOPBACK, PostgresServer, wait_until
from tests.conftest import PostgresFactory


def _port_of(conninfo: str) -> int:
    """The port of the server a (multi-host) ``conninfo`` connects to."""
    with psycopg.connect(conninfo, connect_timeout=2) as conn:
        row = conn.execute("SELECT inet_server_port()").fetchone()
    assert row is not None
    return int(row[0])


def _count(server: PostgresServer, db: str) -> int:
    with server.admin_connection(dbname=db) as conn:
        row = conn.execute("SELECT count(*) FROM t").fetchone()
    assert row is not None
    return int(row[0])


def test_postgres_create_insert_select(pg_url: str) -> None:
    assert pg_url.startswith(f"postgresql+psycopg://postgres@{LOOPBACK}:")
    engine = sa.create_engine(pg_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE jobs (id INT PRIMARY KEY, name VARCHAR(50))"))
            conn.execute(
                sa.text("INSERT INTO jobs VALUES (:id, :name)"),
                [{"id": 1, "name": "ä-one"}, {"id": 2, "name": "two"}],
            )
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT id, name FROM jobs ORDER BY id")).all()
            encoding = conn.execute(sa.text("SHOW server_encoding")).scalar_one()
        assert [tuple(row) for row in rows] == [(1, "ä-one"), (2, "two")]
        assert encoding == "UTF8"
    finally:
        engine.dispose()


def test_postgres_drop_database_ends_leaked_sessions(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database("t_leaky")
    assert url.endswith("/t_leaky")
    leaked = postgres_server.admin_connection(dbname="t_leaky", autocommit=False)
    try:
        leaked.execute("CREATE TABLE x (id INT PRIMARY KEY)")
        leaked.execute("INSERT INTO x VALUES (1)")  # an open transaction
        postgres_server.drop_database("t_leaky")
    finally:
        with contextlib.suppress(psycopg.Error):
            leaked.close()
    with postgres_server.admin_connection() as conn:
        row = conn.execute("SELECT count(*) FROM pg_database WHERE datname = 't_leaky'").fetchone()
    assert row == (0,)


def test_postgres_rejects_odd_database_names(postgres_server: PostgresServer) -> None:
    with pytest.raises(ValueError):
        postgres_server.create_database('x"; DROP DATABASE postgres; --')


@pytest.mark.faults
def test_postgres_committed_rows_survive_a_kill(postgres_factory: PostgresFactory) -> None:
    server = postgres_factory(args=["-c", "statement_timeout=5s"])
    port = server.port
    server.create_database("t_crash")
    with server.admin_connection(dbname="t_crash") as conn:
        conn.execute("CREATE TABLE t (id INT PRIMARY KEY)")
        conn.execute("INSERT INTO t VALUES (1)")
    server.kill()
    assert not server.running
    server.start()
    assert server.port == port
    assert _count(server, "t_crash") == 1
    with server.admin_connection() as conn:
        assert conn.execute("SHOW statement_timeout").fetchone() == ("5s",)


@pytest.mark.faults
def test_postgres_replica_follows_then_takes_over(postgres_factory: PostgresFactory) -> None:
    primary = postgres_factory()
    primary.create_database("t_ha")
    with primary.admin_connection(dbname="t_ha") as conn:
        conn.execute("CREATE TABLE t (id INT PRIMARY KEY)")
    replica = postgres_factory(primary=primary)
    assert primary.is_primary()
    assert not replica.is_primary()

    both = (
        f"host={LOOPBACK},{LOOPBACK} port={primary.port},{replica.port} user=postgres"
        " dbname=t_ha target_session_attrs=read-write"
    )
    assert _port_of(both) == primary.port

    with primary.admin_connection(dbname="t_ha") as conn:
        conn.execute("INSERT INTO t VALUES (1)")
    wait_until(lambda: _count(replica, "t_ha") == 1, 30, message="row not replicated")
    with (
        replica.admin_connection(dbname="t_ha") as conn,
        pytest.raises(psycopg.errors.ReadOnlySqlTransaction),
    ):
        conn.execute("INSERT INTO t VALUES (2)")

    primary.kill()
    replica.promote()
    assert replica.is_primary()
    with replica.admin_connection(dbname="t_ha") as conn:
        conn.execute("INSERT INTO t VALUES (2)")
    assert _count(replica, "t_ha") == 2
    assert _port_of(both) == replica.port
