"""Hostile and careless settings, URLs and API arguments: credentials never shown whatever their
spelling, intervals that would spin refused, bad values refused with one line and exit code 1
(never a traceback), and the log saying a recurring thing once.

Pure checks need no server; the CLI, listener and embedded-server checks run real ones.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from loguru import logger
from typer.testing import CliRunner

import keyexpiry
from keyexpiry import Client, Listener, Settings
from keyexpiry.aio import AsyncClient
from keyexpiry.bench.servers import wait_until
from keyexpiry.bench.servers.mariadb import MariaDBServer
from keyexpiry.cli import app
from keyexpiry.errors import ArgumentError, ConfigError
from keyexpiry.keys import format_key, sentinel_key
from keyexpiry.ledger.store import NewTask, TaskStatus
from keyexpiry.log import _format
from keyexpiry.masking import mask_url, redact, url_secrets
from keyexpiry.ops.metrics import NAMES, ListenerCollector
from keyexpiry.redis.embedded import ensure_embedded_redis, is_running, stop_embedded_redis
from keyexpiry.runtime import redis_client, redis_options
from keyexpiry.settings import _RANGES
from tests.conftest import RedisFactory
from tests.ke import Running, make_settings

StartListener = Callable[[Settings], Running]
ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


# --- credentials: one masking function, whatever the spelling ---------------------------------

SECRET_NAMES = (
    "password", "passwd", "pwd", "ssl_password", "ssl_keyfile_password", "sentinel_password",
    "token", "secret", "api_key", "apikey", "auth_token", "client_secret", "access_token",
)  # fmt: skip


def _spellings(name: str) -> st.SearchStrategy[str]:
    """`name` as a URL may spell it: any case, `-` for `_`, one character percent-encoded."""

    def spell(case: list[bool], dash: bool, encoded: int) -> str:
        text = "".join(c.upper() if up else c for c, up in zip(name, case, strict=False))
        text += name[len(case) :]
        if dash:
            text = text.replace("_", "-")
        i = encoded % len(text)
        return text[:i] + f"%{ord(text[i]):02X}" + text[i + 1 :] if encoded >= 0 else text

    return st.builds(
        spell,
        st.lists(st.booleans(), max_size=len(name)),
        st.booleans(),
        st.integers(min_value=-len(name), max_value=len(name) - 1),
    )


SECRETS = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=6, max_size=30
).filter(lambda s: s.strip() == s)
SCHEMES = st.sampled_from(
    ["redis", "rediss", "unix", "redis+sentinel", "redis+cluster", "mysql+pymysql", "sqlite"]
)


@given(
    scheme=SCHEMES,
    name=st.sampled_from(SECRET_NAMES).flatmap(_spellings),
    secret=SECRETS,
    user_secret=SECRETS,
    encode=st.booleans(),
)
@example(
    scheme="mysql+pymysql", name="passwd", secret="S3CRET", user_secret="hunter22", encode=False
)
@example(scheme="redis", name="pass%77ord", secret="S3CRET", user_secret="hunter22", encode=False)
def test_no_known_secret_survives_masking(
    scheme: str, name: str, secret: str, user_secret: str, encode: bool
) -> None:
    def written(value: str) -> str:
        return quote(value, safe="") if encode else quote(value, safe="/?#=:;+")

    url = (
        f"{scheme}://ke:{written(user_secret)}@db.example:1/0"
        f"?db=1&{name}={quote(secret, safe='')}&ssl=true"
    )
    shown = mask_url(url)
    for value in (secret, user_secret):
        for form in {value, quote(value, safe=""), written(value)}:
            if form not in "://ke:@db.example:1/0?db=1&ssl=true" + name + scheme:
                assert form not in shown, (url, shown)
    assert "ke:***@db.example:1/0" in shown and "db=1" in shown and "ssl=true" in shown
    # A message that quotes the URL (or a piece of it) is cleaned the same way.
    leaked = redact(f"cannot parse {url}: {secret!r}, {user_secret}", url)
    assert secret not in leaked and user_secret not in leaked


@pytest.mark.parametrize(
    "url, shown",
    [
        ("mysql+pymysql://u@h/db?passwd=S3CRET", "mysql+pymysql://u@h/db?passwd=***"),
        ("rediss://h:6380/0?ssl_password=S3CRET", "rediss://h:6380/0?ssl_password=***"),
        ("redis://h/0?pass%77ord=S3CRET", "redis://h/0?pass%77ord=***"),
        ("redis://h/0?PWD=S3CRET&db=2", "redis://h/0?PWD=***&db=2"),
        ("mysql+pymysql://u:S3/CR?E#T@h/db", "mysql+pymysql://u:***@h/db"),
        ("redis+cluster://u:S3CR/ET@h:1,g:2", "redis+cluster://u:***@h:1,g:2"),
        ("redis://u:S3CRET@[::1/0", "redis://u:***@[::1/0"),
        ("rediss://u:S3?CR#ET@h/0", "rediss://u:***@h/0"),
        ("redis://h:6379/0?client_name=a@b", "redis://h:***@b"),  # on the safe side
    ],
)
def test_every_credential_spelling_is_masked(url: str, shown: str) -> None:
    assert mask_url(url) == shown
    assert "S3" not in shown and "CR" not in shown
    if "S3" in url:
        assert url_secrets(url) and all("S3" in s or "ET" in s for s in url_secrets(url))


def test_a_parser_error_quoting_a_piece_of_the_password_is_cleaned() -> None:
    # urlsplit cuts the netloc at the `/` inside the password: `u:pass` looks like host:port.
    with pytest.raises(ConfigError) as info:
        Settings(redis_url="redis+cluster://u:pass/word@h:1")
    assert "pass" not in str(info.value).replace("password", ""), info.value


@pytest.fixture
def passworded_db(mariadb_server: MariaDBServer, mysql_url: str) -> Iterator[str]:
    """`mysql_url` as a user whose password is given PyMySQL's way: `?passwd=`."""
    db = mysql_url.rsplit("/", 1)[1]
    admin = mariadb_server.admin_connection()
    try:
        with admin.cursor() as cur:
            cur.execute("CREATE USER 'ke_pw'@'%' IDENTIFIED BY 'Hunter2Secret'")
            cur.execute(f"GRANT ALL ON `{db}`.* TO 'ke_pw'@'%'")
        yield mysql_url.replace("root@", "ke_pw@") + "?passwd=Hunter2Secret"
    finally:
        with admin.cursor() as cur:
            cur.execute("DROP USER IF EXISTS 'ke_pw'@'%'")
        admin.close()


# PyMySQL warns that `passwd` is deprecated, and still reads it: users write it.
@pytest.mark.filterwarnings("ignore:'passwd' is deprecated:DeprecationWarning")
def test_a_passwd_query_password_never_shows_in_doctor_errors_or_the_log(
    passworded_db: str, redis_url: str, tmp_path: Path, start_listener: StartListener
) -> None:
    env = {
        "KEYEXPIRY_REDIS_URL": redis_url,
        "KEYEXPIRY_DATABASE_URL": passworded_db,
        "KEYEXPIRY_STATE_DIR": str(tmp_path / "state"),
        "KEYEXPIRY_SENTINEL_COUNT": "0",
    }
    assert runner.invoke(app, ["init-db"], env=env).exit_code == 0
    doctor = runner.invoke(app, ["doctor"], env=env)
    # A database that does not exist: the error names the URL, masked.
    missing = passworded_db.replace("/t_", "/nope_")
    failed = runner.invoke(app, ["list"], env={**env, "KEYEXPIRY_DATABASE_URL": missing})
    assert failed.exit_code == 1 and "passwd=***" in failed.stderr, failed.stderr
    log_lines: list[str] = []  # added after the commands: each one sets the log up anew
    sink = logger.add(log_lines.append, level="INFO", format=_format, colorize=False)
    try:
        start_listener(make_settings(redis_url, passworded_db, tmp_path)).stop()
    finally:
        logger.remove(sink)
    started = [line for line in log_lines if "starting: redis" in line]
    assert started and "passwd=***" in started[0], log_lines
    for text in (doctor.output, failed.output, "\n".join(log_lines)):
        assert "Hunter2Secret" not in text


# --- settings: bounds, log level, malformed URLs ------------------------------------------------

INTERVALS = [name for name in _RANGES if name.endswith("_s")]


@pytest.mark.parametrize("name", INTERVALS)
def test_no_interval_or_duration_setting_accepts_a_busy_loop(name: str) -> None:
    env = {f"KEYEXPIRY_{name.upper()}": "1e-300"}
    if name in ("shutdown_timeout_s", "lease_grace_s", "stuck_after_s"):
        Settings.from_env(env)  # 0 is meaningful there (no wait, no grace) and spins nothing
        return
    if name.startswith("retain_"):
        Settings.from_env(env)  # 0 keeps rows forever; a tiny one prunes at once, no loop
        return
    if name == "takeover_after_s":  # bounded below by twice heartbeat_s
        with pytest.raises(ConfigError, match="takeover_after_s must be at least twice"):
            Settings.from_env(env)
        return
    if name == "health_check_interval_s":
        # 0 turns redis-py's health check off; a tiny one would PING before every read of
        # the subscription, and each PONG ends that read at once: a loop of round trips.
        with pytest.raises(ConfigError, match=r"^health_check_interval_s must be 0 \(off\) or"):
            Settings.from_env(env)
        return
    with pytest.raises(ConfigError, match=rf"^{name} must be from [0-9.]+ to "):
        Settings.from_env(env)


@pytest.mark.parametrize("value", [0, 0.05, 0.5, 2.5])
def test_the_redis_health_check_is_off_at_0_and_fractions_of_a_second_are_kept(
    value: float, redis_url: str, tmp_path: Path
) -> None:
    """redis-py's own `health_check_interval`: 0 is off (no PING), and a fraction of a second
    is what redis-py gets (`int()` made 0.5 into 0: the check silently off)."""
    settings = Settings.from_env(
        {
            "KEYEXPIRY_REDIS_URL": redis_url,
            "KEYEXPIRY_STATE_DIR": str(tmp_path),
            "KEYEXPIRY_HEALTH_CHECK_INTERVAL_S": str(value),
        }
    )
    assert settings.health_check_interval_s == value
    for pubsub in (False, True):
        assert redis_options(redis_url, settings, pubsub=pubsub)["health_check_interval"] == value
    redis = redis_client(redis_url, settings)
    try:
        redis.ping()
        conn = redis.connection_pool.get_connection()
        try:
            assert conn.health_check_interval == value
        finally:
            redis.connection_pool.release(conn)
        if value and value < 1:
            # Idle longer than the interval, the next command is preceded by a PING.
            pings = _pings(redis)
            wait_until(
                lambda: redis.get("health-check-probe") is None and _pings(redis) > pings + 1,
                10,
                interval_s=2 * value,
                message="no health-check PING",
            )
    finally:
        redis.close()


def _pings(redis: Any) -> int:
    return int(redis.info("commandstats").get("cmdstat_ping", {}).get("calls", 0))


@pytest.mark.parametrize("value", ["-1", "0.01", "3601"])
def test_a_health_check_interval_outside_0_or_its_range_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^health_check_interval_s must be"):
        Settings.from_env({"KEYEXPIRY_HEALTH_CHECK_INTERVAL_S": value})


@pytest.mark.parametrize(
    "env, message",
    [
        ({"KEYEXPIRY_HEARTBEAT_S": "1e-300"}, "error: heartbeat_s must be from 0.05 to 60"),
        ({"KEYEXPIRY_LEASE_CHECK_S": "1e-300"}, "error: lease_check_s must be from 0.05 to"),
        ({"KEYEXPIRY_LOG_LEVEL": "bogus"}, "error: log level 'bogus': use one of TRACE, DEBUG"),
        (
            {"KEYEXPIRY_REDIS_URL": "redis://u:pw@[::1/0"},
            "error: redis_url 'redis://u:***@[::1/0' is not a valid URL: Invalid IPv6 URL",
        ),
        (
            {"KEYEXPIRY_DATABASE_URL": "mysql+pymysql://u:pw@[::1/db"},
            "error: database_url 'mysql+pymysql://u:***@[::1/db' is not a valid URL",
        ),
    ],
)
def test_bad_settings_are_one_line_and_exit_1(
    env: dict[str, str], message: str, tmp_path: Path
) -> None:
    result = runner.invoke(app, ["list"], env={"KEYEXPIRY_STATE_DIR": str(tmp_path), **env})
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.output


def test_web_bind_errors_name_the_option_given() -> None:
    result = runner.invoke(app, ["web", "--bind", "nonsense"])
    assert result.exit_code == 1
    expected = "error: --bind 'nonsense': expected HOST:PORT, e.g. 127.0.0.1:9464"
    assert result.stderr.strip() == expected
    with pytest.raises(ConfigError, match=r"^--http 'nonsense'"):
        Settings(http="nonsense")


# --- the library API: statuses and limits as callers write them ---------------------------------


def test_list_accepts_status_names_and_refuses_bad_values(client: Client) -> None:
    key = client.create("Probe.record", "listed", ttl_s=60)
    assert [r.key for r in client.list(status="pending")] == [key]
    assert [r.key for r in client.list_tasks("pending", 5)] == [key]
    assert client.list(status="done") == [] and client.list(status=TaskStatus.PENDING)
    for bad, message in [
        ({"status": "bogus"}, "status must be one of 'pending', 'running', 'done', 'dead', "),
        ({"status": 3}, "status must be one of"),
        ({"limit": -1}, "limit must be from 1 to 100000, got -1"),
        ({"limit": 0}, "limit must be from 1 to 100000, got 0"),
        ({"limit": 2.5}, "limit must be a whole number, got 2.5"),
        ({"limit": True}, "limit must be a number, got bool True"),
    ]:
        with pytest.raises(ArgumentError, match=f"^{re.escape(message)}"):
            client.list(**bad)  # type: ignore[arg-type]


def test_the_async_client_lists_by_status_name(settings: Settings) -> None:
    async def run() -> None:
        async with AsyncClient(settings) as ke:
            key = await ke.create("Probe.record", "async-listed", ttl_s=60)
            assert [r.key for r in await ke.list_tasks("pending", 5)] == [key]
            assert await ke.list(status="done") == []
            with pytest.raises(ArgumentError, match=r"^limit must be from 1"):
                await ke.list_tasks("pending", -1)

    asyncio.run(run())


def test_every_error_readme_names_is_importable_from_keyexpiry() -> None:
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"\b([A-Z][A-Za-z]+Error)\b", readme))
    assert "ArgumentError" in named
    for name in named | {"DoNotRetry", "Retry", "KeyExpiryError", "ConfigError", "StoreError"}:
        assert issubclass(getattr(keyexpiry, name), Exception), name
        assert name in keyexpiry.__all__


# --- the embedded server stops at once -----------------------------------------------------------


def test_stopping_the_embedded_server_takes_well_under_a_second(tmp_path: Path) -> None:
    state = tmp_path / "state"
    ensure_embedded_redis(state)
    try:
        started = time.monotonic()
        assert stop_embedded_redis(state)
        took_s = time.monotonic() - started
        assert not is_running(state)
        assert took_s < 1.0, f"stop took {took_s:.2f} s"  # was 4-5.5 s (redis-py's retries)
    finally:
        stop_embedded_redis(state)
        wait_until(lambda: not is_running(state), 10, message="embedded redis-server still up")


# --- CLI polish ----------------------------------------------------------------------------------

ISO_WITH_OFFSET = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d"


def test_list_has_a_header_and_the_time_format_show_prints(cli_env: dict[str, str]) -> None:
    assert runner.invoke(app, ["create", "Probe", "record", "t", "--ttl", "60"], env=cli_env)
    listed = runner.invoke(app, ["list"], env=cli_env)
    header, row = listed.stdout.splitlines()
    assert header.split() == ["STATUS", "TRIES", "DUE", "KEY", "[TAG]"]
    due = re.search(ISO_WITH_OFFSET, row)
    assert due and row.split()[:2] == ["pending", "0"] and row.endswith("Probe@record@t"), row
    shown = runner.invoke(app, ["show", "Probe", "record", "t"], env=cli_env).stdout
    assert f"due_at: {due.group()}" in shown, shown


def test_usage_names_a_task_the_same_way_in_every_command() -> None:
    for command, usage in [
        ("create", "CLASS METHOD [ARG]..."),
        ("show", "CLASS METHOD [ARG]..."),
        ("cancel", "[CLASS METHOD [ARG]...]"),
        ("retry", "[CLASS METHOD [ARG]...]"),
    ]:
        out = runner.invoke(app, [command, "--help"], prog_name="keyexpiry").stdout
        assert f"Usage: keyexpiry {command} [OPTIONS] {usage}" in out, out


def test_top_level_help_summaries_are_not_hard_wrapped() -> None:
    wide = CliRunner(env={"COLUMNS": "300", "TERMINAL_WIDTH": "300"})
    out = wide.invoke(app, ["--help"]).stdout
    # Each summary on its command's line: none carries a docstring's line break into the table.
    for command, words in [
        ("cancel", "--tag every pending task tagged so (prints how many"),
        ("init-db", "add what it lacks, and drop the indexes"),
        ("listeners", "running tasks and their share of the task keys."),
    ]:
        line = next(x for x in out.splitlines() if re.search(rf"│ {command}\s", x))
        assert words in line, out


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"keyexpiry {keyexpiry.__version__}\n"


def test_a_listener_that_never_connected_does_not_say_connection_lost(
    tmp_path: Path, log_lines: list[str], redis_factory: RedisFactory
) -> None:
    down = redis_factory(start=False)
    listener = Listener(make_settings(down.url(), f"sqlite:///{tmp_path / 'l.sqlite3'}", tmp_path))
    thread = threading.Thread(target=listener.run, daemon=True)
    thread.start()
    try:
        wait_until(
            lambda: any("could not connect to Redis" in line for line in log_lines),
            15,
            message=f"no could-not-connect line: {log_lines}",
        )
        assert not any("connection lost" in line for line in log_lines), log_lines
    finally:
        listener.stop()
        thread.join(timeout=30)


# --- log noise: a recurring thing said once, then counted -----------------------------------------


def test_rows_that_never_run_are_reported_once_then_counted(
    client: Client, settings: Settings, start_listener: StartListener, log_lines: list[str]
) -> None:
    running = start_listener(settings)
    listener = running.listener
    now_ms = client.clock.now_ms()
    unregistered = format_key("Elsewhere", "run", ["1"])
    private = "Probe@_private@1"  # no producer of keyexpiry's writes it: another one might
    client.store.upsert_pending(
        [
            NewTask(unregistered, "Elsewhere", "run", ("1",), now_ms - 5000),
            NewTask(private, "Probe", "_private", ("1",), now_ms - 5000),
        ],
        now_ms,
    )
    # lease_check_s is 0.3 s here: each row is repaired again at every check.
    wait_until(
        lambda: listener.reconciler.overdue_repeats_total >= 6,
        20,
        message=f"repeats {listener.reconciler.overdue_repeats_total}",
    )
    # Each said exactly once: the overdue line (naming both) and the line saying why it
    # cannot run here, however many checks met it again.
    refusals = {unregistered: "is not registered", private: "ignored key: method name"}
    for key, refusal in refusals.items():
        about = [line for line in log_lines if key in line]
        overdue = [line for line in about if "overdue" in line]
        refused = [line for line in about if refusal in line]
        assert len(overdue) == 1 and len(refused) == 1 and len(about) == 2, about
    served = {
        family.name: family.samples[0].value
        for family in ListenerCollector(listener, lambda: True).collect()
        if family.name == "keyexpiry_overdue_repeats"
    }
    assert served["keyexpiry_overdue_repeats"] >= 6
    assert "keyexpiry_overdue_repeats_total" in NAMES


def test_forged_sentinel_events_log_one_line(
    client: Client, settings: Settings, start_listener: StartListener, log_lines: list[str]
) -> None:
    listener = start_listener(settings).listener
    for _ in range(20):
        client.redis.publish("__keyevent@0__:expired", sentinel_key(1))
    wait_until(lambda: listener.router.sentinels >= 20, 10, message="sentinels not heard")
    said = [line for line in log_lines if "sentinel" in line and "fired" in line]
    assert len(said) == 1 and "INFO" in said[0], said  # said (once), not silenced
    events = next(
        f
        for f in ListenerCollector(listener, lambda: True).collect()
        if f.name == "keyexpiry_events"
    )
    assert {s.labels["kind"]: s.value for s in events.samples}["sentinel"] >= 20


# --- README's first task runs as written --------------------------------------------------------


def test_the_readme_first_task_runs_as_written(cli_env: dict[str, str], tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Your first task", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    shell = re.search(r"```sh\n(.*?)```", section, re.S)
    assert code and shell
    (tmp_path / "hello.py").write_text(code.group(1))
    listen, create = (
        shlex.split(line.split("#", 1)[0].replace(".venv/bin/keyexpiry", "", 1))
        for line in shell.group(1).strip().splitlines()
    )
    env = {**os.environ, **cli_env}
    del env["KEYEXPIRY_TASKS"]  # the README's commands name their module
    out = tmp_path / "listen.out"
    with out.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "keyexpiry", *listen],
            cwd=tmp_path, env=env, stdout=sink, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            wait_until(lambda: "subscribed to" in out.read_text(), 30, message=out.read_text())
            made = subprocess.run(
                [sys.executable, "-m", "keyexpiry", *create],
                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            assert made.returncode == 0 and made.stdout.strip() == "Hello@greet@world", made
            wait_until(lambda: "hello, world" in out.read_text(), 15, message=out.read_text())
            wait_until(lambda: "Hello@greet@world #1] done" in out.read_text(), 5)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
