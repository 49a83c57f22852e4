"""`manage.py keyexpiry …` and the settings it reads: the CLI with settings.py's settings; a
listener process that finds the installed apps' task functions, keeps Django's connection
hygiene, and logs times with their offset whatever Django's TIME_ZONE."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from sqlalchemy import create_engine, text

from keyexpiry.bench.servers import wait_until
from keyexpiry.django.clients import client
from keyexpiry.django.settings import as_environ, keyexpiry_settings, url_of
from keyexpiry.errors import ConfigError
from keyexpiry.ledger.rows import TaskStatus
from tests.django.shop import tasks
from tests.django.shop.models import Order

ROOT = Path(__file__).resolve().parents[2]


def test_settings_py_speaks_every_setting_by_name(django_project: str) -> None:
    from django.conf import settings

    settings.KEYEXPIRY = {
        **settings.KEYEXPIRY,
        "CONCURRENCY": 3,
        "DRIVER": False,
        "RETRY_SCHEDULE_S": [1, 2.5],
        "KEY_PREFIX": "shop:",
    }
    got = keyexpiry_settings()
    assert (got.concurrency, got.driver, got.retry_schedule_s) == (3, False, (1.0, 2.5))
    assert got.key_prefix == "shop:" and got.database_url == url_of(settings.DATABASES["default"])
    for bad in ({"DATABASE_URL": "sqlite://"}, {"CONCURENCY": 2}, {"DATABASE": "nope"}):
        with pytest.raises(ConfigError):
            as_environ(bad)


def test_database_urls_come_from_databases() -> None:
    mysql = {"ENGINE": "django.db.backends.mysql", "NAME": "shop", "USER": "u", "PASSWORD": "p@ss",
             "HOST": "/run/mysqld/mysqld.sock", "PORT": ""}  # fmt: skip
    assert url_of(mysql) == (
        "mysql+pymysql://u:p%40ss@/shop?charset=utf8mb4&unix_socket=%2Frun%2Fmysqld%2Fmysqld.sock"
    )
    pg = {"ENGINE": "django.db.backends.postgresql", "NAME": "shop", "USER": "u", "HOST": "db",
          "PORT": "5433", "OPTIONS": {"sslmode": "require", "pool": True}}  # fmt: skip
    assert url_of(pg) == "postgresql+psycopg://u@db:5433/shop?sslmode=require"
    sqlite = {"ENGINE": "django.db.backends.sqlite3", "NAME": "db.sqlite3"}
    assert url_of(sqlite) == f"sqlite:///{os.path.abspath('db.sqlite3')}"
    with pytest.raises(ConfigError, match="in-memory"):
        url_of({"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"})
    with pytest.raises(ConfigError, match="SQLite, MySQL/MariaDB or PostgreSQL"):
        url_of({"ENGINE": "django.db.backends.oracle", "NAME": "x"})


@pytest.mark.usefixtures("django_db")
def test_cli_commands_run_with_settings_py(capsys: pytest.CaptureFixture[str]) -> None:
    result = tasks.add.using(run_after=dt.datetime.now(dt.UTC) + dt.timedelta(minutes=5)).enqueue(1)
    capsys.readouterr()
    call_command("keyexpiry", "list", "--json")
    [line] = capsys.readouterr().out.splitlines()
    assert json.loads(line)["key"] == result.id
    call_command("keyexpiry", "cancel", *result.id.split("@"))
    assert client().store.get(result.id).status is TaskStatus.CANCELLED  # type: ignore[union-attr]
    with pytest.raises(CommandError):
        call_command("keyexpiry", "cancel", *result.id.split("@"))  # not pending: exit 1


@pytest.fixture
def pg_listener(django_db: str, redis_url: str, tmp_path: Path) -> subprocess.Popen[str]:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KEYEXPIRY_")},
        "DJANGO_SETTINGS_MODULE": "tests.django.project_settings",
        "PYTHONPATH": str(ROOT),
        "KE_DJANGO_DB_URL": django_db,
        "KE_DJANGO_REDIS_URL": redis_url,
        "KE_DJANGO_STATE_DIR": str(tmp_path / "state"),
    }
    env.pop("TZ", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "django", "keyexpiry", "listen"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


@pytest.mark.parametrize("db_url", ["pg"], indirect=True)
def test_listener_process_keeps_djangos_connection_hygiene(
    pg_listener: subprocess.Popen[str], django_db: str
) -> None:
    ids = [o.id for o in Order.objects.bulk_create([Order() for _ in range(200)])]
    results = [tasks.close_unpaid.enqueue(i) for i in ids]
    ke = client()

    def all_done() -> bool:
        if pg_listener.poll() is not None:
            raise AssertionError(f"the listener exited: {pg_listener.communicate()[0]}")
        return len(ke.list_tasks("done", limit=1000)) == len(results)

    try:
        wait_until(all_done, 60, message="the ORM tasks did not all finish")
    except AssertionError:
        pg_listener.kill()
        raise AssertionError(pg_listener.communicate()[0][-5000:]) from None
    assert Order.objects.filter(status="closed").count() == 200
    probe = create_engine(django_db)
    try:
        with probe.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT query FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            ).all()
    finally:
        probe.dispose()
    # A handler's connection last ran its ORM UPDATE; keyexpiry's own run their statements.
    handlers = [r for r in rows if r[0].startswith('UPDATE "shop_order"')]
    # CONN_MAX_AGE 0: every handler's connection closed after its run; what stays is the
    # listener's own pool (10 + the autocommit pool's 10 at most) and this test process's.
    assert handlers == [], handlers
    assert len(rows) <= 20 + 2, rows
    pg_listener.send_signal(signal.SIGTERM)
    out, _ = pg_listener.communicate(timeout=30)
    assert pg_listener.returncode == 0, out
    stamps = re.findall(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d) ", out, re.M)
    assert stamps, out
    # Django's TIME_ZONE (America/Chicago) is the process's local zone; every line says its
    # offset, so its instant is right beside any other process's lines.
    for stamp in stamps:
        when = dt.datetime.fromisoformat(stamp)
        assert when.utcoffset() in (dt.timedelta(hours=-6), dt.timedelta(hours=-5))
        assert abs((dt.datetime.now(dt.UTC) - when).total_seconds()) < 300


def test_manage_py_keyexpiry_help_lists_the_cli_commands(redis_url: str, tmp_path: Path) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KEYEXPIRY_")},
        "DJANGO_SETTINGS_MODULE": "tests.django.project_settings",
        "PYTHONPATH": str(ROOT),
        "KE_DJANGO_DB_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "KE_DJANGO_REDIS_URL": redis_url,
        "KE_DJANGO_STATE_DIR": str(tmp_path / "state"),
    }
    run = subprocess.run(
        [sys.executable, "-m", "django", "keyexpiry", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    for command in ("listen", "list", "show", "cancel", "retry", "reconcile", "doctor", "web"):
        assert command in run.stdout
