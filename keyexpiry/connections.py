"""Building the Redis client and the ledger from settings (embedded defaults included)."""

from __future__ import annotations

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from keyexpiry.embedded import ensure_embedded_redis
from keyexpiry.errors import RedisUnavailableError
from keyexpiry.settings import Settings, mask_url
from keyexpiry.store import Store, make_engine


def resolve_redis_url(settings: Settings) -> str:
    """The Redis URL to use: the configured one, or the embedded server (started if needed)."""
    if settings.redis_url:
        return settings.redis_url
    return ensure_embedded_redis(settings.state_dir)


def resolve_database_url(settings: Settings) -> str:
    """The ledger URL: the configured one, or a SQLite file under the state dir."""
    if settings.database_url:
        return settings.database_url
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{settings.state_dir.resolve() / 'keyexpiry.sqlite3'}"


def redis_client(url: str, settings: Settings, *, pubsub: bool = False) -> redis.Redis:
    """A client for `url`; raw bytes (keys are decoded per message, never by the connection).

    The subscriber gets no read timeout (it waits for events) but a health check, so a half-open
    socket is noticed.
    """
    options: dict[str, object] = {
        # redis-py's default retries back off for up to a minute; callers here retry themselves
        # (the listener with its own logged backoff), so fail fast and say so.
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), 2),
        "socket_connect_timeout": 5,
        "socket_timeout": None if pubsub else 10,
        "health_check_interval": int(settings.health_check_interval_s),
        "decode_responses": False,
    }
    if not url.startswith("unix:"):
        options["socket_keepalive"] = True  # unix sockets have no keepalive
    try:
        return redis.Redis.from_url(url, **options)
    except ValueError as exc:
        raise RedisUnavailableError(f"bad Redis URL {mask_url(url)}: {exc}") from None


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


def redis_db(client: redis.Redis) -> int:
    """The database number the client uses (for the keyevent channel name)."""
    return int(client.connection_pool.connection_kwargs.get("db", 0) or 0)


def open_store(settings: Settings) -> Store:
    """The ledger for `settings`."""
    return Store(make_engine(resolve_database_url(settings)))
