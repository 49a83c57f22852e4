"""The shop's settings: the database from `SHOP_DATABASE_URL` (a SQLAlchemy-style URL; default a
SQLite file here), Redis from `SHOP_REDIS_URL` (default: keyexpiry's embedded one)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pymysql
from sqlalchemy.engine import make_url

pymysql.install_as_MySQLdb()  # Django's MySQL backend on PyMySQL (keyexpiry installs it)

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("SHOP_SECRET_KEY", "not-a-secret: example only")
DEBUG = True
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "testserver"]
USE_TZ = True
TIME_ZONE = "Europe/Berlin"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "keyexpiry.django",  # the ledger's migrations, `manage.py keyexpiry`, the admin
    "orders",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "django_shop.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"


def _database(url: str) -> dict[str, Any]:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        name = parsed.database or str(BASE_DIR / "shop.sqlite3")
        # Tests on a file too: keyexpiry's own connections must open the test database.
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": name,
                "TEST": {"NAME": str(Path(name).with_suffix(".test.sqlite3"))}}  # fmt: skip
    engine = "mysql" if parsed.get_backend_name() == "mysql" else "postgresql"
    return {
        "ENGINE": f"django.db.backends.{engine}",
        "NAME": parsed.database,
        "USER": parsed.username or "",
        "PASSWORD": parsed.password or "",
        "HOST": parsed.host or "",
        "PORT": str(parsed.port or ""),
    }


DATABASES = {"default": _database(os.environ.get("SHOP_DATABASE_URL", "sqlite://"))}

# Django's task API on keyexpiry.
TASKS = {"default": {"BACKEND": "keyexpiry.django.TasksBackend"}}
KEYEXPIRY: dict[str, Any] = {"REDIS_URL": os.environ.get("SHOP_REDIS_URL", "")}
if os.environ.get("SHOP_STATE_DIR"):
    KEYEXPIRY["STATE_DIR"] = os.environ["SHOP_STATE_DIR"]
