"""Django for keyexpiry.django's tests: one settings object for the whole process (configured
here, so only when these tests are collected), whose `default` database is pointed at each
test's fresh database (SQLite file, MariaDB or PostgreSQL from tests/conftest.py's servers) and
migrated; `KEYEXPIRY` points at the test's Redis.

pytest-django blocks Django's database access outside its own test databases; these tests use
the fixtures' databases instead, so they unblock it (`django_db_blocker`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymysql
import pytest

pymysql.install_as_MySQLdb()  # Django's MySQL backend on the driver keyexpiry already installs
# ... and its submodules under the same names: imported afresh as `MySQLdb.err` and the like,
# they would load second copies and rebind `pymysql.err` to one, whose OperationalError is not
# the one PyMySQL raises (every later `pytest.raises(pymysql.err.OperationalError)` in this
# process missed it: a CI failure of two server tests).
for _name, _module in list(sys.modules.items()):
    if _name.startswith("pymysql."):
        sys.modules.setdefault("MySQLdb." + _name.removeprefix("pymysql."), _module)

import django  # noqa: E402
from django.conf import settings  # noqa: E402

from tests.django.common import BASE_SETTINGS, django_database  # noqa: E402

if not settings.configured:
    settings.configure(**BASE_SETTINGS)
    django.setup()


def point_default_at(conf: dict[str, Any], alias: str = "default") -> None:
    """Make `conf` Django's `alias` database from now on (a fresh connection)."""
    from django.db import connections

    from keyexpiry.django.clients import reset

    full = {
        "ATOMIC_REQUESTS": False,
        "AUTOCOMMIT": True,
        "CONN_MAX_AGE": 0,
        "CONN_HEALTH_CHECKS": False,
        "OPTIONS": {},
        "TIME_ZONE": None,
        "USER": "",
        "PASSWORD": "",
        "HOST": "",
        "PORT": "",
        "TEST": {},
        **conf,
    }
    connections.close_all()
    for name in list(connections.settings):
        try:
            del connections[name]
        except AttributeError:
            pass  # never opened in this thread
    if alias == "default":  # a new project: the extra aliases of the last test go
        for name in [n for n in settings.DATABASES if n != "default"]:
            del settings.DATABASES[name]
            connections.settings.pop(name, None)
    settings.DATABASES[alias] = full
    connections.settings[alias] = full
    reset()


@pytest.fixture(autouse=True)
def _registry_kept_apart() -> Iterator[None]:
    """Whatever a test here registers in the default registry (its task functions, found by
    `discover`; a `@keyed` schedule) is gone after it: the other tests of this process start
    listeners on the default registry, and a schedule left there was declared in their
    ledgers (a CI run found `tests__django__shop__tasks@heartbeat` rows in 22 other tests)."""
    from keyexpiry.django import functions
    from keyexpiry.registry import default_registry

    kept = (
        dict(default_registry._specs),
        dict(default_registry._classes),
        dict(default_registry._declared),
    )
    try:
        yield
    finally:
        default_registry._specs, default_registry._classes, default_registry._declared = (
            kept[0],
            kept[1],
            kept[2],
        )
        # Which task modules the registry holds is remembered beside it: forget that too, so
        # the next test's `discover` registers them again.
        with functions._lock:
            functions._registered.pop(id(default_registry), None)


@pytest.fixture
def django_project(
    db_url: str, redis_url: str, tmp_path: Path, django_db_blocker: Any
) -> Iterator[str]:
    """Django on this test's fresh database (not migrated) and Redis; yields the ledger's URL."""
    from django.db import connections

    from keyexpiry.django.clients import reset

    with django_db_blocker.unblock():
        point_default_at(django_database(db_url))
        settings.KEYEXPIRY = {"REDIS_URL": redis_url, "STATE_DIR": str(tmp_path / "state")}
        try:
            yield db_url
        finally:
            reset()
            connections.close_all()


@pytest.fixture
def django_db(django_project: str) -> str:
    """`django_project`, migrated: the ledger made by `manage.py migrate`."""
    migrate()
    return django_project


def migrate(*args: str) -> None:
    """`manage.py migrate` for keyexpiry's app and the test app (the admin's own tables are not
    needed: the admin is driven without its views' database)."""
    from django.core.management import call_command

    if args:
        call_command("migrate", *args, verbosity=0, skip_checks=True)
        return
    for app in ("keyexpiry", "shop"):
        call_command("migrate", app, verbosity=0, skip_checks=True)
