"""The test suite's database pool: databases made ahead are fresh, a database given back has
its sessions ended at once and is dropped behind, and closing drops what is left."""

from __future__ import annotations

import secrets

import pymysql
import pytest

from keyexpiry.bench.servers import MariaDBServer, wait_until
from keyexpiry.bench.servers.pool import DatabasePool


def _databases(server: MariaDBServer) -> set[str]:
    conn = server.admin_connection()
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW DATABASES LIKE 'p\\\\_%'")
            return {row[0] for row in cur.fetchall()}
    finally:
        conn.close()


def test_a_pool_hands_out_fresh_databases_and_drops_them_behind(
    mariadb_server: MariaDBServer,
) -> None:
    pool = DatabasePool(mariadb_server, lambda: f"p_{secrets.token_hex(4)}", ahead=2)
    try:
        wait_until(lambda: len(_databases(mariadb_server)) == 2, 10)  # made ahead
        name = pool.take()
        leaked = pymysql.connect(
            host="127.0.0.1", port=mariadb_server.port, user="root", database=name
        )
        with leaked.cursor() as cur:
            cur.execute("SHOW TABLES")
            assert cur.fetchall() == ()  # empty
            cur.execute("CREATE TABLE t (i INT) ENGINE=InnoDB")
            cur.execute("BEGIN")
            cur.execute("INSERT INTO t VALUES (1)")  # a transaction left open by the test
        pool.give_back(name)
        # Its session was ended at once, not when the database is dropped.
        with pytest.raises(pymysql.err.OperationalError), leaked.cursor() as cur:
            cur.execute("SELECT 1")
        wait_until(lambda: name not in _databases(mariadb_server), 10)
        again = pool.take()
        assert again != name
        pool.give_back(again)
    finally:
        pool.close()
    assert _databases(mariadb_server) == set()
