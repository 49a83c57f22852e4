"""The Django settings module of `bench --scenario django` (DJANGO_SETTINGS_MODULE, in the
benchmark process and in its listener): Redis and the ledger from the environment the scenario
sets, `$KEYEXPIRY_BENCH_DJANGO_REDIS_URL` and `$KEYEXPIRY_BENCH_DJANGO_DB_URL` (a SQLAlchemy URL
of the run's SQLite file, MariaDB or PostgreSQL database, made a `DATABASES` entry here)."""

from __future__ import annotations

import os
from typing import Any

import pymysql
from sqlalchemy.engine import make_url

# Django's MySQL backend on the driver keyexpiry already installs (no mysqlclient to build).
pymysql.install_as_MySQLdb()

REDIS_URL_ENV = "KEYEXPIRY_BENCH_DJANGO_REDIS_URL"
DB_URL_ENV = "KEYEXPIRY_BENCH_DJANGO_DB_URL"
TASKS_MODULE = "keyexpiry.bench.django_tasks"


def database_entry(url: str) -> dict[str, Any]:
    """A `DATABASES` entry for a SQLAlchemy URL (sqlite, mysql+pymysql, postgresql+psycopg)."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": parsed.database}
    engine = "mysql" if backend == "mysql" else "postgresql"
    entry: dict[str, Any] = {
        "ENGINE": f"django.db.backends.{engine}",
        "NAME": parsed.database,
        "USER": parsed.username or "",
        "PASSWORD": parsed.password or "",
        "HOST": parsed.host or "",
        "PORT": str(parsed.port or ""),
    }
    if engine == "mysql":
        entry["OPTIONS"] = {"charset": "utf8mb4"}
    return entry


INSTALLED_APPS = ["keyexpiry.django"]
TASKS = {"default": {"BACKEND": "keyexpiry.django.TasksBackend"}}
USE_TZ = True
TIME_ZONE = "UTC"
SECRET_KEY = "keyexpiry-bench"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {"default": database_entry(os.environ[DB_URL_ENV])}
KEYEXPIRY = {
    "REDIS_URL": os.environ[REDIS_URL_ENV],
    "TASKS": [TASKS_MODULE],
    "SENTINEL_COUNT": 0,  # a run is shorter than one sentinel interval
    "LOG_LEVEL": "WARNING",
}
