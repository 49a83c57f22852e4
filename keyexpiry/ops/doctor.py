"""`keyexpiry doctor`: is this Redis and this database fit to run delayed tasks?"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis
from sqlalchemy import text

from keyexpiry.errors import KeyExpiryError, RedisConfigError
from keyexpiry.ledger.store import Store
from keyexpiry.redis.sentinel import (
    follows_sentinel,
    master_address,
    prepare_replicas,
    sentinel_pool,
)
from keyexpiry.redis.server import (
    check_notifications,
    check_replica_notifications,
    config_value,
    eviction_warning,
)
from keyexpiry.runtime import Runtime


@dataclass(frozen=True)
class Check:
    """One finding: `status` is ok, warn or fail."""

    name: str
    status: str
    detail: str


def run_checks(rt: Runtime, *, fix: bool = False) -> list[Check]:
    """Check Redis and the ledger; with `fix`, turn keyspace notifications on if CONFIG allows."""
    client, store = rt.redis, rt.store
    checks: list[Check] = []
    if follows_sentinel(client):
        checks.extend(_sentinel_checks(client, fix=fix))
    try:
        info = client.info("server")
        checks.append(Check("redis", "ok", f"reachable, version {info.get('redis_version')}"))
    except redis.RedisError as exc:
        checks.append(Check("redis", "fail", f"not reachable: {exc}"))
        info = None
    if info is not None and rt.cluster is not None:
        checks.extend(_cluster_checks(rt, fix=fix))
    elif info is not None:
        try:
            warning = check_notifications(client, configure=fix)
            flags = config_value(client, "notify-keyspace-events")
            if warning:
                checks.append(Check("notifications", "warn", warning))
            else:
                checks.append(Check("notifications", "ok", f"notify-keyspace-events={flags!r}"))
        except RedisConfigError as exc:
            checks.append(Check("notifications", "fail", str(exc)))
        policy = config_value(client, "maxmemory-policy")
        if policy is None:
            checks.append(
                Check("eviction", "warn", "cannot read maxmemory-policy (CONFIG blocked)")
            )
        else:
            warning = eviction_warning(client)
            detail = warning or "maxmemory-policy=noeviction"
            checks.append(Check("eviction", "warn" if warning else "ok", detail))
    try:
        present = store.table_exists()
        checks.append(Check("database", "ok", "reachable"))
        checks.append(
            Check(
                "table",
                "ok" if present else "fail",
                "time_limit_task present" if present else "missing: run `keyexpiry init-db`",
            )
        )
    except KeyExpiryError as exc:
        checks.append(Check("database", "fail", str(exc)))
    checks.append(_clock_check(client, store))
    if any(c.name == "table" and c.status == "ok" for c in checks):
        checks.extend(_registered_checks(rt))
    return checks


def _registered_checks(rt: Runtime) -> list[Check]:
    """Schedules and pending tasks of classes no live listener registers (they wait, silently:
    a typo in a schedule's task, a class gone from the code), and malformed schedule rows."""
    from keyexpiry.schedules.operate import live_classes, unregistered, unregistered_note

    try:
        schedules, problems = rt.store.schedules_and_problems()
        classes = live_classes(rt)
        waiting = {} if classes is None else rt.store.pending_by_class(classes)
    except KeyExpiryError as exc:
        return [Check("schedules", "warn", f"cannot read them: {exc}")]
    checks = [Check("schedules", "warn", problem + " (ignored)") for problem in problems]
    if classes is None:
        return checks
    flagged = unregistered(schedules, classes)
    checks += [
        Check("schedules", "warn", unregistered_note(s, classes))
        for s in schedules
        if s.name in flagged
    ]
    if waiting:
        listed = ", ".join(f"{name} ({n})" for name, n in waiting.items())
        who = "no listener is running" if not classes else "no live listener registers"
        checks.append(Check("tasks", "warn", f"pending tasks wait, {who}: {listed}"))
    if not problems and not flagged and not waiting:
        checks.append(Check("registered", "ok", "every schedule and pending task has a listener"))
    return checks


def _sentinel_checks(client: redis.Redis, *, fix: bool) -> list[Check]:
    """Where the sentinels say the master is, and every replica's notifications: a failover
    promotes one, and it must announce expired keys from its first second as master."""
    pool = sentinel_pool(client)
    service = pool.service_name if pool is not None else "?"
    try:
        host, port = master_address(client)
    except (redis.RedisError, OSError) as exc:
        return [Check("sentinel", "fail", f"no sentinel names a master for {service!r}: {exc}")]
    try:
        findings = prepare_replicas(client, configure=fix)
    except (redis.RedisError, OSError) as exc:
        return [Check("sentinel", "warn", f"master {host}:{port}; replicas unknown ({exc})")]
    checks = [
        Check(
            "sentinel",
            "ok" if findings else "warn",
            f"master {host}:{port} of {service!r}; {len(findings)} replica(s) known"
            + ("" if findings else ": a failover has nowhere to go"),
        )
    ]
    checks += [Check(f.name, f.status, f.detail) for f in findings]
    return checks


def _cluster_checks(rt: Runtime, *, fix: bool) -> list[Check]:
    """Every node of the cluster: notifications on each primary and each replica (a replica
    promoted later must already announce expiries), eviction policy on each primary."""
    assert rt.cluster is not None
    try:
        topology = rt.cluster.topology()
    except redis.RedisError as exc:
        return [Check("cluster", "fail", f"cannot read the slot table: {exc}")]
    checks = [Check("cluster", "ok", f"{len(topology.nodes)} nodes: {topology.describe()}")]
    failures, warnings, evictions = [], [], []
    for address in topology.nodes:
        client = rt.cluster.admin(address)
        try:
            if address in topology.slots:
                warning = check_notifications(client, configure=fix)
                eviction = eviction_warning(client)
                if eviction:
                    evictions.append(f"{address}: {eviction}")
            else:
                warning = check_replica_notifications(client, configure=fix)
                if warning and not fix:
                    failures.append(f"{address} (replica): {warning}")
                    continue
            if warning:
                warnings.append(f"{address}: {warning}")
        except RedisConfigError as exc:
            failures.append(f"{address}: {exc}")
        except redis.RedisError as exc:
            failures.append(f"{address}: not reachable ({exc})")
    if failures:
        checks.append(Check("notifications", "fail", "; ".join(failures)))
    elif warnings:
        checks.append(Check("notifications", "warn", "; ".join(warnings)))
    else:
        checks.append(
            Check(
                "notifications",
                "ok",
                f"expired and evicted announced on all {len(topology.nodes)} nodes",
            )
        )
    checks.append(
        Check("eviction", "warn", "; ".join(evictions))
        if evictions
        else Check("eviction", "ok", "maxmemory-policy=noeviction (or unreadable) on every primary")
    )
    return checks


def _clock_check(client: redis.Redis, store: Store) -> Check:
    host_ms = time.time() * 1000
    parts = []
    try:
        seconds, micros = client.time()
        parts.append(f"redis {seconds * 1000 + micros / 1000 - host_ms:+.0f} ms")
    except redis.RedisError:
        return Check("clock", "warn", "cannot read Redis TIME")
    if store.engine.dialect.name != "sqlite":
        try:
            with store.engine.connect() as conn:
                now_s = (
                    "SELECT EXTRACT(EPOCH FROM clock_timestamp())"
                    if store.engine.dialect.name == "postgresql"
                    else "SELECT UNIX_TIMESTAMP(NOW(3))"
                )
                db_s = conn.execute(text(now_s)).scalar_one()
            parts.append(f"database {float(db_s) * 1000 - host_ms:+.0f} ms")
        except Exception as exc:
            parts.append(f"database unknown ({type(exc).__name__})")
    return Check(
        "clock",
        "ok",
        "offset from this host: "
        + ", ".join(parts)
        + " (due times use Redis's clock, so host skew does not move them)",
    )
