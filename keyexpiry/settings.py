"""Settings from flags and `KEYEXPIRY_*` environment variables (flag, then env, then default)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from keyexpiry import limits
from keyexpiry.cluster import is_cluster_url, parse_cluster_url
from keyexpiry.errors import ConfigError

ENV_PREFIX = "KEYEXPIRY_"
DEFAULT_RETRY_SCHEDULE_S: tuple[float, ...] = (
    15, 15, 30, 180, 600, 1200, 1800, 1800, 1800, 3600, 10800, 10800, 10800, 21600, 21600,
)  # fmt: skip
"""15 retries on a payment provider's notification schedule: 15 s … 6 h."""


def mask_url(url: str | None) -> str:
    """`url` with any password replaced by `***`, safe for logs and output.

    Both places a password can hide are masked: the user-info part and a `password=` query
    argument (redis-py reads both, e.g. `unix:///run/redis.sock?password=...`). The rest of the
    URL is kept as written.
    """
    if not url:
        return "(embedded)"
    parts = urlsplit(url)
    masked = url
    if parts.password is not None:
        user = parts.username or ""
        host = parts.netloc.rpartition("@")[2]
        masked = masked.replace(f"//{parts.netloc}", f"//{user}:***@{host}", 1)
    if parts.query:
        query = "&".join(
            f"{name}=***" if name.lower() in _SECRET_QUERY else f"{name}{sep}{value}"
            for name, sep, value in (item.partition("=") for item in parts.query.split("&"))
        )
        masked = masked.replace(f"?{parts.query}", f"?{query}", 1)
    return masked


_SECRET_QUERY = ("password", "sentinel_password")


def default_state_dir(environ: Mapping[str, str]) -> Path:
    """Home of the embedded Redis and SQLite files: $XDG_STATE_HOME/keyexpiry (~/.local/state)."""
    base = environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "keyexpiry"


@dataclass(frozen=True)
class Settings:
    """All a keyexpiry client or listener needs; build with `from_env`, check with `validate`.

    `redis_url` / `database_url` left empty select the embedded defaults (a bundled redis-server on
    a unix socket and a SQLite file, both under `state_dir`).
    """

    redis_url: str | None = field(default=None, repr=False)
    database_url: str | None = field(default=None, repr=False)
    state_dir: Path = field(default_factory=lambda: default_state_dir(os.environ))
    tasks: tuple[str, ...] = ()
    key_prefix: str = ""
    concurrency: int = 8
    """Worker threads: sync handlers run at once."""
    async_concurrency: int = 100
    """Coroutines of `async def` handlers run at once (on the listener's event loop)."""
    handler_timeout_s: float = 60.0
    lease_grace_s: float = 30.0
    retry_schedule_s: tuple[float, ...] = DEFAULT_RETRY_SCHEDULE_S
    sentinel_count: int = 10
    sentinel_interval_s: float = 900.0
    shutdown_timeout_s: float = 30.0
    reconnect_initial_s: float = 0.5
    reconnect_max_s: float = 30.0
    health_check_interval_s: float = 10.0
    claim_batch: int = 256
    canary_interval_s: float = 30.0
    lease_check_s: float = 10.0
    stuck_after_s: float = 5.0
    heartbeat_s: float = 1.0
    """How often a listener writes its heartbeat to the ledger."""
    takeover_after_s: float = 5.0
    """A listener silent this long is dead: a live one requeues its running tasks."""
    retain_done_s: float = 7 * 86400.0
    """Done and cancelled rows are deleted this long after they finished (0: kept forever)."""
    retain_dead_s: float = 90 * 86400.0
    """Dead rows are deleted this long after they died (0: kept forever)."""
    prune_every_s: float = 60.0
    """How often a listener prunes (a few batches of 1,000 rows each time)."""
    driver: bool = True
    driver_window_s: float = 60.0
    driver_max_rows: int = 50_000
    wake_ahead_s: float = 120.0
    configure_redis: bool = False
    log_level: str = "INFO"
    result_max_bytes: int = 65_536
    """Largest handler return value kept with its row, in bytes of JSON (`result`)."""
    http: str = ""
    """`HOST:PORT` for the listener's /metrics, /healthz and /readyz; empty: not served."""

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.repr
        )
        return (
            f"Settings(redis_url={mask_url(self.redis_url)!r}, "
            f"database_url={mask_url(self.database_url)!r}, {shown})"
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Settings:
        """Read `KEYEXPIRY_<FIELD>` variables; `overrides` (e.g. CLI flags) win over them."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {"state_dir": default_state_dir(env)}
        for f in dataclasses.fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None or raw == "":
                continue
            values[f.name] = _parse_field(f.name, raw, f.type)
        values.update({k: v for k, v in overrides.items() if v is not None})
        settings = cls(**values)  # type: ignore[arg-type]
        settings.validate()
        return settings

    def replace(self, **changes: object) -> Settings:
        """A copy with `changes` applied and validated."""
        settings = dataclasses.replace(self, **changes)  # type: ignore[arg-type]
        settings.validate()
        return settings

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the setting and what is allowed."""
        for name, (low, high) in _RANGES.items():
            value = getattr(self, name)
            limits.number(value, name, low=low, high=high, error=ConfigError)
            if name in _WHOLE and not isinstance(value, int):
                raise ConfigError(f"{name} must be a whole number, got {value!r}")
        for name in _ABOVE_ZERO:
            limits.number(
                getattr(self, name), name, low=0, high=_RANGES[name][1], error=ConfigError,
                above_low=True,
            )  # fmt: skip
        if self.reconnect_max_s < self.reconnect_initial_s:
            raise ConfigError("reconnect_max_s must be >= reconnect_initial_s")
        if self.takeover_after_s < 2 * self.heartbeat_s:
            raise ConfigError("takeover_after_s must be at least twice heartbeat_s")
        if self.wake_ahead_s < self.driver_window_s:
            raise ConfigError("driver_window_s must be at most wake_ahead_s")
        schedule = limits.delays(self.retry_schedule_s, "retry_schedule_s", ConfigError)
        object.__setattr__(self, "retry_schedule_s", schedule)
        if self.http:
            from keyexpiry.endpoints import parse_bind

            parse_bind(self.http)
        if "@" in self.key_prefix or len(self.key_prefix) > 64:
            raise ConfigError("key_prefix must not contain '@' and must be at most 64 characters")
        for url, what, schemes in (
            (self.redis_url, "redis_url", _REDIS_SCHEMES),
            (self.database_url, "database_url", None),
        ):
            if url:
                scheme = urlsplit(url).scheme
                if not schemes:
                    scheme = scheme.split("+")[0]  # mysql+pymysql: the driver is SQLAlchemy's
                if not scheme or (schemes and scheme not in schemes):
                    allowed = ", ".join(f"{s}://" for s in schemes or ("mysql+pymysql", "sqlite"))
                    raise ConfigError(f"{what} {mask_url(url)!r} is not a URL ({allowed})")
                if what == "redis_url":
                    from keyexpiry.sentinel import is_sentinel_url, parse_sentinel_url

                    if is_sentinel_url(url):
                        parse_sentinel_url(url)  # a malformed one fails here, with the reason
        if self.redis_url and is_cluster_url(self.redis_url):
            parse_cluster_url(self.redis_url)  # raises ConfigError naming what is wrong
            if "{" in self.key_prefix or "}" in self.key_prefix:
                # A hash tag in the prefix would put every task key in one slot.
                raise ConfigError("key_prefix must not contain '{' or '}' on a Redis Cluster")

    @property
    def embedded_redis(self) -> bool:
        """Whether keyexpiry runs its own redis-server under `state_dir`."""
        return not self.redis_url


_REDIS_SCHEMES = (
    "redis", "rediss", "unix",
    "redis+sentinel", "rediss+sentinel",
    "redis+cluster", "rediss+cluster",
)  # fmt: skip

_RANGES: dict[str, tuple[float, float]] = {
    "concurrency": (1, 1024),
    "async_concurrency": (1, 100_000),
    "handler_timeout_s": (0, limits.MAX_DELAY_S),
    "lease_grace_s": (0, limits.DAY_S),
    "sentinel_count": (0, 100),
    "sentinel_interval_s": (0, 30 * limits.DAY_S),
    "shutdown_timeout_s": (0, limits.DAY_S),
    "reconnect_initial_s": (0, 3600),
    "reconnect_max_s": (0, limits.DAY_S),
    "health_check_interval_s": (0, 3600),
    "claim_batch": (1, 5000),
    "canary_interval_s": (0, limits.DAY_S),
    "lease_check_s": (0, limits.DAY_S),
    "stuck_after_s": (0, limits.DAY_S),
    "heartbeat_s": (0, 60),
    "takeover_after_s": (0, limits.DAY_S),
    "retain_done_s": (0, limits.MAX_HORIZON_S),
    "retain_dead_s": (0, limits.MAX_HORIZON_S),
    "prune_every_s": (0, limits.DAY_S),
    "driver_window_s": (0, limits.DAY_S),
    "driver_max_rows": (100, 10_000_000),
    "wake_ahead_s": (0, 7 * limits.DAY_S),
    # A result travels in one of the recorder's UPDATEs: 1 MiB stays below the smallest
    # max_allowed_packet a server is likely to have (4 MiB on MySQL 5.7, 16 MiB on MariaDB).
    "result_max_bytes": (1, 1024 * 1024),
}
"""Every numeric setting and its accepted range (finite, inclusive)."""
_WHOLE = (
    "concurrency", "async_concurrency", "sentinel_count", "claim_batch", "driver_max_rows",
    "result_max_bytes",
)  # fmt: skip
_ABOVE_ZERO = (
    "handler_timeout_s", "sentinel_interval_s", "reconnect_initial_s", "reconnect_max_s",
    "canary_interval_s", "lease_check_s", "driver_window_s", "heartbeat_s", "prune_every_s",
)  # fmt: skip
"""Settings that must be strictly positive (a zero would spin or time out at once)."""


def _parse_field(name: str, raw: str, type_name: object) -> object:
    text = str(type_name)
    try:
        if "tuple[str" in text:
            return tuple(p.strip() for p in raw.split(",") if p.strip())
        if "tuple[float" in text:
            return tuple(float(p) for p in raw.split(",") if p.strip())
        if text == "int":
            return int(raw)
        if text == "float":
            return float(raw)
        if text == "bool":
            low = raw.strip().lower()
            if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError("expected true or false")
            return low in ("1", "true", "yes", "on")
        if text == "Path":
            return Path(raw).expanduser()
    except ValueError as exc:
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} is invalid: {exc}") from None
    return raw
