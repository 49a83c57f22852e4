"""What keyexpiry needs of a Redis server, checked: notifications on, a master, channels it may
subscribe to, no eviction; and failures described in one line. Used by the listener and doctor."""

from __future__ import annotations

from typing import Any

import redis
from loguru import logger

from keyexpiry.clock import monotonic_s
from keyexpiry.errors import RedisConfigError

REPLICA_PROBLEM = (
    "Redis is a replica: replicas never announce expired keys and refuse writes; point "
    "keyexpiry at the master"
)


def config_value(client: redis.Redis, name: str) -> str | None:
    """A server setting read with CONFIG GET; None when CONFIG is blocked (managed Redis)."""
    try:
        values: dict[Any, Any] = client.config_get(name)
    except redis.ResponseError:
        return None
    for k, v in values.items():
        if (k.decode() if isinstance(k, bytes) else k) == name:
            return v.decode() if isinstance(v, bytes) else str(v)
    return ""


def check_notifications(client: redis.Redis, *, configure: bool) -> str | None:
    """Make sure Redis announces expired keys; return a warning if that cannot be verified.

    With `configure`, turn on what is missing of `E`, `x` and `e` (evicted keys) by CONFIG SET.

    Raises RedisConfigError when notifications are off (and `configure` is false) or when the
    server is a replica (replicas announce `del`, not `expired`).
    """
    try:
        role = client.execute_command("ROLE")[0]  # type: ignore[no-untyped-call]
        if role in (b"slave", "slave", b"replica", "replica"):
            raise RedisConfigError(REPLICA_PROBLEM)
    except redis.ResponseError:
        pass  # ROLE blocked by ACL: nothing to learn
    return notification_flags(client, configure=configure)


def notification_flags(client: redis.Redis, *, configure: bool, where: str = "Redis") -> str | None:
    """The `notify-keyspace-events` part of `check_notifications`, for any node (`where` names
    it in messages): a warning if CONFIG cannot be read, RedisConfigError if E or x is missing
    and `configure` is false."""
    text = config_value(client, "notify-keyspace-events")
    if text is None:
        return (
            "cannot read CONFIG (blocked, as on managed Redis); make sure the server's "
            "notify-keyspace-events includes E and x (e.g. 'Ex'), set in its parameter group"
        )
    has_x = "x" in text or "A" in text
    # `e` too: an evicted task key is then re-armed at once instead of at the overdue check.
    has_e = "e" in text or "A" in text
    announces_expired = "E" in text and has_x
    if announces_expired and (has_e or not configure):
        return None
    if not configure:
        raise RedisConfigError(
            f"{where} keyspace notifications are {text!r}, which lacks E and/or x: expired events "
            "would never arrive. Run `keyexpiry doctor --fix`, pass --configure-redis, or set "
            "notify-keyspace-events Ex in redis.conf"
        )
    wanted = text + ("" if "E" in text else "E") + ("" if has_x else "x") + ("" if has_e else "e")
    client.config_set("notify-keyspace-events", wanted)
    on = "" if where == "Redis" else f" on {where}"
    logger.warning("set notify-keyspace-events{} to {!r} (was {!r})", on, wanted, text)
    return None


def subscribe_confirmed(pubsub: Any, channels: list[str], *, timeout_s: float = 10.0) -> None:
    """Subscribe `pubsub` to `channels` and wait for Redis to confirm each one.

    Raises RedisConfigError when the ACL user may not use the channels (NOPERM): retrying cannot
    help, and the listener would otherwise loop on it.
    """
    try:
        pubsub.subscribe(*channels)
        confirmed = 0
        deadline = monotonic_s() + timeout_s
        while confirmed < len(channels):
            if monotonic_s() > deadline:
                raise redis.TimeoutError(f"no subscribe confirmation within {timeout_s:g} s")
            msg = pubsub.get_message(timeout=max(0.0, min(0.5, deadline - monotonic_s())))
            if msg is not None and msg.get("type") == "subscribe":
                confirmed += 1
    except redis.exceptions.NoPermissionError as exc:
        user = pubsub.connection_pool.connection_kwargs.get("username") or "default"
        grants = " ".join(f"&{c}" for c in channels)
        raise RedisConfigError(
            f"Redis ACL user {user!r} may not subscribe to {', '.join(channels)} ({exc}); grant "
            f"the channels, e.g. `ACL SETUSER {user} {grants}` (or `&*`)"
        ) from None


def eviction_warning(client: redis.Redis) -> str | None:
    """What to say when the server may evict task keys (announced as `evicted`, never
    `expired`); None under noeviction or when CONFIG cannot be read."""
    policy = config_value(client, "maxmemory-policy")
    if policy is None or policy == "noeviction":
        return None
    flags = config_value(client, "notify-keyspace-events") or ""
    recovery = (
        "the listener re-arms them on the `evicted` event"
        if "e" in flags or "A" in flags
        else "without `e` in notify-keyspace-events (doctor --fix adds it) the overdue check "
        "recovers them, late"
    )
    return (
        f"maxmemory-policy={policy}: task keys may be evicted (announced as `evicted`, not "
        f"`expired`); {recovery}. Prefer noeviction"
    )


def describe_redis_error(exc: redis.RedisError) -> str:
    """One line saying what a Redis failure means for the user (never the password)."""
    if isinstance(exc, redis.AuthenticationError):
        return (
            f"Redis refused the credentials ({exc}): check the user and password in the Redis "
            "URL, and that the ACL user is enabled"
        )
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return f"the Redis ACL user lacks a permission keyexpiry needs: {exc}"
    if isinstance(exc, redis.ReadOnlyError):
        return f"Redis refuses writes ({exc}): point keyexpiry at the master, not a replica"
    return f"Redis is not reachable: {exc}"


def check_replica_notifications(client: redis.Redis, *, configure: bool) -> str | None:
    """A replica's notification setting: it announces nothing now, but will once promoted."""
    text = config_value(client, "notify-keyspace-events")
    if text is None:
        return "cannot read CONFIG on this replica; make sure its notify-keyspace-events has Ex"
    has_x, has_e = ("x" in text or "A" in text), ("e" in text or "A" in text)
    if "E" in text and has_x and has_e:
        return None
    if configure:
        wanted = text + ("" if "E" in text else "E") + ("" if has_x else "x")
        wanted += "" if has_e else "e"
        client.config_set("notify-keyspace-events", wanted)
        logger.warning("set notify-keyspace-events to {!r} on a replica (was {!r})", wanted, text)
        return None
    if "E" in text and has_x:
        return None
    return (
        f"replica's notify-keyspace-events is {text!r}: once promoted it would announce no "
        "expiries (`keyexpiry doctor --fix` sets it on every node)"
    )
