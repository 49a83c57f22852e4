"""Hostile and bad input: refused at create with one clear line, or ignored at listen time with
at most one short log line, and the listener keeps running tasks afterwards.

Listen-time tests use a real redis-server and both ledgers; keys are set straight in Redis (as
another program, or an attacker with access to Redis, would) with raw bytes.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import os
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import pytest
import redis
from typer.testing import CliRunner

from keyexpiry import Client, Settings
from keyexpiry.bench.servers import wait_until
from keyexpiry.cli import app
from keyexpiry.errors import ArgumentError, KeyExpiryError, KeyFormatError, UnknownTaskError
from keyexpiry.keys import MAX_KEY_BYTES
from keyexpiry.ledger.store import TaskStatus
from keyexpiry.listener import subscription
from keyexpiry.redis.arming import WAKE_MAX_BYTES
from tests import sample_tasks
from tests.conftest import RedisFactory
from tests.ke import Running, make_settings, wait_status
from tests.reliability import Verdict

StartListener = Callable[[Settings], Running]
ROOT = Path(__file__).resolve().parents[1]
MB = 1024 * 1024
LINE_LIMIT = 400
"""Longest log line or error message any hostile input may produce."""


def _traced_mb() -> float:
    gc.collect()
    return tracemalloc.get_traced_memory()[0] / MB


def _about(lines: list[str], needle: str) -> list[str]:
    return [line for line in lines if needle in line]


# --- listen time ---------------------------------------------------------------------------------

# Keys that claim to be tasks of ours but are not runnable: each is worth exactly one log line.
# (raw key, a text its one line contains)
REFUSED = [
    (b"Probe@record@%zz", "Probe@record@%zz"),  # bad escape
    (b"Probe@record@%41", "Probe@record@%41"),  # not canonical ('A' needs no escape)
    (b"Probe@record@a b", "Probe@record@a b"),  # unescaped space
    (b"Probe@record@line\nERROR forged", "line\\nERROR forged"),  # a forged log line
    (b"Probe@not_exposed@x", "Probe@not_exposed@x"),
    (b"Probe@__class__@x", "Probe@__class__@x"),
    (b"Probe@__init__", "Probe@__init__"),
    (b"os@system@ls", "os@system@ls"),  # well-formed: a task of a listener with other --tasks?
    (b"builtins@eval@1", "builtins@eval@1"),
    (b"Probe@record@\xff\xfe", "Probe@record@\\xff\\xfe"),  # not UTF-8
    (b"Probe@record@" + b"x" * MB, "Probe@record@xxxx"),  # 1 MB name: over the key limit
]
NO_ROW = (b"Probe@record@no-row", "Probe@record@no-row")
"""A valid key of a registered task with no ledger row: claimed, nothing found, one line."""
# Other applications' keys in the same database: dropped without a word.
FOREIGN = [
    b"session:3fa2b9c4",
    b"cache:user:1",
    b"alice@example.com",
    b"celery-task-meta-5b0f3a1e-9d4c-4a53-8c1e-2f6f0f0b7a10",
    b"garbage",
    b"\xff\xfe@record@x",
    b"Task@__class__@x",  # an unregistered class, and not even well-formed
    b"blob:" + b"y" * MB,
]


def test_hostile_keys_are_ignored_with_one_short_line_each_and_foreign_keys_silently(
    client: Client, settings: Settings, start_listener: StartListener, log_lines: list[str]
) -> None:
    running = start_listener(settings)
    listener = running.listener
    r = client.redis
    keys = [raw for raw, _ in REFUSED] + [NO_ROW[0]] + FOREIGN
    pipe = r.pipeline(transaction=False)
    for raw in keys:
        pipe.set(raw, b"", px=20)
    pipe.execute()
    # A lookup expires a key at once (and publishes `expired`) instead of at Redis's next sweep.
    wait_until(lambda: r.exists(*keys) == 0, 5)

    def counts() -> tuple[int, int, int]:
        return listener.ignored, listener.foreign, listener.dispatcher.stats.not_claimed

    with contextlib.suppress(AssertionError):  # the assert below says what is missing
        wait_until(lambda: sum(counts()) >= len(keys), 20)
    assert listener.dispatcher.wait_idle(20)
    assert counts() == (len(REFUSED), len(FOREIGN), 1)

    key = client.create("Probe.record", "after-the-noise", ttl_ms=50)
    wait_status(client, key, TaskStatus.DONE)
    assert running.thread.is_alive()
    assert dict(sample_tasks.CALLS) == {key: 1}
    assert client.store.counts() == {"done": 1}  # no hostile key made a row

    about_keys = [line for line in log_lines if "after-the-noise" not in line and "[" in line]
    for raw, needle in [*REFUSED, NO_ROW]:
        assert len(_about(about_keys, needle)) == 1, (raw[:40], _about(about_keys, needle))
    # Every line about a key is one of those: the foreign keys logged nothing.
    needles = [n for _, n in [*REFUSED, NO_ROW]]
    strays = [line for line in about_keys if not any(n in line for n in needles)]
    assert not strays
    for raw in FOREIGN:
        assert not _about(log_lines, ascii(raw[:12])[2:-1]), raw[:12]
    for line in log_lines:
        assert line.count("\n") == 1 and len(line) < LINE_LIMIT, line[:200]


def test_wake_messages_longer_than_keyexpiry_sends_are_dropped_with_one_line(
    client: Client, settings: Settings, start_listener: StartListener, log_lines: list[str]
) -> None:
    """Anyone who may PUBLISH can write on the wake channel: a message larger than any the
    arming code sends is dropped unread (one line for all of them), and the driver goes on."""
    running = start_listener(settings)
    listener = running.listener
    # Due in a second, inside the driver's window: parsed, it would fill the driver's heap.
    line = f"{client.clock.now_ms() + 1000} Probe@record@x\n".encode()
    hostile = line * (2 * WAKE_MAX_BYTES // len(line))
    wait_until(lambda: running.listener.driver.is_leader, 5)
    for n in range(1, 4):
        client.redis.publish(listener.wake_channel, hostile)

        def refused(n: int = n) -> bool:
            if listener.wakes_refused >= n:
                return True
            if not listener.subscribed.is_set():
                return False
            # A message in flight when the subscription dropped (seen under CI load) is gone
            # with it: send it again once subscribed, as its publisher would have to.
            if listener.gaps and listener.wakes_refused < n:
                client.redis.publish(listener.wake_channel, hostile)
            return False

        wait_until(refused, 10, interval_s=0.5)
    assert listener.driver.pending_count() == 0
    key = client.create("Probe.record", "after-the-wakes", ttl_ms=50)
    wait_status(client, key, TaskStatus.DONE)
    assert running.thread.is_alive()
    assert len(_about(log_lines, "longer than keyexpiry sends")) == 1
    for line in log_lines:
        assert line.count("\n") == 1 and len(line) < LINE_LIMIT, line[:200]


def test_a_33_mb_key_name_that_reaches_the_listener_costs_one_short_line_and_no_memory(
    redis_factory: RedisFactory,
    db_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    log_lines: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Redis's default pubsub output limit (32 MB) would drop the subscriber before this event
    # reached it (the next test); lifted here, the 33 MB event really arrives. Building the
    # key blocks Redis for a second or more on a loaded machine: the subscription's PING would
    # go unanswered and the listener resubscribe (as it must for a stalled link), losing the
    # event this test is about; its patience is lengthened here.
    monkeypatch.setattr(subscription, "PROBE_PATIENCE_S", 30.0)
    server = redis_factory(args=["--client-output-buffer-limit", "pubsub 0 0 0"])
    settings = make_settings(server.url(0), db_url, tmp_path)
    running = start_listener(settings)
    listener = running.listener
    submitted = listener.dispatcher.stats.submitted
    tracemalloc.start()
    try:
        before = _traced_mb()
        tracemalloc.reset_peak()
        admin = server.client()
        # Built by Redis itself: the only copy this process sees is the one the listener reads.
        admin.eval(
            "redis.call('SET', 'Probe@record@' .. string.rep('x', ARGV[1]), '', 'PX', 20)",
            0,
            str(33 * MB),
        )
        admin.close()
        wait_until(lambda: listener.ignored == 1, 60)  # 33 MB through a traced parser: slow
        # Released once the listener thread has moved on (it may still be in that step now).
        wait_until(lambda: _traced_mb() - before < 4, 30, interval_s=0.05)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak / MB - before > 33  # it did come through this process
    assert listener.dispatcher.stats.submitted == submitted  # never queued for the claimer
    (line,) = _about(log_lines, "Probe@record@xxxx")
    assert "longer than the 512-byte key limit" in line and len(line) < LINE_LIMIT
    with Client(settings) as c:
        key = c.create("Probe.record", "after-33mb", ttl_ms=50)
        wait_status(c, key, TaskStatus.DONE)
    assert running.thread.is_alive()


def test_a_33_mb_key_name_drops_the_subscriber_and_the_listener_recovers(
    client: Client,
    settings: Settings,
    start_listener: StartListener,
    verdict: Verdict,
    log_lines: list[str],
) -> None:
    """At Redis's default `client-output-buffer-limit pubsub 32mb`, a 33 MB event makes Redis
    close the subscriber's connection, with every event queued behind it. redis-py reconnects
    and re-subscribes by itself; the listener notices the gap and reconciles."""
    running = start_listener(settings)
    keys = [client.create("Probe.record", f"near-33mb-{i}", ttl_ms=30 + 10 * i) for i in range(20)]
    client.redis.eval(
        "redis.call('SET', 'Probe@record@' .. string.rep('x', ARGV[1]), '', 'PX', 20)",
        0,
        str(33 * MB),
    )
    wait_until(lambda: running.listener.gaps >= 1, 10, message="the subscriber was not dropped")
    verdict.check(client, keys, since_ms=client.clock.now_ms())
    key = client.create("Probe.record", "after-33mb", ttl_ms=50)
    wait_status(client, key, TaskStatus.DONE)
    assert running.thread.is_alive()
    assert all(len(line) < LINE_LIMIT for line in log_lines)


def test_a_task_key_expiring_in_another_database_does_not_run(
    settings: Settings, start_listener: StartListener
) -> None:
    """A client and listener on /3 work together; the same key expiring in /0 runs nothing."""
    sample_tasks.reset()
    assert settings.redis_url is not None and settings.redis_url.endswith("/0")
    on3 = settings.replace(redis_url=settings.redis_url[:-1] + "3")
    running = start_listener(on3)
    assert running.listener.channel == "__keyevent@3__:expired"
    db0 = redis.Redis.from_url(settings.redis_url)
    watch = db0.pubsub()
    try:
        watch.subscribe("__keyevent@0__:expired")
        with Client(on3) as c3:
            key = c3.create("Probe.record", "in-db3", ttl_ms=1000)
            assert c3.redis.exists(key) == 1 and db0.exists(key) == 0
            submitted = running.listener.dispatcher.stats.submitted
            stray = "Probe@record@only-in-db0"
            db0.set(key, b"", px=10)
            db0.set(stray, b"", px=10)
            wait_until(lambda: db0.exists(key, stray) == 0, 5)
            # Both expiries were announced, on db 0's channel.
            seen: set[bytes] = set()

            def announced() -> bool:
                msg = watch.get_message(ignore_subscribe_messages=True, timeout=0.05)
                if msg is not None and msg["type"] == "message":
                    seen.add(msg["data"])
                return seen >= {key.encode(), stray.encode()}

            wait_until(announced, 5)
            assert running.listener.dispatcher.stats.submitted == submitted  # not even heard
            row = c3.store.get(key)
            assert row is not None and row.status is TaskStatus.PENDING
            assert not sample_tasks.CALLS
            row = wait_status(c3, key, TaskStatus.DONE, timeout_s=10)
            assert row.started_at_ms is not None and row.started_at_ms >= row.due_at_ms
            assert dict(sample_tasks.CALLS) == {key: 1}
            assert c3.store.get(stray) is None
    finally:
        watch.close()
        db0.close()


# --- create time ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target, args, error, match",
    [
        ("Probe.not_exposed", ("x",), UnknownTaskError, "not an exposed task method"),
        (sample_tasks.Probe.not_exposed, ("x",), UnknownTaskError, "not an exposed method"),
        ("Probe.__class__", ("x",), UnknownTaskError, "not an exposed task method"),
        ("Probe.__init__", (), UnknownTaskError, "not an exposed task method"),
        (sample_tasks.Probe.__init__, (), UnknownTaskError, "not an exposed method"),
        ("os.system", ("ls",), UnknownTaskError, "'os' is not registered"),
        ("os@system@ls", (), UnknownTaskError, "'os' is not registered"),
        (os.system, ("ls",), UnknownTaskError, "not an exposed method"),
        ("builtins.eval", ("1",), UnknownTaskError, "'builtins' is not registered"),
        (eval, ("1",), UnknownTaskError, "not an exposed method"),
        ("A" * MB + ".run", (), UnknownTaskError, "is not registered"),
        ("Probe", (), UnknownTaskError, "name a task as"),
        ("Probe.record", ("x" * MB,), KeyFormatError, f"the limit is {MAX_KEY_BYTES}"),
        ("Probe.record", ("é" * 200,), KeyFormatError, f"the limit is {MAX_KEY_BYTES}"),
        ("Probe.record", ("\udcff",), KeyFormatError, "not valid text"),
        ("Probe.record", (b"x",), ArgumentError, "must be str, got bytes"),
        ("Probe.record", ("a", "b"), ArgumentError, "takes 1 argument"),
        ("Probe.typed", ("9" * MB, "1", "true", "0.5"), ArgumentError, "'n' must be int"),
        ("Probe.typed", ("1", "1", "true", "z" * MB), ArgumentError, "'ratio' must be float"),
        ("Probe.typed", ("1", "1", "y" * MB, "0.5"), ArgumentError, "'flag' must be bool"),
        ("Probe.typed", ("1", "1\x00", "true", "0.5"), ArgumentError, "'price' must be Decimal"),
    ],
    ids=lambda v: v[:40] if isinstance(v, str) else None,
)
def test_bad_input_is_refused_at_create_with_one_short_line_and_writes_nothing(
    client: Client, target: object, args: tuple[object, ...], error: type, match: str
) -> None:
    with pytest.raises(error, match=match) as caught:
        client.create(target, *args, ttl_s=60)  # type: ignore[arg-type]
    assert isinstance(caught.value, KeyExpiryError)
    text = str(caught.value)
    assert "\n" not in text and len(text) < LINE_LIMIT, text[:200]
    assert client.store.counts() == {} and client.redis.dbsize() == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["os", "system", "ls"], "error: task class 'os' is not registered"),
        (["builtins", "eval", "1"], "error: task class 'builtins' is not registered"),
        (["Probe", "__init__"], "error: Probe.__init__ is not an exposed task method"),
        (["Probe", "record", "x" * MB], "error: task key would be"),
        (["Probe", "typed", "n" * MB, "1", "true", "0.5"], "error: Probe.typed: argument 'n'"),
    ],
    ids=["module", "builtins", "dunder", "1mb-arg", "1mb-int"],
)
def test_the_cli_refuses_hostile_input_with_one_line_and_exit_1(
    cli_env: dict[str, str], args: list[str], message: str
) -> None:
    result = CliRunner().invoke(app, ["create", *args, "--ttl", "1"], env=cli_env)
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1
    assert len(result.stderr) < LINE_LIMIT


def test_the_cli_refuses_an_argument_that_is_not_utf8_without_a_traceback(
    cli_env: dict[str, str],
) -> None:
    # A real process: Python turns argv bytes that are not UTF-8 into lone surrogates.
    proc = subprocess.run(
        [sys.executable, "-m", "keyexpiry", "create", "Probe", "record", b"\xff\xfe", "--ttl", "1"],
        cwd=ROOT,
        env={**os.environ, **cli_env},
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == b""
    assert proc.stderr.startswith(b"error: argument ") and proc.stderr.count(b"\n") == 1
    assert b"Traceback" not in proc.stderr


ODD = [
    "a@b",
    "50%",
    "%41",
    "nul\x00byte",
    "emoji \U0001f600\U0001f44d\U0001f3fd",
    "",
    " \t\n",
    "é@%\x00\U0001f600",
]


def test_at_percent_nul_and_emoji_arguments_reach_the_handler_exactly(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    start_listener(settings)
    keys = {value: client.create("Probe.record", value, ttl_ms=50) for value in ODD}
    label = "\x00@%\U0001f600"
    typed = client.create("Probe.typed", 7, Decimal("-0.10"), False, 1e-300, label, ttl_ms=50)
    assert len(set(keys.values())) == len(ODD)
    assert all(k.isascii() and k.isprintable() for k in [*keys.values(), typed])
    for value, key in keys.items():
        row = wait_status(client, key, TaskStatus.DONE)
        assert row.args == (value,)
        assert sample_tasks.CALL_ARGS[key] == (value,)
    wait_status(client, typed, TaskStatus.DONE)
    assert sample_tasks.CALL_ARGS[typed] == (7, Decimal("-0.10"), False, 1e-300, label)
    assert all(sample_tasks.CALLS[k] == 1 for k in [*keys.values(), typed])


# --- values (refused at the door; never a dead thread) ------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"ttl_s": 60, "retry_schedule_s": [float("nan")]}, "retry_schedule_s[0]"),
        ({"ttl_s": 60, "retry_schedule_s": [1e300]}, "retry_schedule_s[0]"),
        ({"ttl_s": float("inf")}, "ttl_s"),
        ({"ttl_s": float("nan")}, "ttl_s"),
        ({"ttl_s": 1e12}, "ttl_s"),
        ({"ttl_ms": 99999999999999999999}, "ttl_ms"),
        ({"at": dt.datetime(1, 1, 1, tzinfo=dt.UTC)}, "at 0001-01-01"),
    ],
    ids=["nan-delay", "huge-delay", "inf-ttl", "nan-ttl", "year-33715", "huge-ttl-ms", "year-1"],
)
def test_bad_numbers_are_refused_at_create_naming_the_field(
    client: Client, kwargs: dict[str, object], field: str
) -> None:
    with pytest.raises(ArgumentError) as caught:
        client.create("Probe.always_fail", "x", **kwargs)  # type: ignore[arg-type]
    text = str(caught.value)
    assert text.startswith(field) and "\n" not in text and len(text) < LINE_LIMIT, text
    assert client.store.counts() == {} and client.redis.dbsize() == 0


@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), Decimal("NaN"), Decimal("-Infinity"), Decimal("sNaN")]
)
def test_values_that_cannot_run_are_refused_at_create(client: Client, value: object) -> None:
    args: list[object] = [7, Decimal("1.5"), True, 0.5]
    args[1 if isinstance(value, Decimal) else 3] = value
    with pytest.raises(ArgumentError, match="finite") as caught:
        client.create("Probe.typed", *args, ttl_s=60)
    assert "\n" not in str(caught.value)
    assert client.store.counts() == {}


def test_equal_arguments_make_one_task_that_cancel_finds(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    key = client.create("Probe.typed", 9, Decimal("19.90"), True, 5, ttl_s=60)
    # Same values, other spellings: the same key, one row.
    again = client.create("Probe.typed", 9.0, Decimal("19.9"), "true", 5.0, ttl_s=60)
    assert again == key and client.store.counts() == {"pending": 1}
    assert client.cancel("Probe.typed", "9", "19.900", "yes", "5") is True
    # The CLI's strings are read by the annotations too.
    running = start_listener(settings)
    key = client.create("Probe.typed", 9, Decimal("19.90"), True, 5, ttl_ms=30)
    wait_status(client, key, TaskStatus.DONE)
    assert sample_tasks.CALL_ARGS[key] == (9, Decimal("19.9"), True, 5.0, "x")
    assert running.listener.thread_errors.count == 0


def test_a_task_created_before_keys_were_canonical_can_still_be_cancelled(
    client: Client,
) -> None:
    from keyexpiry.keys import format_key
    from keyexpiry.ledger.store import NewTask

    # What keyexpiry 0.1 wrote for typed(9, Decimal("19.90"), True, 5): '19.90' and '5'.
    old = format_key("Probe", "typed", ["9", "19.90", "true", "5"])
    now_ms = client.clock.now_ms()
    client.store.upsert_pending(
        [NewTask(old, "Probe", "typed", ("9", "19.90", "true", "5"), now_ms + 60_000)], now_ms
    )
    assert client.cancel("Probe.typed", 9, Decimal("19.90"), True, 5) is True
    row = client.store.get(old)
    assert row is not None and row.status is TaskStatus.CANCELLED


def test_an_empty_retry_schedule_means_no_retries(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    running = start_listener(settings)
    key = client.create("Probe.always_fail", "once", ttl_ms=30, retry_schedule_s=[])
    row = wait_status(client, key, TaskStatus.DEAD)
    assert row.attempts == 1 and sample_tasks.CALLS[key] == 1
    assert running.listener.thread_errors.count == 0


def test_a_bad_retry_delay_written_into_the_ledger_kills_no_thread(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    """A row written by another program with a NaN delay: the default schedule is used, the
    listener's threads live on and record every outcome."""
    from sqlalchemy import update

    from keyexpiry.ledger.store import time_limit_task

    running = start_listener(settings)
    key = client.create("Probe.fail_once", "nan-row", ttl_s=1)
    with client.store.engine.begin() as conn:
        conn.execute(
            update(time_limit_task)
            .where(time_limit_task.c.task_key == key)
            .values(retry_schedule_s="[NaN, 1e300]")
        )
    row = wait_status(client, key, TaskStatus.DONE, timeout_s=15)
    assert row.attempts == 2
    assert running.listener.thread_errors.count == 0
    ok = client.create("Probe.record", "after", ttl_ms=20)
    wait_status(client, ok, TaskStatus.DONE)


def test_a_handler_asking_for_a_nan_retry_delay_is_retried_on_the_schedule(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    running = start_listener(settings)
    key = client.create("Probe.retry_nan", "r", ttl_ms=20)
    row = wait_status(client, key, TaskStatus.DONE)
    assert row.attempts == 2
    assert running.listener.thread_errors.count == 0


@pytest.mark.parametrize(
    "option, message",
    [
        (["--ttl", "inf"], "error: ttl_s must be"),
        (["--ttl", "nan"], "error: ttl_s must be"),
        (["--ttl", "1e300"], "error: ttl_s must be"),
        (["--ttl", "1e12"], "error: ttl_s must be"),
        (["--ttl-ms", "99999999999999999999"], "error: ttl_ms must be"),
        (["--at", "0001-01-01"], "error: "),
        (["--at", "9999-12-31T23:59:59+00:00"], "error: at 9999-12-31"),
    ],
    ids=["inf", "nan", "1e300", "year-33715", "huge-ms", "year-1", "year-9999"],
)
def test_the_cli_refuses_bad_due_times_with_one_line(
    cli_env: dict[str, str], option: list[str], message: str
) -> None:
    result = CliRunner().invoke(app, ["create", "Probe", "record", "x", *option], env=cli_env)
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_list_and_show_survive_any_stored_row(
    client: Client, cli_env: dict[str, str], sqlite_url: str
) -> None:
    """Rows written before the horizon existed (or by another program): due in year 33715, args
    that are not JSON. `list` and `show` print them; they never fail for everyone."""
    from sqlalchemy import create_engine, update

    from keyexpiry.ledger.store import time_limit_task

    env = {**cli_env, "KEYEXPIRY_DATABASE_URL": sqlite_url}
    for name in ("far", "broken"):
        made = CliRunner().invoke(app, ["create", "Probe", "record", name, "--ttl", "60"], env=env)
        assert made.exit_code == 0, made.output
    engine = create_engine(sqlite_url)
    with engine.begin() as conn:
        t = time_limit_task
        conn.execute(update(t).where(t.c.task_key == "Probe@record@far").values(due_at_ms=10**15))
        conn.execute(update(t).where(t.c.task_key == "Probe@record@broken").values(args="{oops"))
    engine.dispose()
    listed = CliRunner().invoke(app, ["list"], env=env)
    assert listed.exit_code == 0, listed.output
    assert (
        "1000000000000000 ms (not a date)" in listed.stdout
        and "Probe@record@broken" in listed.stdout
    )
    for name in ("far", "broken"):
        shown = CliRunner().invoke(app, ["show", "Probe", "record", name], env=env)
        assert shown.exit_code == 0, shown.output
    as_json = CliRunner().invoke(app, ["list", "--json"], env=env)
    assert as_json.exit_code == 0 and as_json.stdout.count("\n") == 2


def test_first_listen_on_a_fresh_ledger_logs_no_missing_table(
    redis_url: str, tmp_path: Path, start_listener: StartListener, log_lines: list[str]
) -> None:
    fresh = make_settings(redis_url, f"sqlite:///{tmp_path / 'fresh.sqlite3'}", tmp_path)
    running = start_listener(fresh)
    wait_until(lambda: running.listener.reconciles_done > 0, 10, message="no reconciliation")
    assert not [line for line in log_lines if "no such table" in line], log_lines


def test_forged_evicted_and_rowless_task_keys_do_not_mislead(
    client: Client, settings: Settings, start_listener: StartListener, log_lines: list[str]
) -> None:
    running = start_listener(settings)
    client.redis.publish("__keyevent@0__:evicted", "Probe@record@forged")
    client.redis.publish("__keyevent@0__:expired", "Unregistered@run@1")
    client.redis.publish("__keyevent@0__:expired", "Probe@record@no-row-at-all")
    wait_until(lambda: running.listener.evicted == 1, 5, message="evicted message not handled")
    wait_until(
        lambda: any("Unregistered" in line for line in log_lines), 5, message="no line for it"
    )
    assert not _about(log_lines, "maxmemory"), log_lines  # the server runs noeviction
    unknown = _about(log_lines, "Unregistered")
    assert len(unknown) == 1 and "no ledger row either" in unknown[0], unknown
    assert not _about(log_lines, "left pending"), log_lines


def test_the_overdue_line_names_the_keys_and_the_cause(
    client: Client, settings: Settings, start_listener: StartListener, log_lines: list[str]
) -> None:
    from keyexpiry.keys import format_key
    from keyexpiry.ledger.store import NewTask

    start_listener(settings)
    key = format_key("Elsewhere", "run", ["1"])
    now_ms = client.clock.now_ms()
    client.store.upsert_pending([NewTask(key, "Elsewhere", "run", ("1",), now_ms - 5000)], now_ms)
    wait_until(lambda: _about(log_lines, "task(s) overdue"), 10, message="no overdue line")
    line = _about(log_lines, "task(s) overdue")[0]
    assert key in line and "does not run class Elsewhere" in line, line
