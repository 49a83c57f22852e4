"""Settings from flags and `KEYEXPIRY_*` environment variables (flag, then env, then default)."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from keyexpiry import limits
from keyexpiry.errors import ConfigError
from keyexpiry.log import check_log_level
from keyexpiry.masking import mask_url, redact

ENV_PREFIX = "KEYEXPIRY_"
DEFAULT_RETRY_SCHEDULE_S: tuple[float, ...] = (
    15, 15, 30, 180, 600, 1200, 1800, 1800, 1800, 3600, 10800, 10800, 10800, 21600, 21600,
)  # fmt: skip
"""15 retries on a payment provider's notification schedule: 15 s … 6 h."""


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
    worker_ramp_ms: int = 5
    """How long a claimed run waits behind busy workers before one more idle worker is woken
    for it (one more each such interval): trivial handlers are run by the few workers that keep
    up, without waking the whole pool for each claim; handlers that typically take this long
    or longer wake a worker per run. 0 wakes a worker per run."""
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
    """A Redis connection idle longer than this is PINGed (by redis-py) before its next
    command: 0 turns that off; otherwise 0.05 s to an hour, fractions kept."""
    claim_batch: int = 256
    canary_interval_s: float = 30.0
    lease_check_s: float = 10.0
    stuck_after_s: float = 5.0
    heartbeat_s: float = 0.5
    """How often a listener writes its heartbeat to the ledger (and reads who is live): a dead or
    cut-off peer's share of the keys moves after its silence (`share_silence_s`: three beats, at
    least 2 s) and one more beat. Each beat is two or three small statements: a fleet of
    hundreds may prefer 1 s."""
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
    driver_tick_ms: int = 4
    """The shortest time between two lookup passes of the driver: keys falling due within it
    are looked up, announced and claimed together. Shorter cuts the delayed path's lateness by
    up to as much, at more listener CPU under a steady stream (docs/PERFORMANCE.md); 0 looks
    every key up the millisecond Redis expires it."""
    wake_ahead_s: float = 120.0
    configure_redis: bool = False
    log_level: str = "INFO"
    result_max_bytes: int = 65_536
    """Largest handler return value kept with its row, in bytes of JSON (`result`)."""
    payload_max_bytes: int = 65_536
    """Largest payload a create accepts, in bytes of JSON (`create(..., payload=)`)."""
    http: str = ""
    """`HOST:PORT` for the listener's /metrics, /healthz and /readyz; empty: not served."""
    web_allowed_hosts: tuple[str, ...] = ()
    """Host names the dashboard answers to (`*.example.com` for subdomains), beside loopback ones
    without a token; empty with a token: any (a guard against DNS rebinding). A wildcard needs a
    token (`create_app` refuses it without one)."""
    web_trusted_proxies: tuple[str, ...] = ()
    """Addresses or networks (`10.0.0.0/8`) of the reverse proxies in front of `keyexpiry web`:
    only from these is `X-Forwarded-For` read as the client's address (which the per-address
    token throttle and the loopback-only rule go by); from any other peer, loopback included,
    it is ignored. Empty: none trusted."""

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
        if 0 < self.health_check_interval_s < limits.MIN_INTERVAL_S:
            # redis-py PINGs before a read on a connection idle longer than this: on the
            # subscription each PONG ends a read at once, so a tiny one is a loop of round trips.
            raise ConfigError(
                f"health_check_interval_s must be 0 (off) or from {limits.MIN_INTERVAL_S} to "
                f"3600, got {self.health_check_interval_s!r}"
            )
        if self.reconnect_max_s < self.reconnect_initial_s:
            raise ConfigError("reconnect_max_s must be >= reconnect_initial_s")
        if self.takeover_after_s < 2 * self.heartbeat_s:
            raise ConfigError("takeover_after_s must be at least twice heartbeat_s")
        if self.wake_ahead_s < self.driver_window_s:
            raise ConfigError("driver_window_s must be at most wake_ahead_s")
        schedule = limits.delays(self.retry_schedule_s, "retry_schedule_s", ConfigError)
        object.__setattr__(self, "retry_schedule_s", schedule)
        if self.http:
            parse_bind(self.http, "--http")
        for host in self.web_allowed_hosts:
            if not _ALLOWED_HOST.fullmatch(host):
                raise ConfigError(
                    f"web_allowed_hosts: {host[:80]!r} is not a host name, IP address, "
                    "*.domain or *"
                )
        if self.web_trusted_proxies:
            self._validate_proxies()
        check_log_level(self.log_level)
        if "@" in self.key_prefix or len(self.key_prefix) > 64:
            raise ConfigError("key_prefix must not contain '@' and must be at most 64 characters")
        try:
            self._validate_urls()
        except ConfigError as exc:
            # A parser's message may quote a piece of the URL it could not make sense of
            # (cluster entry points cut out of a password holding `/`): never a credential.
            raise ConfigError(redact(str(exc), self.redis_url, self.database_url)) from None
        # Here, not at the top: it imports redis-py, which `keyexpiry --help` should not pay for.
        from keyexpiry.redis.cluster import is_cluster_url

        hash_tag = "{" in self.key_prefix or "}" in self.key_prefix
        if hash_tag and self.redis_url and is_cluster_url(self.redis_url):
            # A hash tag in the prefix would put every task key in one slot.
            raise ConfigError("key_prefix must not contain '{' or '}' on a Redis Cluster")

    def _validate_proxies(self) -> None:
        import ipaddress  # here: every CLI call validates settings, few list proxies

        for proxy in self.web_trusted_proxies:
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                raise ConfigError(
                    f"web_trusted_proxies: {proxy[:80]!r} is not an IP address or network "
                    "(10.0.0.0/8, 127.0.0.1, ::1)"
                ) from None

    def _validate_urls(self) -> None:
        for url, what, schemes in (
            (self.redis_url, "redis_url", _REDIS_SCHEMES),
            (self.database_url, "database_url", None),
        ):
            if url:
                try:
                    scheme = urlsplit(url).scheme
                except ValueError as exc:  # "Invalid IPv6 URL": an unclosed `[`
                    raise ConfigError(
                        f"{what} {mask_url(url)!r} is not a valid URL: {exc}"
                    ) from None
                if not schemes:
                    scheme = scheme.split("+")[0]  # mysql+pymysql: the driver is SQLAlchemy's
                if not scheme or (schemes and scheme not in schemes):
                    allowed = ", ".join(
                        f"{s}://"
                        for s in schemes or ("mysql+pymysql", "postgresql+psycopg", "sqlite")
                    )
                    raise ConfigError(f"{what} {mask_url(url)!r} is not a URL ({allowed})")
                if what == "redis_url":
                    from keyexpiry.redis.sentinel import is_sentinel_url, parse_sentinel_url

                    if is_sentinel_url(url):
                        parse_sentinel_url(url)  # a malformed one fails here, with the reason
        from keyexpiry.redis.cluster import is_cluster_url, parse_cluster_url

        if self.redis_url and is_cluster_url(self.redis_url):
            parse_cluster_url(self.redis_url)  # raises ConfigError naming what is wrong

    @property
    def embedded_redis(self) -> bool:
        """Whether keyexpiry runs its own redis-server under `state_dir`."""
        return not self.redis_url


_ALLOWED_HOST = re.compile(r"\*|(\*\.)?[A-Za-z0-9_.-]{1,253}|\[?[0-9A-Fa-f:.]{2,45}\]?")
"""A `web_allowed_hosts` entry: a name, an IPv4 or IPv6 address, `*.domain` or `*` (any)."""

_REDIS_SCHEMES = (
    "redis", "rediss", "unix",
    "redis+sentinel", "rediss+sentinel",
    "redis+cluster", "rediss+cluster",
)  # fmt: skip

_RANGES: dict[str, tuple[float, float]] = {
    "concurrency": (1, 1024),
    "async_concurrency": (1, 100_000),
    "handler_timeout_s": (limits.MIN_TIMEOUT_S, limits.MAX_DELAY_S),
    "lease_grace_s": (0, limits.DAY_S),
    "sentinel_count": (0, 100),
    "sentinel_interval_s": (limits.MIN_INTERVAL_S, 30 * limits.DAY_S),
    "shutdown_timeout_s": (0, limits.DAY_S),
    "reconnect_initial_s": (limits.MIN_INTERVAL_S, 3600),
    "reconnect_max_s": (limits.MIN_INTERVAL_S, limits.DAY_S),
    "health_check_interval_s": (0, 3600),  # 0: off; else at least MIN_INTERVAL_S (`validate`)
    "claim_batch": (1, 5000),
    "worker_ramp_ms": (0, 1000),
    "canary_interval_s": (limits.MIN_INTERVAL_S, limits.DAY_S),
    "lease_check_s": (limits.MIN_INTERVAL_S, limits.DAY_S),
    "stuck_after_s": (0, limits.DAY_S),
    "heartbeat_s": (limits.MIN_INTERVAL_S, 60),
    "takeover_after_s": (0, limits.DAY_S),
    "retain_done_s": (0, limits.MAX_HORIZON_S),
    "retain_dead_s": (0, limits.MAX_HORIZON_S),
    "prune_every_s": (limits.MIN_INTERVAL_S, limits.DAY_S),
    "driver_window_s": (1, limits.DAY_S),
    "driver_max_rows": (100, 10_000_000),
    "driver_tick_ms": (0, 1000),
    "wake_ahead_s": (1, 7 * limits.DAY_S),
    # A result travels in one of the recorder's UPDATEs: 1 MiB stays below the smallest
    # max_allowed_packet a server is likely to have (4 MiB on MySQL 5.7, 16 MiB on MariaDB).
    "result_max_bytes": (1, 1024 * 1024),
    "payload_max_bytes": (1, 4 * 1024 * 1024),  # a row below max_allowed_packet (16 MiB)
}
"""Every numeric setting and its accepted range (finite, inclusive). A loop's interval is at
least `limits.MIN_INTERVAL_S`: a smaller one (1e-300) spins a thread at 100 % CPU; the driver's
window and look-ahead at least 1 s (its reads are per window)."""
_WHOLE = (
    "concurrency", "async_concurrency", "sentinel_count", "claim_batch", "driver_max_rows",
    "driver_tick_ms", "result_max_bytes", "payload_max_bytes", "worker_ramp_ms",
)  # fmt: skip


def parse_bind(value: str, option: str) -> tuple[str, int]:
    """`HOST:PORT`, `[::1]:PORT` or `:PORT` (all interfaces) as (host, port); a ConfigError
    names `option`, the flag the user gave (`--http`, `--bind`)."""
    host, sep, port_text = value.strip().rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"{option} {value!r}: expected HOST:PORT, e.g. 127.0.0.1:9464")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port_text)


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
