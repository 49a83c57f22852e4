"""`keyexpiry doctor`: is this Redis and this database fit to run delayed tasks?"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis
from sqlalchemy import text

from keyexpiry.errors import KeyExpiryError, RedisConfigError
from keyexpiry.redis_server import check_notifications, config_value, eviction_warning
from keyexpiry.runtime import Runtime
from keyexpiry.sentinel import follows_sentinel, master_address, prepare_replicas, sentinel_pool
from keyexpiry.store import Store


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
    if info is not None:
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
                db_s = conn.execute(text("SELECT UNIX_TIMESTAMP(NOW(3))")).scalar_one()
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
