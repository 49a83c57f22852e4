"""docs/PROTOCOL.md works as written: tasks created and cancelled with nothing but the `mariadb`
and `redis-cli` command-line clients, running the page's own statements (read out of it), run once
in a listener with the right arguments.

The producer here is what a PHP, Go or Java program would be: it computes keys and rows the way
the page says (its own transcription of the escaping, not keyexpiry's code) and sends the page's
statements; only the assertions use keyexpiry.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import shlex
import shutil
import subprocess
from collections.abc import Callable, Iterator, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

import pymysql
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pymysql.constants import CLIENT
from sqlalchemy import make_url
from sqlalchemy.dialects import mysql

from keyexpiry import Client, Settings
from keyexpiry.bench.servers import wait_until
from keyexpiry.errors import KeyFormatError
from keyexpiry.keys import escape_arg, format_key, parse_key, wake_channel
from keyexpiry.ledger.engine import make_engine
from keyexpiry.ledger.rows import NewTask, TaskRow, TaskStatus
from keyexpiry.ledger.upsert import _LITERAL_COLUMNS, LiteralUpsert, upsert_statement
from keyexpiry.redis.arming import parse_wake
from tests import sample_tasks
from tests.conftest import _require
from tests.ke import Running, make_settings, wait_status

DOC = Path(__file__).resolve().parents[1] / "docs" / "PROTOCOL.md"
_BLOCK = re.compile(r"^```\w+ protocol:([\w-]+)\n(.*?)^```", re.MULTILINE | re.DOTALL)
BLOCKS = {m.group(1): m.group(2) for m in _BLOCK.finditer(DOC.read_text(encoding="utf-8"))}
"""PROTOCOL.md's fenced blocks marked `protocol:NAME`, by name."""

EXAMPLES = [
    (json.loads(arg), segment)
    for arg, _, segment in (
        line.partition("  ") for line in BLOCKS["examples"].splitlines() if line.strip()
    )
    for segment in [segment.strip()]
]
"""(argument, escaped segment) pairs of the page's example table."""


def escape_as_documented(arg: str) -> str:
    """The page's escaping rule, transcribed: UTF-8 bytes; letters, digits and the listed
    characters kept, every other byte %XX in upper-case hex."""
    keep = BLOCKS["keep"].strip()
    return "".join(
        chr(b) if chr(b).isascii() and (chr(b).isalnum() or chr(b) in keep) else f"%{b:02X}"
        for b in arg.encode("utf-8")
    )


# --- the page against keyexpiry's own code (no servers) -------------------------------------------


def test_the_page_has_every_block_the_tests_run() -> None:
    assert {
        "time", "keep", "examples", "create", "create-mysql8", "create-postgres", "arm",
        "arm-due", "wake", "cancel", "cancel-key",
    } <= set(BLOCKS)  # fmt: skip
    assert len(EXAMPLES) >= 12 and ("", "") in EXAMPLES


def test_escaping_examples_are_what_keyexpiry_writes() -> None:
    for arg, segment in EXAMPLES:
        assert escape_arg(arg) == segment, arg
        assert escape_as_documented(arg) == segment, arg
    assert format_key("OrderTimeout", "close_unpaid", ["218"]) == "OrderTimeout@close_unpaid@218"
    assert format_key("Probe", "record", ["a@b café"]) == "Probe@record@a%40b%20caf%C3%A9"
    assert parse_key("Cleanup@run@").args == ("",)
    assert parse_key("Cleanup@run").args == ()
    # The page: an escape keyexpiry would not write is not a task key.
    for spelled_otherwise in ("Probe@record@%41", "Probe@record@caf%c3%a9", "Probe@record@a%2Bb"):
        with pytest.raises(KeyFormatError):
            parse_key(spelled_otherwise)


@given(st.text())
def test_the_documented_escaping_is_keyexpirys_for_any_text(arg: str) -> None:
    assert escape_as_documented(arg) == escape_arg(arg)


_CONSTANTS = {"status": "'pending'", "attempts": "0"}
"""The values the page's create statement writes in; every other column is a `?`."""


def _same_sql(text: str) -> str:
    """`text` with layout differences gone (line breaks, indents, spaces after commas)."""
    return re.sub(r"\s+", " ", re.sub(r"\s*,\s*", ",", text)).strip()


def test_the_mysql8_create_is_what_keyexpiry_renders_for_mysql8() -> None:
    dialect = mysql.dialect()
    # What SQLAlchemy decides on connecting to MySQL 8.0.20+ (no such server in the tests).
    dialect._requires_alias_for_on_duplicate_key = True
    rendered = str(
        upsert_statement("mysql").compile(dialect=dialect, column_keys=list(_LITERAL_COLUMNS))
    )
    values = iter([_CONSTANTS.get(c, "?") for c in _LITERAL_COLUMNS])
    expected = re.sub("%s", lambda _m: next(values), rendered)
    assert _same_sql(BLOCKS["create-mysql8"]) == _same_sql(expected)


def test_the_create_is_the_statement_keyexpiry_sends_to_mariadb(mysql_url: str) -> None:
    engine = make_engine(mysql_url)
    try:
        with engine.connect() as conn:
            escape = conn.connection.driver_connection.escape  # type: ignore[union-attr]
            task = NewTask("Probe@record@a%40b", "Probe", "record", ("a@b",), 1_700_000_123_456)
            sent = LiteralUpsert(conn.dialect).one(escape, task, 1_700_000_000_000)
            quoted = [escape(task.key), escape("Probe"), escape("record"), escape('["a@b"]')]
            times = [str(task.due_at_ms), "1700000000000", "1700000000000"]
            params = iter([*quoted, "NULL", *times, "NULL", "NULL", "NULL"])
            documented = re.sub(r"\?", lambda _m: next(params), BLOCKS["create"])
    finally:
        engine.dispose()
    assert _same_sql(documented) == _same_sql(sent)


# --- a producer with only the command-line clients ------------------------------------------------


def _sql_value(value: str | int | None) -> str:
    # Hex literals: no quoting or escaping can go wrong between the test and the server.
    if value is None:
        return "NULL"
    if isinstance(value, int):
        return str(value)
    return f"CONVERT(X'{value.encode('utf-8').hex()}' USING utf8mb4)"


class CliProducer:
    """Creates and cancels tasks as PROTOCOL.md says, through `mariadb` and `redis-cli` only."""

    def __init__(self, mysql_url: str, redis_url: str) -> None:
        url = make_url(mysql_url)
        self.mariadb_cmd = [
            _require("mariadb"), "--no-defaults", "--protocol=TCP", f"--host={url.host}",
            f"--port={url.port}", f"--user={url.username}", f"--database={url.database}",
            "--batch", "--skip-column-names", "--default-character-set=utf8mb4",
        ]  # fmt: skip
        self.redis_cmd = [_require("redis-cli"), "-u", redis_url]
        self.db = int(make_url(redis_url).database or 0)
        self.prefix = ""

    def mariadb(self, sql: str) -> str:
        done = subprocess.run(
            self.mariadb_cmd, input=sql, capture_output=True, text=True, timeout=30, check=False
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def redis(self, block: str, **values: object) -> list[str]:
        """Run each command of the page's Redis block `block`, its `{placeholders}` filled in."""
        replies: list[str] = []
        for line in BLOCKS[block].splitlines():
            # Split as the page writes it, then fill in: values are never re-parsed.
            argv = [token.format(**values) for token in shlex.split(line)]
            done = subprocess.run(
                [*self.redis_cmd, *argv], capture_output=True, text=True, timeout=30, check=False
            )
            assert done.returncode == 0 and not done.stdout.startswith("ERR"), done
            replies.append(done.stdout)
        return replies

    def execute(self, block: str, params: Sequence[str | int | None]) -> int:
        """Run the page's SQL block as a prepared statement, its `?` bound to `params` (what a
        driver does); return the rows it changed."""
        sql = BLOCKS[block]
        assert sql.count("?") == len(params)
        bound = ", ".join(f"@p{i}" for i in range(len(params)))
        script = [f"SET @stmt = {_sql_value(sql)};", "PREPARE stmt FROM @stmt;"]
        script += [f"SET @p{i} = {_sql_value(v)};" for i, v in enumerate(params)]
        script += [f"EXECUTE stmt USING {bound};", "SELECT ROW_COUNT();"]
        return int(self.mariadb("\n".join(script)).split()[-1])

    def now_ms(self) -> int:
        seconds, micros = self.redis("time")[0].split()
        return int(seconds) * 1000 + int(micros) // 1000

    def key(self, class_name: str, method: str, args: Sequence[str]) -> str:
        return self.prefix + "@".join([class_name, method, *map(escape_as_documented, args)])

    def write_row(
        self, key: str, args: Sequence[str], due_ms: int, now_ms: int, payload: str | None = None
    ) -> int:
        class_name, method = key[len(self.prefix) :].split("@")[:2]
        params = [key, class_name, method, json.dumps(list(args), ensure_ascii=False), None]
        return self.execute("create", [*params, due_ms, now_ms, now_ms, None, payload, None])

    def arm(self, key: str, due_ms: int, now_ms: int) -> None:
        values = {"key": key, "due_at_ms": max(due_ms, 1), "prefix": self.prefix, "db": self.db}
        if due_ms <= now_ms:
            self.redis("arm-due", **values)
            return
        self.redis("arm", **values)
        if due_ms <= now_ms + 120_000:
            self.redis("wake", **values)

    def create(self, class_name: str, method: str, *args: str, delay_ms: int) -> tuple[str, int]:
        """Row, then key; returns the key and its due time."""
        now = self.now_ms()
        key, due = self.key(class_name, method, args), now + delay_ms
        assert self.write_row(key, args, due, now) in (1, 2)  # inserted, or an existing key reset
        self.arm(key, due, now)
        return key, due

    def cancel(self, key: str, *, delete_key: bool = True) -> bool:
        now = self.now_ms()
        changed = self.execute("cancel", [now, now, f"cancel:{secrets.token_hex(16)}", key])
        if changed and delete_key:
            self.redis("cancel-key", key=key)
        return changed == 1


def _shape(row: TaskRow | None) -> dict[str, object]:
    """What two rows of the same state have in common, whatever their key and times."""
    assert row is not None
    return {
        "class_name": row.class_name, "method": row.method, "status": row.status,
        "attempts": row.attempts, "retry_schedule_s": row.retry_schedule_s,
        "started_at_ms": row.started_at_ms, "finished": row.finished_at_ms is not None,
        "claimed_by": (row.claimed_by or "").partition(":")[0], "lease": row.lease_until_ms,
        "last_error": row.last_error, "problem": row.problem,
    }  # fmt: skip


@pytest.fixture
def producer(mysql_url: str, redis_url: str) -> CliProducer:
    return CliProducer(mysql_url, redis_url)


@pytest.fixture
def ledger(mysql_url: str, redis_url: str, tmp_path: Path) -> Iterator[tuple[Settings, Client]]:
    """Fast settings on MariaDB (the protocol's database), and a client to look at the rows."""
    sample_tasks.reset()
    settings = make_settings(redis_url, mysql_url, tmp_path)
    client = Client(settings)
    yield settings, client
    sample_tasks.reset()
    client.close()


def test_tasks_created_with_the_cli_clients_run_once_with_their_arguments(
    producer: CliProducer,
    ledger: tuple[Settings, Client],
    start_listener: Callable[[Settings], Running],
) -> None:
    settings, client = ledger
    # The page's DDL, through the command-line client too (the listener's init finds it there).
    producer.mariadb((DOC.parents[1] / "sql" / "time_limit_task.sql").read_text())
    start_listener(settings)
    wakes = client.redis.pubsub(ignore_subscribe_messages=True)
    wakes.subscribe(wake_channel(producer.db))
    awkward = [arg for arg, _ in EXAMPLES] + ['a@b café 日本 {x} 100% "q" \\']
    expected: dict[str, tuple[object, ...]] = {}
    announced: list[tuple[str, int]] = []
    for arg in awkward:
        key, due_ms = producer.create("Probe", "record", arg, delay_ms=300)
        # Python finds what the producer made: same key for the same value.
        assert key == client.key_for("Probe.record", arg)
        # The key expires at the row's due time exactly (unless it already has).
        assert client.redis.pexpiretime(key) in (due_ms, -2)
        expected[key] = (arg,)
        announced.append((key, due_ms))
    typed = ("7", "19.9", "true", "0.5", "{x} y@z")
    key, _ = producer.create("Probe", "typed", *typed, delay_ms=300)
    assert key == client.key_for("Probe.typed", 7, Decimal("19.90"), True, 0.5, "{x} y@z")
    expected[key] = (7, Decimal("19.9"), True, 0.5, "{x} y@z")
    # Due already: SET at a past time, then EXISTS.
    key, _ = producer.create("Probe", "record", "overdue", delay_ms=-5_000)
    expected[key] = ("overdue",)
    # Created again before it is due: the same row, rescheduled; it runs once, at the new time.
    producer.create("Probe", "record", "moved", delay_ms=60_000)
    moved, due_ms = producer.create("Probe", "record", "moved", delay_ms=200)
    expected[moved] = ("moved",)

    for key, args in expected.items():
        row = wait_status(client, key, TaskStatus.DONE)
        assert row.attempts == 1, key
        assert sample_tasks.CALL_ARGS[key] == args
    assert sample_tasks.RUN_DUES[moved] == [due_ms]
    assert {k: sample_tasks.CALLS[k] for k in expected} == dict.fromkeys(expected, 1)
    assert client.redis.exists(*expected) == 0
    # Each announced on the wake channel as the driver reads it.
    heard: set[tuple[str, int]] = set()

    def all_heard() -> bool:
        while (message := wakes.get_message(timeout=0.01)) is not None:
            heard.update(parse_wake(message["data"]))
        return set(announced) <= heard

    wait_until(all_heard, 5, message="wake messages missing")
    wakes.close()


def test_cancel_with_the_cli_clients(
    producer: CliProducer,
    ledger: tuple[Settings, Client],
    start_listener: Callable[[Settings], Running],
) -> None:
    settings, client = ledger
    start_listener(settings)
    # Due long after the cancels: a dozen command-line clients run before them, which on a
    # loaded machine took seconds.
    cancelled, _ = producer.create("Probe", "record", "cancel me", delay_ms=60_000)
    by_python = client.create("Probe.record", "cancelled by Python", ttl_ms=60_000)
    # The producer died after the UPDATE, before the DEL: the key expires and claims nothing.
    left, _ = producer.create("Probe", "record", "key left behind", delay_ms=60_000)

    pending = client.store.get(cancelled)
    assert pending is not None and _shape(pending) == _shape(client.store.get(by_python))
    assert producer.cancel(cancelled)
    assert client.cancel("Probe.record", "cancelled by Python")
    assert not producer.cancel(cancelled)  # not pending any more
    assert producer.cancel(left, delete_key=False)
    assert client.redis.exists(cancelled) == 0 and client.redis.exists(left) == 1
    client.redis.pexpire(left, 50)  # it falls due now, into an event that must claim nothing
    after, _ = producer.create("Probe", "record", "due after both", delay_ms=300)

    wait_status(client, after, TaskStatus.DONE)
    assert not producer.cancel(after)  # done: nothing to cancel
    for key in (cancelled, left):
        row = client.store.get(key)
        # The row the page's cancel leaves is the one Client.cancel leaves.
        assert row is not None and _shape(row) == _shape(client.store.get(by_python))
        assert row.status is TaskStatus.CANCELLED and row.finished_at_ms == row.updated_at_ms
        assert row.claimed_by is not None and row.claimed_by.startswith("cancel:")
        assert sample_tasks.CALLS[key] == 0
    # It expired, into an event that claimed nothing.
    wait_until(lambda: client.redis.exists(left) == 0, 10, message="the left key never expired")
    assert sample_tasks.CALLS[after] == 1


def test_a_producer_dying_between_row_and_key(
    producer: CliProducer,
    ledger: tuple[Settings, Client],
    start_listener: Callable[[Settings], Running],
) -> None:
    settings, client = ledger
    settings = settings.replace(key_prefix="shop:")
    producer.prefix = "shop:"
    start_listener(settings)
    # Row written, key never set: the overdue check arms it (stuck_after_s, 0.5 s here).
    now = producer.now_ms()
    row_only = producer.key("Probe", "record", ["row only"])
    assert producer.write_row(row_only, ["row only"], now + 100, now) == 1
    # The wrong order, dying before the row: a key alone never runs anything.
    key_only = producer.key("Probe", "record", ["key only"])
    producer.arm(key_only, now + 100, now)

    row = wait_status(client, row_only, TaskStatus.DONE)
    assert row.attempts == 1 and sample_tasks.CALLS[row_only] == 1
    assert client.store.get(key_only) is None and sample_tasks.CALLS[key_only] == 0
    # Its event came, and found no row.
    wait_until(lambda: client.redis.exists(key_only) == 0, 10, message="key never expired")


def test_the_creates_affected_rows_say_new_or_reset_within_one_millisecond(
    producer: CliProducer, ledger: tuple[Settings, Client], mysql_url: str
) -> None:
    """As the page says: 1 for a new key, 2 for a reset, also when a create repeats the row's
    values in the millisecond that wrote them; with changed rows (the `mariadb` client, PDO's
    default) and with found rows (JDBC's default)."""
    _, client = ledger
    now = producer.now_ms()
    key = producer.key("Probe", "record", ["changed rows"])
    assert [producer.write_row(key, ["changed rows"], now + 60_000, now) for _ in range(3)] == [
        1, 2, 2,
    ]  # fmt: skip
    url = make_url(mysql_url)
    found_rows = pymysql.connect(
        host=url.host, port=url.port, user=url.username, password=url.password or "",
        database=url.database, client_flag=CLIENT.FOUND_ROWS, autocommit=True,
    )  # fmt: skip
    other = producer.key("Probe", "record", ["found rows"])
    params = [
        other, "Probe", "record", '["found rows"]', None, now + 60_000, now, now, None, None, None,
    ]  # fmt: skip
    try:
        with found_rows.cursor() as cursor:
            sql = BLOCKS["create"].replace("?", "%s")
            assert [cursor.execute(sql, params) for _ in range(3)] == [1, 2, 2]
    finally:
        found_rows.close()
    for k in (key, other):
        row = client.store.get(k)
        assert row is not None and (row.created_at_ms, row.updated_at_ms) == (now, now + 2)


_JAVA_MAIN = """
public class Escape {
%s
    public static void main(String[] args) throws Exception {
        java.io.BufferedReader in = new java.io.BufferedReader(new java.io.InputStreamReader(
            System.in, java.nio.charset.StandardCharsets.US_ASCII));
        for (String hex; (hex = in.readLine()) != null; ) {
            byte[] utf8 = java.util.HexFormat.of().parseHex(hex);
            String arg = new String(utf8, java.nio.charset.StandardCharsets.UTF_8);
            System.out.println(escapeArg(arg));
        }
    }
}
"""


def test_the_java_snippet_escapes_as_keyexpiry_does(tmp_path: Path) -> None:
    java = shutil.which("java")
    if java is None:
        pytest.skip("no java on PATH (the page's Java snippet is checked where there is one)")
    (snippet,) = re.findall(r"^```java\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.M | re.S)
    source = tmp_path / "Escape.java"
    source.write_text(_JAVA_MAIN % snippet, encoding="utf-8")
    # Every byte value's character, the page's examples, and astral and combining characters.
    args = [chr(c) for c in range(256)] + [arg for arg, _ in EXAMPLES if arg]
    args += ["e\u0301", "\U0001f680 x", "a\u2028b"]
    done = subprocess.run(
        [java, str(source)],
        input="\n".join(a.encode("utf-8").hex() for a in args) + "\n",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [escape_arg(a) for a in args]


# --- a producer on a PostgreSQL ledger ---------------------------------------------------------


def test_the_postgres_create_writes_what_keyexpiry_writes_and_the_task_runs(
    pg_url: str, redis_url: str, tmp_path: Path, start_listener: Callable[[Settings], Running]
) -> None:
    """PROTOCOL.md's PostgreSQL create, run with psycopg: the same row keyexpiry writes for the
    same task (every column but the id and the key), `inserted` true for a new key and false for
    a reset, and a listener runs the task once with its payload."""
    sample_tasks.reset()
    settings = make_settings(redis_url, pg_url, tmp_path)
    sql = BLOCKS["create-postgres"].replace("?", "%s")
    with Client(settings) as client:
        raw = client.store.engine.raw_connection()
        try:
            driver: Any = raw.driver_connection
            driver.autocommit = True
            now = client.clock.now_ms()
            theirs = client.key_for(sample_tasks.Probe.with_payload, "pg producer")
            params = [
                theirs, "Probe", "with_payload", '["pg producer"]', "[0.05]", now + 300, now,
                now, "order:9", '{"n":1}', None,
            ]  # fmt: skip
            with driver.cursor() as cur:
                assert cur.execute(sql, params).fetchone() == (True,)
                assert cur.execute(sql, params).fetchone() == (False,)  # a reset, same ms
            ours = client.key_for(sample_tasks.Probe.with_payload, "keyexpiry")
            client.store.upsert_pending(
                [
                    NewTask(
                        ours, "Probe", "with_payload", ("keyexpiry",), now + 300, (0.05,),
                        "order:9", '{"n":1}',
                    ),
                    NewTask(
                        ours, "Probe", "with_payload", ("keyexpiry",), now + 300, (0.05,),
                        "order:9", '{"n":1}',
                    ),
                ],
                now,
            )  # fmt: skip
        finally:
            raw.close()
        rows = client.store.get_many([theirs, ours])
        # Each row's args are its key's (else it would be malformed, `problem` set).
        assert (rows[theirs].args, rows[ours].args) == (("pg producer",), ("keyexpiry",))
        documented, written = (
            dataclasses.replace(rows[k], id=0, key="", args=()) for k in (theirs, ours)
        )
        assert documented == written and documented.problem is None
        client.redis.set(theirs, "", pxat=now + 300)
        start_listener(settings)
        wait_status(client, theirs, TaskStatus.DONE)
        assert sample_tasks.CALLS[theirs] == 1
        assert sample_tasks.CALL_ARGS[theirs] == ("pg producer", {"n": 1}, {"n": 1})
