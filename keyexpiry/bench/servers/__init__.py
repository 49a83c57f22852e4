"""Real Redis, MariaDB and PostgreSQL servers (a Galera cluster and HAProxy too) for the test suite
and the benchmark.

Every server runs as a child process on a free loopback port with its files in a caller-supplied
work directory, so tests (and xdist workers) never share state with each other or with anything
installed on the machine. Nothing here sleeps for a fixed time: all waiting goes through
`wait_until`, which polls on a monotonic deadline.
"""

from keyexpiry.bench.servers.galera import GaleraNode, LocalGalera
from keyexpiry.bench.servers.haproxy import HAProxy
from keyexpiry.bench.servers.mariadb import MariaDBServer, lock_waits
from keyexpiry.bench.servers.postgres import PostgresServer, find_bindir
from keyexpiry.bench.servers.process import (
    LOOPBACK,
    ServerError,
    find_binary,
    free_port,
    wait_until,
)
from keyexpiry.bench.servers.redis import RedisServer

__all__ = [
    "LOOPBACK",
    "GaleraNode",
    "HAProxy",
    "LocalGalera",
    "MariaDBServer",
    "PostgresServer",
    "RedisServer",
    "ServerError",
    "find_binary",
    "find_bindir",
    "free_port",
    "lock_waits",
    "wait_until",
]
