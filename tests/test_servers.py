"""Tests of the test infrastructure itself: the servers are real and controllable."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pymysql
import pytest
import redis
import sqlalchemy as sa
from redis.backoff import NoBackoff
from redis.retry import Retry

from keyexpiry.bench.servers import (
    MariaDBServer,
    RedisServer,
    ServerError,
    find_binary,
    free_port,
    wait_until,
)
from tests.conftest import REDIS_SERVER, MariaDBFactory, RedisFactory, _require

ROOT = Path(__file__).resolve().parent.parent


def _no_retry_client(server: RedisServer, timeout_s: float) -> redis.Redis:
    # redis-py 8 retries 10 times with backoff by default, which would hide a timeout.
    return server.client(
        socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
    )


def _process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts: not every PID 1 reaps orphans)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


# -- helpers ---------------------------------------------------------------------------


def test_free_port_is_bindable_and_not_repeated() -> None:
    ports = {free_port() for _ in range(20)}
    assert len(ports) == 20
    assert all(1024 <= port < 65536 for port in ports)


def test_wait_until_returns_and_times_out() -> None:
    calls = iter([False, False, True])
    wait_until(lambda: next(calls), timeout_s=5)
    with pytest.raises(AssertionError, match=r"never true \(timed out after 0.05s\)"):
        wait_until(lambda: False, timeout_s=0.05, message="never true")


def test_require_skips_locally_and_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="not installed"):
        _require("keyexpiry-no-such-server")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI is set"):
        _require("keyexpiry-no-such-server")


# -- Redis -----------------------------------------------------------------------------


def test_redis_expired_key_notification(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    pubsub = client.pubsub()  # type: ignore[no-untyped-call]  # untyped in redis-py 8
    try:
        pubsub.subscribe("__keyevent@0__:expired")
        # Wait for the confirmation: only then is the subscription active server-side,
        # and a key expiring before that would go unnoticed.
        wait_until(
            lambda: pubsub.get_message(timeout=0.05) is not None,
            timeout_s=5,
            message="no subscribe confirmation",
        )
        client.set("job:1", "payload", px=50)
        events: list[bytes] = []

        def expired_event_arrived() -> bool:
            msg = pubsub.get_message(timeout=0.05)
            if msg is not None and msg["type"] == "message":
                events.append(msg["data"])
            return bool(events)

        wait_until(expired_event_arrived, timeout_s=5, message="no expired event")
        assert events == [b"job:1"]
    finally:
        pubsub.close()
        client.close()


def test_redis_url_fixture_gives_a_flushed_server(redis_server: RedisServer) -> None:
    client = redis_server.client()
    try:
        client.set("leftover", "1")
    finally:
        client.close()
    # What the fixture does before every test:
    url = redis_server.url(0)
    client = redis.Redis.from_url(url)
    try:
        client.flushall()
        assert client.dbsize() == 0
        assert client.config_get("notify-keyspace-events") == {"notify-keyspace-events": "xE"}
    finally:
        client.close()


@pytest.mark.faults
def test_redis_restart_keeps_port(redis_server: RedisServer, redis_url: str) -> None:
    port, pid = redis_server.port, redis_server.pid
    redis_server.restart()
    assert redis_server.port == port
    assert redis_server.pid != pid
    assert redis_server.url() == redis_url
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.ping()
    finally:
        client.close()


@pytest.mark.faults
def test_redis_stop_is_idempotent_and_start_again(redis_server: RedisServer) -> None:
    redis_server.stop()
    redis_server.stop()
    assert not redis_server.running
    with pytest.raises(ServerError, match="not running"):
        _ = redis_server.pid
    redis_server.start()
    assert redis_server.running


@pytest.mark.faults
def test_redis_pause_and_resume(redis_server: RedisServer, redis_url: str) -> None:
    client = _no_retry_client(redis_server, 0.2)
    try:
        assert client.ping()
        redis_server.pause()
        try:
            with pytest.raises(redis.TimeoutError):
                client.ping()
        finally:
            redis_server.resume()
        assert client.ping()
    finally:
        client.close()


@pytest.mark.faults
def test_redis_aof_survives_restart_and_kill(redis_factory: RedisFactory) -> None:
    server = redis_factory(args=["--appendonly", "yes"])
    client = _no_retry_client(server, 2)
    try:
        client.set("a", "1")
        server.restart()
        assert client.get("a") == b"1"
        client.set("b", "2")
        # The AOF is written before the reply is sent, so a crash keeps it.
        server.kill()
        assert not server.running
        server.start()
        assert client.mget("a", "b") == [b"1", b"2"]
        # Later args win over the defaults.
        assert client.config_get("appendonly") == {"appendonly": "yes"}
    finally:
        client.close()


@pytest.mark.faults
def test_redis_restart_replaces_args(redis_factory: RedisFactory) -> None:
    server = redis_factory()
    server.restart(args=["--save", "900", "1"])
    client = _no_retry_client(server, 2)
    try:
        assert client.config_get("save") == {"save": "900 1"}
    finally:
        client.close()
    assert server.args == ("--save", "900", "1")


def test_redis_bad_flag_reports_log(tmp_path: Path) -> None:
    binary = _require(REDIS_SERVER)
    server = RedisServer(tmp_path, args=["--no-such-option", "1"], binary=binary)
    with pytest.raises(RuntimeError, match=r"(?s)exited with code.*no-such-option"):
        server.start()
    assert not server.running


def test_redis_port_taken_before_start(tmp_path: Path) -> None:
    binary = _require(REDIS_SERVER)
    auto = RedisServer(tmp_path / "auto", binary=binary)
    taken = auto.port
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", taken))
        blocker.listen()
        # A port we picked ourselves is replaced by another free one...
        with auto:
            assert auto.port != taken
            assert auto.url().endswith(f":{auto.port}/0")
        # ...but a port the caller asked for is an error, with the log in the message.
        fixed = RedisServer(tmp_path / "fixed", port=taken, binary=binary)
        with pytest.raises(RuntimeError, match="already in use"):
            fixed.start()
        assert not fixed.running


# -- MariaDB ---------------------------------------------------------------------------


def test_mariadb_create_insert_select(mysql_url: str) -> None:
    assert mysql_url.startswith("mysql+pymysql://root@127.0.0.1:")
    engine = sa.create_engine(mysql_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text("CREATE TABLE jobs (id INT PRIMARY KEY, name VARCHAR(50)) ENGINE=InnoDB")
            )
            conn.execute(
                sa.text("INSERT INTO jobs VALUES (:id, :name)"),
                [{"id": 1, "name": "ä-one"}, {"id": 2, "name": "two"}],
            )
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT id, name FROM jobs ORDER BY id")).all()
            engine_name = conn.execute(
                sa.text(
                    "SELECT engine FROM information_schema.tables"
                    " WHERE table_schema = DATABASE() AND table_name = 'jobs'"
                )
            ).scalar_one()
        assert [tuple(row) for row in rows] == [(1, "ä-one"), (2, "two")]
        assert engine_name == "InnoDB"
    finally:
        engine.dispose()


def test_mysql_url_is_a_fresh_database(mariadb_server: MariaDBServer, mysql_url: str) -> None:
    name = mysql_url.rsplit("/", 1)[1]
    assert name.startswith("t_") and len(name) == 10
    conn = mariadb_server.admin_connection(database=name)
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW TABLES")
            assert cur.fetchall() == ()
            cur.execute("SELECT @@character_set_database, @@innodb_flush_log_at_trx_commit")
            assert cur.fetchone() == ("utf8mb4", 2)
    finally:
        conn.close()


def test_mariadb_drop_database_kills_leaked_sessions(mariadb_server: MariaDBServer) -> None:
    url = mariadb_server.create_database("t_leaky")
    assert url.endswith("/t_leaky")
    leaked = mariadb_server.admin_connection(database="t_leaky", autocommit=False)
    try:
        with leaked.cursor() as cur:
            cur.execute("CREATE TABLE x (id INT PRIMARY KEY) ENGINE=InnoDB")
            cur.execute("INSERT INTO x VALUES (1)")  # open transaction: metadata lock
        mariadb_server.drop_database("t_leaky")
    finally:
        with contextlib.suppress(pymysql.MySQLError):
            leaked.close()
    admin = mariadb_server.admin_connection()
    try:
        with admin.cursor() as cur:
            cur.execute("SHOW DATABASES LIKE 't_leaky'")
            assert cur.fetchall() == ()
    finally:
        admin.close()


def test_mariadb_rejects_odd_database_names(mariadb_server: MariaDBServer) -> None:
    with pytest.raises(ValueError):
        mariadb_server.create_database("x`; DROP DATABASE mysql; --")


@pytest.mark.faults
def test_mariadb_kill_restart_pause(mariadb_factory: MariaDBFactory) -> None:
    server = mariadb_factory(args=["--innodb-lock-wait-timeout=3"])
    port = server.port
    url = server.create_database("t_faults")
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (id INT PRIMARY KEY) ENGINE=InnoDB"))
            conn.execute(sa.text("INSERT INTO t VALUES (1)"))
        engine.dispose()
        # Committed before a crash: innodb_flush_log_at_trx_commit=2 keeps it.
        server.kill()
        server.start()
        assert server.port == port
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT COUNT(*) FROM t")).scalar_one() == 1
            lock_wait = conn.execute(sa.text("SELECT @@innodb_lock_wait_timeout")).scalar_one()
            assert lock_wait == 3
        engine.dispose()

        server.restart(args=[])
        assert server.port == port

        conn = server.admin_connection(read_timeout=0.3)
        try:
            server.pause()
            try:
                with pytest.raises(pymysql.err.OperationalError), conn.cursor() as cur:
                    cur.execute("SELECT 1")
            finally:
                server.resume()
        finally:
            with contextlib.suppress(pymysql.MySQLError):
                conn.close()
        with engine.connect() as conn2:
            assert conn2.execute(sa.text("SELECT @@innodb_lock_wait_timeout")).scalar_one() == 50
    finally:
        engine.dispose()


# -- both SQL backends -----------------------------------------------------------------


def test_db_url_runs_for_each_backend(db_url: str, request: pytest.FixtureRequest) -> None:
    backend = request.node.callspec.id
    expected_prefix = {
        "sqlite": "sqlite:///",
        "mariadb": "mysql+pymysql://",
        "postgres": "postgresql+psycopg://",
    }[backend]
    assert db_url.startswith(expected_prefix)
    metadata = sa.MetaData()
    table = sa.Table(
        "ledger",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("key", sa.String(100), nullable=False),
    )
    engine = sa.create_engine(db_url)
    try:
        metadata.create_all(engine)
        with engine.begin() as conn:
            conn.execute(table.insert(), [{"key": "a"}, {"key": "b"}])
        with engine.connect() as conn:
            keys = conn.execute(sa.select(table.c.key).order_by(table.c.id)).scalars().all()
        assert keys == ["a", "b"]
    finally:
        engine.dispose()


# -- no process is left behind ---------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from keyexpiry.bench.servers import RedisServer
    server = RedisServer(Path(sys.argv[2]), binary=sys.argv[3])
    server.start()
    print(server.pid, flush=True)
    sys.stdin.readline()  # the test checks that the server runs, then lets us go on
    if sys.argv[4] == "hang":
        sys.stdin.read()  # until the test kills us
    # "exit": leave without stop(); the atexit hook must clean up
    """
)


@contextlib.contextmanager
def _child_subreaper() -> Iterator[None]:
    """Adopt orphaned descendants while the block runs, so the test can reap them.

    Without this the orphan is reparented to PID 1, and not every PID 1 (sandbox
    inits, some containers) reaps zombies, so the test itself would leave one behind.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        pytest.skip(f"prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}")
    try:
        yield
    finally:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


_PR_SET_CHILD_SUBREAPER = 36


def _reaped(pid: int) -> bool:
    """True once ``pid`` is dead and reaped (by us if it was adopted, else by someone)."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        # Not (yet) our child: done only when it has vanished from /proc entirely.
        return not Path(f"/proc/{pid}").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and prctl")
@pytest.mark.parametrize("how", ["exit", "hang"], ids=["atexit", "sigkilled-parent"])
def test_no_server_outlives_the_test_process(tmp_path: Path, how: str) -> None:
    binary = _require(REDIS_SERVER)
    with (
        _child_subreaper(),
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(ROOT), str(tmp_path), binary, how],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as child,
    ):
        assert child.stdout is not None
        pid = int(child.stdout.readline())
        assert not _process_gone(pid)
        if how == "exit":
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        else:
            # SIGKILL: no atexit, no finally. Only PR_SET_PDEATHSIG can clean up.
            child.kill()
        child.wait(timeout=30)
        try:
            wait_until(lambda: _reaped(pid), timeout_s=10, message=f"redis pid {pid} survived")
        except AssertionError:
            # Clean up the survivor (adopted by us, so we can reap it) and fail.
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            raise


def test_find_binary_looks_in_sbin() -> None:
    assert find_binary("sh") is not None
    assert find_binary("keyexpiry-no-such-server") is None
