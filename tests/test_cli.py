"""The CLI contract: commands, exit codes, one-line errors, JSON, and two real terminals."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import update
from typer.testing import CliRunner

from keyexpiry import Client
from keyexpiry.bench.servers import wait_until
from keyexpiry.cli import app
from keyexpiry.ledger.store import Store, TaskStatus, make_engine
from keyexpiry.ledger.table import S
from tests.ke import make_settings
from tests.schedule_tasks import Report

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


def test_pause_paused_and_resume(env: dict[str, str], redis_url: str) -> None:
    code, out, _ = invoke(env, "paused")
    assert (code, out) == (0, "nothing is paused\n")
    assert invoke(env, "paused", "--json")[:2] == (0, "")
    admin = redis.Redis.from_url(redis_url)
    pubsub = admin.pubsub()
    try:
        pubsub.subscribe("#keyexpiry#wake@0")
        wait_until(lambda: pubsub.get_message(timeout=0.1) is not None, 5, message="subscribe")
        code, out, _ = invoke(
            env, "pause", "Probe.record", "--for", "1h30m", "--reason", "PSP down"
        )
        assert code == 0 and out.startswith("paused Probe.record until 2") and "(PSP down)" in out
        message = pubsub.get_message(timeout=5)
        assert message is not None and message["data"] == b"#keyexpiry#pause"
    finally:
        pubsub.close()
        admin.close()
    code, out, _ = invoke(env, "pause", "Probe", "--until", "2099-01-02T03:04:05+00:00")
    assert code == 0 and out == "paused Probe until " + _local("2099-01-02T03:04:05+00:00") + "\n"
    code, out, _ = invoke(env, "pause", "Unknown")  # a class the CLI has not imported: allowed
    assert (code, out) == (0, "paused Unknown until resumed\n")
    code, out, _ = invoke(env, "paused")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["TARGET", "SINCE", "UNTIL", "REASON"]
    assert [line.split()[0] for line in lines[1:]] == ["Probe", "Probe.record", "Unknown"]
    assert lines[2].endswith("PSP down") and "until resumed" in lines[3]
    code, out, _ = invoke(env, "paused", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["target"] for r in rows] == ["Probe", "Probe.record", "Unknown"]
    by_target = {r["target"]: r for r in rows}
    assert (
        by_target["Unknown"]["until"] is None and by_target["Probe.record"]["reason"] == "PSP down"
    )
    record = by_target["Probe.record"]
    assert 5399 < record["until"] - record["paused_at"] <= 5400
    assert invoke(env, "resume", "Probe.record")[:2] == (0, "resumed Probe.record\n")
    # Exit 0 either way: the pause is gone, as asked.
    assert invoke(env, "resume", "Probe.record")[:2] == (0, "Probe.record was not paused\n")
    assert [json.loads(x)["target"] for x in invoke(env, "paused", "--json")[1].splitlines()] == [
        "Probe", "Unknown",
    ]  # fmt: skip


def _local(iso: str) -> str:
    return dt.datetime.fromisoformat(iso).astimezone().isoformat("T", "milliseconds")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["pause", "Probe.record", "--for", "30m", "--until", "2099-01-01"], "at most one of"),
        (["pause", "Probe.record", "--for", "30"], "duration '30' is not understood"),
        (["pause", "Probe.record", "--for", "0s"], "must be above 0"),
        (["pause", "Probe.record", "--until", "soon"], "--until 'soon' is not an ISO 8601"),
        (["pause", "Probe.record", "--until", "2001-01-01T00:00:00Z"], "not in the future"),
        (["pause", "Probe.record.x"], "cannot pause 'Probe.record.x'"),
        (["pause", "Probe", "--reason", "x" * 300], "at most 255"),
        (["resume", "1nvalid"], "cannot pause '1nvalid'"),
    ],
)
def test_pause_errors_are_one_line_and_exit_1(
    env: dict[str, str], args: list[str], message: str
) -> None:
    code, out, err = invoke(env, *args)
    assert code == 1 and err.startswith("error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and out == ""
    assert invoke(env, "paused")[1] == "nothing is paused\n"


@pytest.fixture
def ke(redis_url: str, sqlite_url: str, tmp_path: Path) -> Iterator[Client]:
    """A client on the ledger and Redis the `env` commands use."""
    with Client(make_settings(redis_url, sqlite_url, tmp_path)) as client:
        yield client


def test_schedules_lists_them_and_schedule_operates_one(env: dict[str, str], ke: Client) -> None:
    assert invoke(env, "schedules")[:2] == (0, "no schedules\n")
    assert invoke(env, "schedules", "--json")[:2] == (0, "")
    berlin = ke.schedule("reports:eu", Report.build, "eu", cron="0 9 * * *", tz="Europe/Berlin")
    ke.schedule("every:min", Report.build, "min", every_s=60)
    ke.schedule("old", Report.build, "old", every_s=60, end=dt.datetime(2001, 1, 1, tzinfo=dt.UTC))
    code, out, _ = invoke(env, "schedules")
    head, *lines = out.splitlines()
    assert code == 0 and head.split() == ["NAME", "STATE", "TASK", "WHEN", "NEXT", "LAST", "RUN"]
    assert [line.split()[:2] for line in lines] == [
        ["every:min", "active"], ["old", "ended"], ["reports:eu", "active"],
    ]  # fmt: skip
    assert "Report.build(min)" in lines[0] and "every 60 s" in lines[0]
    assert berlin.occurrence_ms is not None
    assert "0 9 * * * (Europe/Berlin)" in lines[2] and _local_ms(berlin.occurrence_ms) in lines[2]
    assert all(line.endswith("never run") for line in lines)
    assert " - " in lines[1]  # an ended schedule has no next run
    rows = {
        r["name"]: r for r in map(json.loads, invoke(env, "schedules", "--json")[1].splitlines())
    }
    assert set(rows) == {"every:min", "old", "reports:eu"}
    assert rows["reports:eu"]["cron"] == "0 9 * * *" and rows["reports:eu"]["tz"] == "Europe/Berlin"
    assert (
        rows["reports:eu"]["next_at"] == berlin.occurrence_ms / 1000
        and rows["old"]["next_at"] is None
    )

    assert invoke(env, "schedule", "pause", "reports:eu")[:2] == (
        0, "paused schedule reports:eu (`keyexpiry schedule resume reports:eu` to go on)\n",
    )  # fmt: skip
    assert invoke(env, "schedule", "pause", "reports:eu")[:2] == (
        0, "schedule reports:eu was already paused\n",
    )  # fmt: skip
    paused = invoke(env, "schedules")[1].splitlines()[3]
    assert (
        paused.split()[:2] == ["reports:eu", "paused"]
        and _local_ms(berlin.occurrence_ms) not in paused
    )
    code, out, err = invoke(env, "schedule", "run-now", "reports:eu")
    assert (code, out) == (1, "") and "is paused: nothing started" in err
    code, out, _ = invoke(env, "schedule", "resume", "reports:eu")
    assert (code, out) == (
        0,
        f"resumed schedule reports:eu: next run {_local_ms(berlin.occurrence_ms)}\n",
    )
    assert invoke(env, "schedule", "resume", "reports:eu")[:2] == (
        0, "schedule reports:eu was not paused\n",
    )  # fmt: skip

    code, out, _ = invoke(env, "schedule", "run-now", "reports:eu")
    assert (code, out) == (
        0,
        "schedule reports:eu: an extra run is due now (the regular ones follow)\n",
    )
    row = ke.store.get("Report@build@eu")
    assert row is not None and row.status is TaskStatus.PENDING
    assert row.due_at_ms <= ke.clock.now_ms() < berlin.occurrence_ms
    now = ke.clock.now_ms()
    ke.store.claim(["Report@build@eu"], now_ms=now, lease_until_ms=now + 60_000, token="t")
    code, out, err = invoke(env, "schedule", "run-now", "reports:eu")
    assert (code, out) == (1, "") and "its occurrence is running now, nothing started" in err
    code, out, err = invoke(env, "schedule", "run-now", "old")
    assert (code, out) == (1, "") and "has ended: nothing started" in err

    # The last run as the listener's outcome writes it: failed, after an earlier success.
    with ke.store.engine.begin() as conn:
        conn.execute(
            update(S)
            .where(S.c.name == "every:min")
            .values(
                last_status="dead",
                last_finished_ms=now,
                last_success_ms=now - 60_000,
                source="code",
            )
        )
    (line,) = [x for x in invoke(env, "schedules")[1].splitlines() if x.startswith("every:min")]
    assert line.endswith(f"dead {_local_ms(now)} (last success: {_local_ms(now - 60_000)})")
    code, out, err = invoke(env, "schedule", "remove", "every:min")
    assert (code, out) == (0, "removed schedule every:min\n")
    assert err.startswith("warning: every:min is declared in code")  # a listener declares it again
    cancelled = ke.store.get("Report@build@min")
    assert cancelled is not None and cancelled.status is TaskStatus.CANCELLED
    assert [r.name for r in ke.schedules()] == ["old", "reports:eu"]


def _local_ms(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000).astimezone().isoformat("T", "milliseconds")


@pytest.mark.parametrize("command", ["pause", "resume", "remove", "run-now"])
def test_schedule_commands_on_an_unknown_name_say_so_and_exit_1(
    env: dict[str, str], ke: Client, command: str
) -> None:
    ke.schedule("known", Report.build, "k", every_s=60)
    code, out, err = invoke(env, "schedule", command, "kn\x1bown")
    assert (code, out) == (
        1,
        "",
    ) and err == "error: no schedule named 'kn\\x1bown' (`keyexpiry schedules` lists them)\n"
    assert [s.name for s in ke.schedules()] == ["known"]


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
