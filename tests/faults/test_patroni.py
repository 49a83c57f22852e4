"""The ledger on PostgreSQL under Patroni (etcd, a primary and a synchronous standby, HAProxy with
Patroni's health check), as the soak's `patroni-sync` ledger runs it: a client naming both nodes
(`target_session_attrs=read-write`) and one through HAProxy keep creating tasks through each of
the soak's Patroni faults, the primary killed -9 (the standby promoted once the leader key
expires), a switchover and the etcd leader killed -9; every create that returned is on the
primary afterwards (synchronous replication: nothing answered is lost).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from keyexpiry import Client
from keyexpiry.bench.servers.patroni import TTL_S, PatroniCluster
from keyexpiry.errors import KeyExpiryError
from tests import sample_tasks
from tests.conftest import _require, _require_postgres
from tests.ke import make_settings

pytestmark = pytest.mark.faults


@pytest.fixture
def patroni(tmp_path: Path) -> Iterator[PatroniCluster]:
    for binary in ("patroni", "etcd", "haproxy"):
        _require(binary)
    _require_postgres()
    cluster = PatroniCluster(tmp_path / "patroni", synchronous=True)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _create(client: Client, name: str, within_s: float) -> float:
    """Create `name` (a day ahead), retrying while the ledger has no primary; seconds taken."""
    t0 = time.monotonic()
    while True:
        try:
            client.create(sample_tasks.Probe.record, name, ttl_s=86_400)
            return time.monotonic() - t0
        except KeyExpiryError:
            if time.monotonic() - t0 > within_s:
                raise
            time.sleep(0.1)


@pytest.mark.xdist_group("heavy")
def test_creates_go_on_through_patroni_failover_switchover_and_etcd_leader_loss(
    patroni: PatroniCluster, redis_url: str, tmp_path: Path
) -> None:
    url = patroni.create_database("kx")
    multi = Client(make_settings(redis_url, url, tmp_path / "multi"))
    proxied = Client(make_settings(redis_url, patroni.proxy_url("kx"), tmp_path / "proxied"))
    created: list[str] = []
    faults: list[tuple[str, Callable[[], str]]] = [
        ("pg_kill_primary", patroni.kill_primary),
        ("pg_switchover", patroni.switchover),
        ("etcd_leader_lost", patroni.etcd_leader_lost),
    ]
    try:
        for client, via in ((multi, "multi"), (proxied, "proxied")):
            _create(client, f"before-{via}", within_s=10)
            created.append(f"before-{via}")
        for name, fault in faults:
            old = patroni.primary().name
            detail = fault()
            new = patroni.primary().name
            if name == "etcd_leader_lost":
                assert new == old, detail  # Patroni rides out the leader change
            else:
                assert new != old, detail
            for client, via in ((multi, "multi"), (proxied, "proxied")):
                # A new connection finds the new primary once the old one is gone: within the
                # leader key's lifetime and HAProxy's checks.
                took_s = _create(client, f"{name}-{via}", within_s=TTL_S * 3)
                created.append(f"{name}-{via}")
                assert took_s < TTL_S * 3, (name, via, took_s)
        for key in created:
            row = multi.get(sample_tasks.Probe.record, key)
            assert row is not None and row.status == "pending", key
    finally:
        multi.close()
        proxied.close()
