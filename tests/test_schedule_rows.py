"""Schedules on real Redis and ledgers, against bad input: a time zone that is no zone refused
when declared; a schedule row keyexpiry would not have written (edited by hand) skipped, said
once, counted, and never a failure of the listener, `keyexpiry schedules` or the dashboard; a
schedule whose class no live listener registers flagged; `schedule resume` saying what its
catch_up really does."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from loguru import logger
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from starlette.testclient import TestClient
from typer.testing import CliRunner

from keyexpiry import Client, ConfigError, Settings
from keyexpiry.bench.servers import wait_until
from keyexpiry.cli import app
from keyexpiry.ledger.recurring import MALFORMED_SCHEDULES
from keyexpiry.ledger.store import TaskStatus
from keyexpiry.log import _format
from keyexpiry.registry import Registry
from keyexpiry.web import create_app
from tests import schedule_tasks
from tests.ke import Running
from tests.schedule_tasks import Report

StartListener = Callable[..., Running]
TOKEN = "s3cret-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@contextlib.contextmanager
def _logged() -> Iterator[list[str]]:
    lines: list[str] = []
    sink = logger.add(lines.append, level="INFO", format=_format, colorize=False)
    try:
        yield lines
    finally:
        logger.remove(sink)


def _env(redis_url: str, db_url: str, tmp_path: Path) -> dict[str, str]:
    return {
        "KEYEXPIRY_REDIS_URL": redis_url,
        "KEYEXPIRY_DATABASE_URL": db_url,
        "KEYEXPIRY_STATE_DIR": str(tmp_path / "state"),
        "KEYEXPIRY_SENTINEL_COUNT": "0",
    }


@pytest.mark.parametrize(
    "tz",
    ["Europe", "America", "A" * 300, "../../etc/passwd", "Europe/../UTC", "/etc/localtime", ""],
)
def test_a_time_zone_that_is_no_zone_is_refused_when_declared(client: Client, tz: str) -> None:
    # 'Europe' is a directory of the zone database, 300 characters a name too long for the file
    # system: OSErrors from zoneinfo, not a refusal, before.
    with pytest.raises(ConfigError, match="IANA time zone") as err:
        client.schedule("nightly", Report.build, "eu", cron="0 3 * * *", tz=tz)
    assert "\n" not in str(err.value)
    assert client.schedules() == []


BAD_SCHEDULES: list[tuple[str, dict[str, Any]]] = [
    ("zone-directory", {"tz": "Europe"}),
    ("zone-path", {"tz": "../../etc/passwd"}),
    ("seconds-field", {"cron": "* * * * * *", "every_ms": None}),
    ("no-cron", {"cron": "not a cron", "every_ms": None}),
    ("catch-up", {"catch_up": "weekly"}),
    ("catch-up-max", {"catch_up_max": 1_000_000_000}),
    ("negative-interval", {"every_ms": -5}),
    ("start-in-year-3-million", {"start_ms": 10**17}),
    ("deep-args", {"args": "[" * 990 + "]" * 990}),
    ("anchor-text", {"anchor_ms": "abc"}),  # SQLite only: the servers refuse text in a BIGINT
]


def _insert_bad(client: Client, good: str, name: str, values: dict[str, Any]) -> bool:
    """A copy of schedule `good` named `name` with `values`, written with raw SQL (no keyexpiry
    code between the values and the table). False when the database refuses such a row (it
    cannot exist there)."""
    with client.store.engine.begin() as conn:
        row = dict(
            conn.execute(text("SELECT * FROM keyexpiry_schedule WHERE name = :n"), {"n": good})
            .mappings()
            .one()
        )
    key = f"{row['task_key']}-{name}"
    row.update(name=name, task_key=key, args=f'["eu-{name}"]')
    row.update(values)
    columns = ", ".join(row)
    try:
        with client.store.engine.begin() as conn:
            conn.execute(
                text(
                    f"INSERT INTO keyexpiry_schedule ({columns}) "
                    f"VALUES ({', '.join(':' + c for c in row)})"
                ),
                row,
            )
    except DBAPIError:
        return False
    return True


def test_a_schedule_row_keyexpiry_would_not_write_is_skipped_said_once_and_breaks_nothing(
    client: Client,
    settings: Settings,
    start_listener: StartListener,
    redis_url: str,
    db_url: str,
    tmp_path: Path,
    sampling: None,
) -> None:
    good = client.schedule("good", Report.build, "good", every_s=3600)
    # Said once per process: names of this run's own.
    tag = uuid.uuid4().hex[:8]
    inserted = [
        f"{name}-{tag}"
        for name, values in BAD_SCHEDULES
        if _insert_bad(client, "good", f"{name}-{tag}", values)
    ]
    assert len(inserted) >= len(BAD_SCHEDULES) - 1, inserted
    before = MALFORMED_SCHEDULES.count

    # The library: the good one listed, each bad one said once and counted once.
    with _logged() as lines:
        for _ in range(3):
            assert [s.name for s in client.schedules()] == ["good"]
    sound, problems = client.store.schedules_and_problems()
    assert [s.name for s in sound] == ["good"] and len(problems) == len(inserted)
    assert MALFORMED_SCHEDULES.count == before + len(inserted)
    said = [ln for ln in lines if "malformed ledger row" in ln]
    assert len(said) == len(inserted), said
    assert any("'Europe'" in ln and "IANA" in ln for ln in said), said
    assert any("has 6 fields" in ln for ln in said), said

    # The CLI lists the good one and warns of each bad one, without a traceback.
    env = _env(redis_url, db_url, tmp_path)
    listed = CliRunner().invoke(app, ["schedules"], env=env)
    assert listed.exit_code == 0 and listed.exception is None, listed.output
    assert "good" in listed.stdout and "Traceback" not in listed.output
    assert sum("(ignored)" in ln for ln in listed.stderr.splitlines()) == len(inserted)
    as_json = CliRunner().invoke(app, ["schedules", "--json"], env=env)
    assert as_json.exit_code == 0 and len(as_json.stdout.splitlines()) == 1, as_json.output
    doctor = CliRunner().invoke(app, ["doctor"], env=env)
    assert "zone-directory" in doctor.stdout and "Traceback" not in doctor.output, doctor.output

    # The dashboard shows the overview, the good schedule and what is wrong with the others.
    with TestClient(create_app(settings, token=TOKEN, client=client), headers=AUTH) as web:
        home = web.get("/")
        assert home.status_code == 200, home.text
        assert "good" in home.text and home.text.count("malformed row, ignored") == len(inserted)

    # A listener starts, stays up, and runs the good schedule (an extra run now).
    running = start_listener(settings)
    assert client.run_schedule_now("good")
    wait_until(
        lambda: (s := client.get_schedule("good")) is not None and s.last_status == "done",
        10,
        message="the good schedule ran",
    )
    assert running.thread.is_alive() and running.listener.failing() == []
    # A row of the bad schedule that says it is that schedule's occurrence runs as a plain task.
    key = client.key_for(Report.build, "bad-occurrence")
    with client.store.engine.begin() as conn:
        conn.execute(text("UPDATE keyexpiry_schedule SET task_key = :k WHERE name = :n"),
                     {"k": key, "n": f"zone-directory-{tag}"})  # fmt: skip
    client.create(Report.build, "bad-occurrence", ttl_ms=1500)
    with client.store.engine.begin() as conn:
        conn.execute(text("UPDATE time_limit_task SET schedule_name = :n WHERE task_key = :k"),
                     {"k": key, "n": f"zone-directory-{tag}"})  # fmt: skip
    wait_until(
        lambda: (r := client.store.get(key)) is not None and r.status is TaskStatus.DONE,
        10,
        message="the bad schedule's occurrence ran as a plain task",
    )
    assert good.task_key in {k for k, _, _ in schedule_tasks.runs()}


def test_a_schedule_declared_over_a_malformed_row_replaces_it(client: Client) -> None:
    client.schedule("good", Report.build, "good", every_s=3600)
    assert _insert_bad(client, "good", "nightly", {"tz": "Europe"})
    fixed = client.schedule("nightly", Report.build, "eu", cron="0 3 * * *", tz="Europe/Riga")
    assert fixed.recurrence.tz == "Europe/Riga" and fixed.occurrence_ms is not None
    assert [s.name for s in client.schedules()] == ["good", "nightly"]
    row = client.store.get(fixed.task_key)
    assert row is not None and row.status is TaskStatus.PENDING
    assert row.due_at_ms == fixed.occurrence_ms


def test_a_schedule_whose_class_no_live_listener_registers_is_flagged(
    client: Client,
    settings: Settings,
    start_listener: StartListener,
    redis_url: str,
    db_url: str,
    tmp_path: Path,
) -> None:
    running = start_listener(settings)  # registers every class this process imported, Report too
    # Live once its first heartbeat is written (on SQLite it may wait behind the start's writes).
    wait_until(lambda: running.listener.fleet.beats >= 1, 15)
    client.schedule("reports", Report.build, "eu", every_s=3600)
    with Client(settings, registry=Registry()) as producer:  # a producer cannot tell
        producer.schedule("typo", "Reportz.build", "eu", every_s=3600)
    env = _env(redis_url, db_url, tmp_path)
    listed = CliRunner().invoke(app, ["schedules"], env=env)
    assert listed.exit_code == 0, listed.output
    warnings = [ln for ln in listed.stderr.splitlines() if ln.startswith("warning:")]
    assert warnings == [
        "warning: schedule typo: no live listener registers Reportz; its runs wait until one does"
    ], listed.output
    as_json = CliRunner().invoke(app, ["schedules", "--json"], env=env)
    assert '"registered": false' in as_json.stdout and '"registered": true' in as_json.stdout
    doctor = CliRunner().invoke(app, ["doctor"], env=env)
    assert "no live listener registers Reportz" in doctor.stdout, doctor.output
    assert "pending tasks wait, no live listener registers: Reportz (1)" in doctor.stdout
    assert "Report " not in doctor.stdout.replace("Reportz", "")
    with TestClient(create_app(settings, token=TOKEN, client=client), headers=AUTH) as web:
        home = web.get("/")
        assert home.status_code == 200, home.text
        assert home.text.count(">no listener</span>") == 1
        assert "schedule typo: no live listener registers Reportz" in home.text


def test_doctor_with_redis_down_still_reports_each_check(
    client: Client, db_url: str, tmp_path: Path
) -> None:
    """The check for unregistered classes reads Redis's clock: Redis down, it is left out (no
    listener to tell about), and doctor still prints every check instead of one error line."""
    client.schedule("reports", Report.build, "eu", every_s=3600)
    env = _env("redis://127.0.0.1:1/0", db_url, tmp_path)  # nothing listens on port 1
    doctor = CliRunner().invoke(app, ["doctor"], env=env)
    assert doctor.exit_code == 1 and isinstance(doctor.exception, SystemExit), doctor.output
    assert "[fail] redis" in doctor.stdout and "[  ok] table" in doctor.stdout, doctor.output
    assert "error:" not in doctor.output and "Traceback" not in doctor.output


@pytest.mark.parametrize(
    ("catch_up", "says"),
    [
        ("none", "skipped (catch_up=none); next run "),
        ("latest", ": one run now, for the latest ("),
        ("all", ": each runs now in turn (catch_up=all, the last 100 at most), from "),
    ],
)
def test_schedule_resume_says_what_its_catch_up_does(
    client: Client,
    settings: Settings,
    redis_url: str,
    db_url: str,
    tmp_path: Path,
    catch_up: str,
    says: str,
) -> None:
    sched = client.schedule("chores", Report.build, "c", every_s=1, catch_up=catch_up)
    assert client.pause_schedule("chores")
    occurrence = sched.occurrence_ms
    assert occurrence is not None
    wait_until(lambda: client.clock.now_ms() > occurrence + 2500, 10)
    env = _env(redis_url, db_url, tmp_path)
    resumed = CliRunner().invoke(app, ["schedule", "resume", "chores"], env=env)
    assert resumed.exit_code == 0, resumed.output
    assert "catches up now" not in resumed.stdout
    assert says in resumed.stdout, resumed.stdout
    assert "runs missed since " in resumed.stdout
