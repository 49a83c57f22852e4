"""The CLI contract: commands, exit codes, one-line errors, JSON, and two real terminals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from typer.testing import CliRunner

from keyexpiry.bench.servers import wait_until
from keyexpiry.cli import app
from keyexpiry.ledger.store import Store, TaskStatus, make_engine

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture
def env(cli_env: dict[str, str]) -> dict[str, str]:
    return cli_env  # tests/ke.py


def invoke(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args), env=env)
    return result.exit_code, result.stdout, result.stderr


def test_create_show_list_cancel(env: dict[str, str]) -> None:
    code, out, _ = invoke(env, "create", "Probe", "record", "a b", "--ttl", "60")
    assert code == 0 and out.strip() == "Probe@record@a%20b"
    code, out, _ = invoke(env, "show", "Probe", "record", "a b", "--json")
    shown = json.loads(out)
    assert shown["status"] == "pending" and 55_000 < shown["ttl_ms"] <= 60_000
    code, out, _ = invoke(env, "list", "--json", "--status", "pending")
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert set(row) >= {
        "key",
        "status",
        "attempts",
        "due_at",
        "started_at",
        "finished_at",
        "last_error",
    }
    assert isinstance(row["due_at"], float)
    assert invoke(env, "cancel", "Probe", "record", "a b")[0] == 0
    code, _, err = invoke(env, "cancel", "Probe", "record", "a b")
    assert (
        code == 1
        and err.strip() == "error: Probe@record@a%20b is cancelled, not pending: nothing cancelled"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["create", "Probe", "record", "x"], "exactly one of --ttl"),
        (["create", "Probe", "record", "--ttl", "1"], "takes 1 argument"),
        (["create", "Probe", "typed", "x", "1", "true", "1", "--ttl", "1"], "must be int"),
        (["create", "Probe", "not_exposed", "x", "--ttl", "1"], "not an exposed task method"),
        (["create", "os", "system", "ls", "--ttl", "1"], "not registered"),
        (["create", "Probe", "record", "x", "--at", "tomorrow"], "not an ISO 8601"),
        (["create", "Probe", "record", "x" * 600, "--ttl", "1"], "limit is 512"),
        (["show", "Probe", "record", "missing"], "no task"),
        (["list", "--status", "weird"], "--status must be one of 'pending', 'running'"),
        (
            [
                "--redis-url",
                "redis://:pw@127.0.0.1:1/0",
                "create",
                "Probe",
                "record",
                "x",
                "--ttl",
                "1",
            ],
            "Redis is not reachable",
        ),
    ],
)
def test_errors_are_one_line_and_exit_1(env: dict[str, str], args: list[str], message: str) -> None:
    code, _, err = invoke(env, *args)
    assert code == 1
    assert err.startswith("error: ") and message in err
    assert "Traceback" not in err and "pw" not in err.replace("Probe", "")


def test_doctor_reports_and_fixes_notifications(env: dict[str, str], redis_url: str) -> None:
    admin = redis.Redis.from_url(redis_url)
    try:
        admin.config_set("notify-keyspace-events", "")
        code, out, _ = invoke(env, "doctor")
        assert code == 1 and "[fail] notifications" in out
        assert "[fail] table" in out and "keyexpiry init-db" in out
        assert invoke(env, "init-db")[0] == 0
        code, out, _ = invoke(env, "doctor", "--fix")
        assert code == 0, out
        assert "[  ok] table" in out
        flags = admin.config_get("notify-keyspace-events")["notify-keyspace-events"]
        assert "E" in flags and "x" in flags
    finally:
        admin.config_set("notify-keyspace-events", "Ex")
        admin.close()


def test_init_db_and_reconcile_re_arm_lost_keys(env: dict[str, str], redis_url: str) -> None:
    assert invoke(env, "init-db")[0] == 0
    invoke(env, "create", "Probe", "record", "lost", "--ttl", "120")
    admin = redis.Redis.from_url(redis_url)
    try:
        admin.delete("Probe@record@lost")
        code, out, _ = invoke(env, "reconcile", "--dry-run")
        assert code == 0 and "1 key(s) re-armed" in out and admin.exists("Probe@record@lost") == 0
        code, out, _ = invoke(env, "reconcile")
        assert code == 0 and "1 key(s) re-armed" in out
        assert 110_000 < int(admin.pttl("Probe@record@lost")) <= 120_000
    finally:
        admin.close()


def _spawn(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "keyexpiry", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keyexpiry", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def listener_process() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()


def _done(db_url: str, key: str) -> bool:
    store = Store(make_engine(db_url))
    try:
        row = store.get(key) if store.table_exists() else None
        return row is not None and row.status is TaskStatus.DONE
    finally:
        store.engine.dispose()


@pytest.mark.parametrize("embedded", [False, True], ids=["redis-server", "embedded"])
def test_create_in_one_terminal_fires_in_a_listener_in_another(
    env: dict[str, str],
    tmp_path: Path,
    embedded: bool,
    listener_process: list[subprocess.Popen[str]],
) -> None:
    if embedded:  # nothing configured: bundled redis-server and SQLite under the state dir
        env = {
            k: v
            for k, v in env.items()
            if k not in ("KEYEXPIRY_REDIS_URL", "KEYEXPIRY_DATABASE_URL")
        }
        db_url = f"sqlite:///{tmp_path / 'state' / 'keyexpiry.sqlite3'}"
    else:
        db_url = env["KEYEXPIRY_DATABASE_URL"]
    proc = _spawn(env, "listen")
    listener_process.append(proc)
    created = _run(env, "create", "Probe", "record", "from-cli", "--ttl", "1")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    wait_until(lambda: _done(db_url, key), 20, message="task did not fire")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert proc.stdout is not None
    log = proc.stdout.read()
    assert f"[{key} #1] done" in log
    assert "listener stopped" in log
    if embedded:
        from keyexpiry.redis.embedded import stop_embedded_redis

        assert stop_embedded_redis(tmp_path / "state")
