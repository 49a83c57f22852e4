"""What the in-process tests (conftest.py) and the `manage.py`-style subprocesses
(project_settings.py) share: the base settings, and a fixture's URL as a `DATABASES` entry."""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import make_url

BASE_SETTINGS: dict[str, Any] = {
    "INSTALLED_APPS": [
        "django.contrib.admin",
        "django.contrib.auth",
        "django.contrib.contenttypes",
        "django.contrib.messages",
        "keyexpiry.django",
        "tests.django.shop",
    ],
    "DATABASES": {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    "TASKS": {"default": {"BACKEND": "keyexpiry.django.TasksBackend"}},
    "USE_TZ": True,
    "TIME_ZONE": "UTC",
    "SECRET_KEY": "keyexpiry-tests",
    "DEFAULT_AUTO_FIELD": "django.db.models.BigAutoField",
    "ROOT_URLCONF": "tests.django.urls",
}


def django_database(url: str) -> dict[str, Any]:
    """A `DATABASES` entry for the fixtures' SQLAlchemy URL."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": parsed.database}
    engine = "mysql" if parsed.get_backend_name() == "mysql" else "postgresql"
    conf: dict[str, Any] = {
        "ENGINE": f"django.db.backends.{engine}",
        "NAME": parsed.database,
        "USER": parsed.username or "",
        "PASSWORD": parsed.password or "",
        "HOST": parsed.host or "",
        "PORT": str(parsed.port or ""),
    }
    if engine == "mysql":
        conf["OPTIONS"] = {"charset": "utf8mb4"}
    return conf
