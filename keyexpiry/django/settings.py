"""settings.py's `KEYEXPIRY` dict and `DATABASES` as keyexpiry `Settings`.

`KEYEXPIRY = {"REDIS_URL": "redis://…", "CONCURRENCY": 16, …}`: every `KEYEXPIRY_*` setting by
its name without the prefix, as a Python value (`RETRY_SCHEDULE_S: [10, 60]`, `DRIVER: False`)
or as the environment's text (`"10,60"`, `"false"`); `KEYEXPIRY_*` variables fill what the dict
leaves out. `DATABASE` names the Django database alias of the ledger (default `"default"`): its
connection settings come from `DATABASES`, so the ledger's URL is never a second setting to keep
in step (`DATABASE_URL` is refused).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from sqlalchemy.engine import URL

from keyexpiry.errors import ConfigError
from keyexpiry.settings import ENV_PREFIX, Settings

SETTING = "KEYEXPIRY"
ALIAS_KEY = "DATABASE"
_FIELDS = {f.name.upper(): f for f in dataclasses.fields(Settings)}


def project_settings() -> Mapping[str, Any]:
    """settings.py's `KEYEXPIRY` dict (empty when unset)."""
    from django.conf import settings

    value = getattr(settings, SETTING, None) or {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"settings.{SETTING} must be a dict, got {type(value).__name__}")
    return value


def ledger_alias(conf: Mapping[str, Any] | None = None) -> str:
    """The Django database alias that holds the ledger (`KEYEXPIRY["DATABASE"]`)."""
    alias = (project_settings() if conf is None else conf).get(ALIAS_KEY, "default")
    if not isinstance(alias, str) or not alias:
        raise ConfigError(f"{SETTING}['{ALIAS_KEY}'] must be a database alias, got {alias!r}")
    return alias


def as_environ(conf: Mapping[str, Any] | None = None) -> dict[str, str]:
    """`KEYEXPIRY_*` variables saying what settings.py says (the ledger's URL included): what
    the `keyexpiry` CLI reads when `manage.py keyexpiry` runs it."""
    conf = project_settings() if conf is None else conf
    env: dict[str, str] = {}
    for name, value in conf.items():
        if name == ALIAS_KEY:
            continue
        if name == "DATABASE_URL":
            raise ConfigError(
                f"{SETTING}['DATABASE_URL']: the ledger is a Django database; name its alias "
                f"as {SETTING}['{ALIAS_KEY}'] (default 'default')"
            )
        if name not in _FIELDS:
            known = ", ".join(sorted([*_FIELDS, ALIAS_KEY]))
            raise ConfigError(f"{SETTING}[{name!r}] is not a keyexpiry setting; known: {known}")
        if value is None:
            continue
        env[ENV_PREFIX + name] = _as_text(name, value)
    env[ENV_PREFIX + "DATABASE_URL"] = database_url(ledger_alias(conf))
    return env


def keyexpiry_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from settings.py (`KEYEXPIRY`, `DATABASES`) over the `KEYEXPIRY_*` variables."""
    base = os.environ if environ is None else environ
    return Settings.from_env({**base, **as_environ()})


def _as_text(name: str, value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float | os.PathLike):
        return str(value)
    if isinstance(value, list | tuple):
        parts = [str(v) for v in value]
        if any("," in p for p in parts):
            raise ConfigError(f"{SETTING}[{name!r}]: an item holds a comma: {value!r}")
        return ",".join(parts)
    raise ConfigError(f"{SETTING}[{name!r}] must be text, a number, a bool or a list")


def database_url(alias: str) -> str:
    """The SQLAlchemy URL of Django database `alias` (SQLite, MySQL/MariaDB or PostgreSQL)."""
    from django.conf import settings

    databases = getattr(settings, "DATABASES", {}) or {}
    conf = databases.get(alias)
    if conf is None:
        raise ConfigError(
            f"{SETTING}['{ALIAS_KEY}'] = {alias!r} is not in DATABASES "
            f"({', '.join(sorted(databases)) or 'none'})"
        )
    return url_of(conf, alias)


def url_of(conf: Mapping[str, Any], alias: str = "default") -> str:
    """A `DATABASES` entry as the URL keyexpiry's ledger engine takes."""
    engine = str(conf.get("ENGINE", ""))
    name = str(conf.get("NAME") or "")
    options: Mapping[str, Any] = conf.get("OPTIONS") or {}
    kind = engine.rsplit(".", 1)[-1]
    if kind in ("sqlite3", "spatialite"):
        if not name or name == ":memory:" or "mode=memory" in name:
            raise ConfigError(
                f"DATABASES[{alias!r}] is an in-memory SQLite database: a listener in another "
                "process cannot share it; give it a file"
            )
        return f"sqlite:///{os.path.abspath(name)}"
    host = str(conf.get("HOST") or "")
    port = str(conf.get("PORT") or "")
    query: dict[str, str] = {}
    if kind == "mysql":
        drivername = "mysql+pymysql"
        query["charset"] = str(options.get("charset", "utf8mb4"))
        socket = options.get("unix_socket") or (host if host.startswith("/") else "")
        if socket:
            query["unix_socket"] = str(socket)
            host = ""
    elif kind in ("postgresql", "postgis"):
        drivername = "postgresql+psycopg"
        if host.startswith("/"):
            query["host"] = host
            host = ""
        for key, value in options.items():
            # libpq's own options (sslmode, connect_timeout, …); Django's (pool, …) stay Django's.
            if isinstance(value, str | int) and key not in ("pool", "server_side_binding"):
                query[str(key)] = str(value)
    else:
        raise ConfigError(
            f"DATABASES[{alias!r}] uses {engine or 'no ENGINE'}: the ledger runs on SQLite, "
            "MySQL/MariaDB or PostgreSQL"
        )
    url = URL.create(
        drivername,
        username=str(conf.get("USER") or "") or None,
        password=str(conf.get("PASSWORD") or "") or None,
        host=host or None,
        port=int(port) if port else None,
        database=name or None,
        query=query,
    )
    return url.render_as_string(hide_password=False)
