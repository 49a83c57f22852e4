"""A settings module for `python -m django keyexpiry …` run by the tests in a process of its
own: the database and Redis from `KE_DJANGO_DB_URL` / `KE_DJANGO_REDIS_URL` (a test's fixtures),
and a `TIME_ZONE` six hours off UTC, to show that log times keep their offset."""

from __future__ import annotations

import os

import pymysql

from tests.django.common import BASE_SETTINGS, django_database

pymysql.install_as_MySQLdb()

globals().update(BASE_SETTINGS)
DATABASES = {"default": django_database(os.environ["KE_DJANGO_DB_URL"])}
DATABASES["default"]["CONN_MAX_AGE"] = int(os.environ.get("KE_DJANGO_CONN_MAX_AGE", "0"))
TIME_ZONE = "America/Chicago"
KEYEXPIRY = {
    "REDIS_URL": os.environ["KE_DJANGO_REDIS_URL"],
    "STATE_DIR": os.environ["KE_DJANGO_STATE_DIR"],
    "SENTINEL_COUNT": 0,
}
