"""contrib/php/: the PHP producer (PDO and phpredis, as Debian's php-cli, php-mysql, php-pgsql and
php-redis install them) creates, reschedules and cancels tasks as docs/PROTOCOL.md says, against a
real MariaDB or PostgreSQL and a real Redis, and a Python listener runs them.

PHP is driven through `contrib/php/cli.php` (JSON commands on stdin, one answer per command); the
assertions use keyexpiry: the keys PHP makes are the ones `Client.key_for` makes for the same
values, the rows are the ones the listener reads, and the runs are the handlers' own records
(`tests.sample_tasks`). Without `php` (and its redis module, and pdo_mysql or pdo_pgsql for the
ledger's server) the tests are skipped, and fail when `CI` is set.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from sqlalchemy import func, make_url, select

from keyexpiry import Client, Settings
from keyexpiry.bench.servers import wait_until
from keyexpiry.errors import KeyExpiryError
from keyexpiry.keys import format_key, wake_channel
from keyexpiry.ledger.rows import TaskRow, TaskStatus
from keyexpiry.ledger.table import T
from keyexpiry.limits import MAX_JSON_DEPTH, delays
from keyexpiry.redis.arming import parse_wake
from keyexpiry.registry import default_registry
from keyexpiry.tags import check_tag
from tests import sample_tasks
from tests.conftest import _require
from tests.ke import Running, make_settings, wait_status

ROOT = Path(__file__).resolve().parents[1]
PHP_DIR = ROOT / "contrib" / "php"
CLI = PHP_DIR / "cli.php"
DOC = ROOT / "docs" / "PROTOCOL.md"
_BLOCK = re.compile(r"^```\w+ protocol:([\w-]+)\n(.*?)^```", re.MULTILINE | re.DOTALL)
BLOCKS = {m.group(1): m.group(2) for m in _BLOCK.finditer(DOC.read_text(encoding="utf-8"))}
"""PROTOCOL.md's fenced blocks marked `protocol:NAME`, by name (as tests/test_protocol.py reads
them)."""
PHP_MODULES = ("json", "PDO", "redis")
"""What the producer needs of PHP whatever the ledger: Debian's php-cli and php-redis."""
PDO_DRIVERS = {"mysql": ("pdo_mysql", "php-mysql"), "pg": ("pdo_pgsql", "php-pgsql")}
"""The PDO driver each ledger server needs (module, Debian package), by `*_url` fixture."""


def _missing_modules(php: str, modules: tuple[str, ...], packages: str) -> None:
    """Skip (fail under CI) unless `php -m` lists every one of `modules`."""
    listed = subprocess.run(
        [php, "-m"], capture_output=True, text=True, timeout=30, check=False
    ).stdout.split()
    missing = [m for m in modules if m not in listed]
    if missing:
        message = f"php lacks the modules {missing} (Debian packages {packages})"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI is set, so this is an error", pytrace=False)
        pytest.skip(message)


@pytest.fixture(scope="module")
def php() -> str:
    """The `php` binary, with the modules the producer needs; skipped without them (failed
    under CI)."""
    path = _require("php")
    _missing_modules(path, PHP_MODULES, "php-cli, php-redis")
    return path


@pytest.fixture(params=[pytest.param("mysql", id="mariadb"), pytest.param("pg", id="postgres")])
def php_db_url(request: pytest.FixtureRequest, php: str) -> str:
    """A fresh ledger database on MariaDB, then on PostgreSQL, with PHP's driver for it."""
    module, package = PDO_DRIVERS[request.param]
    _missing_modules(php, (module,), package)
    url: str = request.getfixturevalue(f"{request.param}_url")
    return url


class PhpProducer:
    """`contrib/php/cli.php` with a MariaDB or PostgreSQL and a Redis (or none: keys and checks
    only). `charset`: the MySQL connection's; `client_encoding`: the PostgreSQL one's (None: the
    server's default)."""

    def __init__(
        self,
        php: str,
        db_url: str | None = None,
        redis_url: str | None = None,
        *,
        prefix: str = "",
        charset: str = "utf8mb4",
        client_encoding: str | None = None,
    ) -> None:
        self.php = php
        self.config: dict[str, Any] = {"prefix": prefix}
        if db_url is not None:
            url = make_url(db_url)
            connection = {
                "host": url.host, "port": url.port, "database": url.database,
                "user": url.username, "password": url.password or "",
            }  # fmt: skip
            if url.get_backend_name() == "postgresql":
                self.config["pgsql"] = {**connection, "client_encoding": client_encoding}
            else:
                self.config["mysql"] = {**connection, "charset": charset}
        if redis_url is not None:
            parts = urlsplit(redis_url)
            self.config["redis"] = {
                "host": parts.hostname, "port": parts.port,
                "db": int(parts.path.strip("/") or 0), "password": parts.password,
            }  # fmt: skip

    def run(self, *commands: dict[str, Any]) -> list[dict[str, Any]]:
        """One PHP process for `commands`; its answers, `{"ok": …}` or `{"error": …}` each."""
        done = subprocess.run(
            [self.php, "-d", "display_errors=stderr", "-d", "error_reporting=-1", str(CLI)],
            input=json.dumps({**self.config, "commands": list(commands)}),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        # No warning, notice or deprecation either.
        assert done.returncode == 0 and not done.stderr, done
        answers: list[dict[str, Any]] = json.loads(done.stdout)
        assert len(answers) == len(commands)
        return answers

    def ok(self, *commands: dict[str, Any]) -> list[Any]:
        """As `run`, every command succeeding; their values."""
        answers = self.run(*commands)
        for command, answer in zip(commands, answers, strict=True):
            assert "ok" in answer, (command, answer)
        return [answer["ok"] for answer in answers]

    def create(self, task: str, *args: object, ttl_ms: int, **extra: Any) -> dict[str, Any]:
        """`Producer::create`: {"key", "due_at_ms", "outcome"}."""
        (created,) = self.ok(create(task, *args, ttl_ms=ttl_ms, **extra))
        return created  # type: ignore[no-any-return]

    def keys(self, task: str, args_list: list[list[Any]]) -> list[str | None]:
        """`Producer::keyFor` for each argument list; None where PHP refuses it."""
        (answers,) = self.ok({"op": "keys", "task": task, "args_list": args_list})
        for answer in answers:
            assert "ok" in answer or answer["error"] == "Keyexpiry\\ArgumentError", answer
        return [answer.get("ok") for answer in answers]


def create(task: str, *args: object, ttl_ms: int, **extra: Any) -> dict[str, Any]:
    """A create command (`tag`, `retry_schedule`, `payload` as extra fields)."""
    return {"op": "create", "task": task, "args": list(args), "ttl_ms": ttl_ms, **extra}


def cancel(task: str, *args: object) -> dict[str, Any]:
    return {"op": "cancel", "task": task, "args": list(args)}


def python_key(target: str, *args: object, prefix: str = "") -> str | None:
    """What `Client.key_for(target, *args)` answers (without a client: no servers); None
    where it refuses the arguments."""
    class_name, _, method = target.partition(".")
    spec = default_registry.resolve(class_name, method)
    try:
        return format_key(spec.class_name, spec.method, spec.encode_args(args), prefix=prefix)
    except KeyExpiryError:
        return None


def _same_sql(text: str) -> str:
    """`text` with layout differences gone (line breaks, indents, spaces after commas)."""
    return re.sub(r"\s+", " ", re.sub(r"\s*,\s*", ",", text)).strip()


def _without_payload(sql: str) -> str:
    """PROTOCOL.md's create without its payload column: what a producer sends on a ledger
    without one, and the PHP producer sends for a create without a payload."""
    sql = re.sub(r",\s*payload\s*(?=[,)])", "", sql, count=1)
    sql = re.sub(r",\s*\?\s*\)", ")", sql, count=1)
    return re.sub(r",\s*payload\s*=\s*coalesce\((?:[^()]|\([^()]*\))*\)", "", sql)


# --- without servers: the statements, the keys, the checks ----------------------------------------


def test_the_php_statements_are_the_protocols(php: str) -> None:
    (sql,) = PhpProducer(php).ok({"op": "sql"})
    assert _same_sql(sql["cancel"]) == _same_sql(BLOCKS["cancel"])
    for name, block in (
        ("create", "create"),
        ("create_mysql8", "create-mysql8"),
        ("create_postgres", "create-postgres"),
    ):
        documented = BLOCKS[block]
        if "payload" in documented:
            assert _same_sql(sql[name.replace("create", "create_payload")]) == _same_sql(documented)
            documented = _without_payload(documented)
        assert "payload" not in documented
        assert _same_sql(sql[name]) == _same_sql(documented)


def test_the_php_escaping_is_the_protocols_snippet() -> None:
    """Producer::escape is PROTOCOL.md's PHP snippet, which the key tests below therefore run."""
    (snippet,) = re.findall(r"^```php\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.M | re.S)
    source = (PHP_DIR / "Keyexpiry.php").read_text(encoding="utf-8")
    pattern = re.search(r"preg_replace_callback\((.*?),\n", snippet)
    assert pattern is not None and f"preg_replace_callback(\n            {pattern[1]}," in source
    assert "fn ($m) => sprintf('%%%02X', ord($m[0]))" in snippet
    assert "fn ($m) => sprintf('%%%02X', ord($m[0]))" in source


EXAMPLES = [
    json.loads(line.partition("  ")[0]) for line in BLOCKS["examples"].splitlines() if line.strip()
]
"""The arguments of PROTOCOL.md's escaping examples."""
TRICKY = [
    "@", "%", "%41", "%c3%a9", " ", "  two  spaces ", "a@b%c d", "{}", "{user:7}", "}{", "{{x}}",
    "café", "CAFÉ", "e\u0301", "日本", "😀", "🇫🇷", "\u2028", "\ufeff", "\u202e", "\U0010ffff",
    "\x00", "\x7f", "\x80", "a\r\nb", "tab\there", "'$;`", "a+b/c?d=e&f#g", "~!$'()*,;<>[]^`|",
    '"quoted"', "C:\\temp", "@@@", "%%", "order:218", "",
    "x" * 499, "x" * 500, "é" * 249, "é" * 250, "😀" * 41, "😀" * 42,
]  # fmt: skip
"""Arguments near every edge of the escaping: `@`, `%`, blanks, braces, non-ASCII, controls, and
lengths at the 512-byte limit of `Probe@record@…` (both sides refuse one byte over)."""


def test_php_keys_are_keyexpirys_for_tricky_strings(php: str) -> None:
    samples = [chr(c) for c in range(0x300)] + EXAMPLES + TRICKY
    for prefix in ("", "shop:", "{tenant}/x"):
        keys = PhpProducer(php, prefix=prefix).keys("Probe.record", [[s] for s in samples])
        for arg, key in zip(samples, keys, strict=True):
            assert key == python_key("Probe.record", arg, prefix=prefix), (prefix, arg)
    # Several arguments, each escaped on its own.
    args = [7, "1", True, 0.5, "a@b 100% {x}"]
    assert PhpProducer(php).keys("Probe.typed", [args]) == [python_key("Probe.typed", *args)]


@given(st.lists(st.text(), min_size=1, max_size=30))
@hypothesis_settings(max_examples=40)
def test_php_keys_are_keyexpirys_for_any_text(php: str, texts: list[str]) -> None:
    keys = PhpProducer(php).keys("Probe.record", [[t] for t in texts])
    assert keys == [python_key("Probe.record", t) for t in texts]


FLOATS = [
    0.5, 5.0, 1e100, 0.1, 0.1 + 0.2, 1 / 3, 2 / 3, -0.0, 0.0, -1.5, 1e15, 1e16, 1e17, 1e-4, 1e-5,
    9999999999999998.0, 123456789012345680.0, 5e-324, 2.2250738585072014e-308,
    1.7976931348623157e308, 2.0**53, 2.0**53 + 2, -(2.0**63), 1e22, 1e23, 4.35, 0.30000000000000004,
    100.0, 1234.5678, 1e-7, 1.5e-10, 12345678901234567890.0,
]  # fmt: skip
"""Floats at the edges of Python's repr: where it turns to exponents (1e16, 1e-5), subnormals,
the largest, powers of two (shortest round trip is hardest there), -0.0 (keyexpiry writes 0.0)."""


def _typed_keys(php: str, ints: list[int], floats: list[float], decimals: list[str]) -> None:
    """PHP's keys for `Probe.typed(n, price, flag, ratio, label)` are keyexpiry's: each int as
    `n`, each float as `ratio`, each decimal's text (Producer::decimal) as `price`."""
    producer = PhpProducer(php)
    int_keys = producer.keys("Probe.typed", [[n, "0", False, 0.5, "x"] for n in ints])
    assert int_keys == [python_key("Probe.typed", n, Decimal(0), False, 0.5, "x") for n in ints]
    float_keys = producer.keys("Probe.typed", [[0, "0", True, f, "x"] for f in floats])
    assert float_keys == [python_key("Probe.typed", 0, Decimal(0), True, f, "x") for f in floats]
    answers = producer.run(*({"op": "decimal", "value": d} for d in decimals))
    spec = default_registry.resolve("Probe", "typed")
    for text, answer in zip(decimals, answers, strict=True):
        try:
            # The text as a Decimal parameter reads it (the CLI's way), canonical.
            expected: str | None = spec.encode_args([0, text, True, 0.5])[1]
        except KeyExpiryError:
            expected = None
        assert answer.get("ok") == expected, (text, answer)


def test_php_numbers_and_booleans_are_keyexpirys_canonical_text(php: str) -> None:
    ints = [0, 1, -1, 7, -5, 218, 2**31, 2**53 + 1, 2**63 - 1, -(2**63)]
    decimals = [
        "19.90", "20.00", "2E+1", "0.05", "-0", "-0.00", "0E-7", "1.000", "100", "1E+2", ".5", "5.",
        "-1.50", "0.000001", "1E-10", "+3.14", "123456789.123456789000", "1E+599", "1E+600",
        "NaN", "Infinity", "-sNaN", "", ".", "1e", "0x10", "1,5",
    ]  # fmt: skip
    _typed_keys(php, ints, FLOATS, decimals)
    # Stricter than Python's Decimal(): no blanks, no underscores between digits.
    for text in (" 1", "1 ", "1_000"):
        (answer,) = PhpProducer(php).run({"op": "decimal", "value": text})
        assert answer["error"] == "Keyexpiry\\ArgumentError", text
    key = PhpProducer(php).keys("Probe.typed", [[7, "19.9", True, 0.5, "{x} y@z"]])[0]
    assert key == python_key("Probe.typed", 7, Decimal("19.90"), True, 0.5, "{x} y@z")
    assert key == "Probe@typed@7@19.9@true@0.5@%7Bx%7D%20y%40z"
    assert PhpProducer(php).keys("Probe.typed", [[0, "0", False, -0.0, "x"]]) == [
        "Probe@typed@0@0@false@0.0@x"
    ]


@given(
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=20),
    st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=20),
    st.lists(st.decimals(allow_nan=False, allow_infinity=False), max_size=20),
)
@hypothesis_settings(max_examples=40)
def test_php_canonical_numbers_for_any_values(
    php: str, ints: list[int], floats: list[float], decimals: list[Decimal]
) -> None:
    _typed_keys(php, ints, floats, [str(d) for d in decimals])


_REFUSALS = r"""
require $argv[1];
use Keyexpiry\Producer;
$key = fn (array $args, string $task = 'Probe.typed', string $prefix = '')
    => fn () => Producer::keyFor($task, $args, $prefix);
$cases = [
    'NaN' => $key([1, '1', true, NAN, 'x']),
    'INF' => $key([1, '1', true, INF, 'x']),
    '-INF' => $key([1, '1', true, -INF, 'x']),
    'null' => $key([null]),
    'array' => $key([[1]]),
    'object' => $key([new stdClass()]),
    'keyed arguments' => $key(['n' => 1]),
    'invalid UTF-8' => $key(["caf\xE9"], 'Probe.record'),
    'an encoded surrogate' => $key(["\xED\xA0\x80"], 'Probe.record'),
    'overlong UTF-8' => $key(["\xC0\xAF"], 'Probe.record'),
    'key over 512 bytes' => $key([str_repeat('x', 500)], 'Probe.record'),
    'no method' => $key([], 'Probe'),
    'three parts' => $key([], 'Probe.record.x'),
    'Class@method' => $key([], 'Probe@record'),
    'digit first' => $key([], '1Probe.record'),
    'underscore first' => $key([], 'Probe._record'),
    'dash' => $key([], 'Probe.re-cord'),
    'newline after' => $key([], "Probe.record\n"),
    'prefix with @' => $key(['x'], 'Probe.record', 'a@b'),
    'prefix of 65' => $key(['x'], 'Probe.record', str_repeat('p', 65)),
    'decimal NaN' => fn () => Producer::decimal('NaN'),
    'decimal 1E+600' => fn () => Producer::decimal('1E+600'),
    'decimal huge exponent' => fn () => Producer::decimal('1E+99999999999999999999'),
    'decimal text' => fn () => Producer::decimal('twelve'),
    'schedule of 101' => fn () => Producer::scheduleJson(array_fill(0, 101, 1)),
    'schedule negative' => fn () => Producer::scheduleJson([-1]),
    'schedule over a year' => fn () => Producer::scheduleJson([31_536_001]),
    'schedule NaN' => fn () => Producer::scheduleJson([NAN]),
    'schedule text' => fn () => Producer::scheduleJson(['15']),
    'schedule bool' => fn () => Producer::scheduleJson([true]),
    'schedule keyed' => fn () => Producer::scheduleJson(['a' => 1]),
    'tag invalid UTF-8' => fn () => Producer::checkTag("\xFF"),
];
$out = [];
foreach ($cases as $name => $case) {
    try {
        $case();
        $out[$name] = 'accepted';
    } catch (Keyexpiry\ArgumentError) {
        $out[$name] = 'refused';
    }
}
echo json_encode($out);
"""


def test_php_refuses_what_the_protocol_refuses(php: str) -> None:
    done = subprocess.run(
        [php, "-d", "display_errors=stderr", "-r", _REFUSALS, "--", str(PHP_DIR / "Keyexpiry.php")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and not done.stderr, done
    answers = json.loads(done.stdout)
    # Every case ran, and was refused.
    assert answers == dict.fromkeys(re.findall(r"^    '([^']+)' =>", _REFUSALS, re.M), "refused")


TAGS = [
    "order:218", "a", "x" * 128, "é" * 128, "x" * 129, "é" * 129, "", " ", " x", "x ", "a b",
    "a\tb", "a\nb", "\x00", "\x1b[31m", "a\x7fb", "a\x85b", "a\u00a0b", "a\u2028b", "a\u200eb",
    "a\u202eb", "a\u2066b", "\ufeffx", "a\u3000b", "\u3000", "x\u2003", "日本 😀", "\ue000",
    "\U0010ffff", "\ufffe", "e\u0301", "tag:with@and%",
]  # fmt: skip
"""Tags at every edge of keyexpiry's rule: length in characters, blanks at the ends, control,
format, separator, private-use and unassigned characters."""
SCHEDULES: list[Any] = [
    [], [0], [0.05, 1.5, 300], [15, 60, 300], [31_536_000], [31_536_000.5], [-1], [-0.0], [1e20],
    [1] * 100, [1] * 101, [True], ["1"], [[1]], [None], {"a": 1},
]  # fmt: skip


def test_php_tag_and_schedule_checks_are_keyexpirys(php: str) -> None:
    # Single characters of the scripts whose assignment no Unicode version since 1.1 changed.
    tags = TAGS + [f"a{chr(c)}b" for c in range(0x530)]
    answers = PhpProducer(php).run(*({"op": "check_tag", "tag": t} for t in tags))
    for tag, answer in zip(tags, answers, strict=True):
        try:
            expected: str | None = check_tag(tag, KeyExpiryError)
        except KeyExpiryError:
            expected = None
        assert answer.get("ok") == expected, (tag, answer)
    answers = PhpProducer(php).run(*({"op": "check_schedule", "schedule": s} for s in SCHEDULES))
    for schedule, answer in zip(SCHEDULES, answers, strict=True):
        try:
            accepted = delays(schedule, "retry_schedule_s", KeyExpiryError)
        except (KeyExpiryError, TypeError):
            assert "error" in answer, (schedule, answer)
        else:
            assert accepted is not None and "ok" in answer, (schedule, answer)
            # The column's JSON reads back as the schedule keyexpiry would have stored.
            assert delays(json.loads(answer["ok"]), "s", KeyExpiryError) == accepted


# --- against MariaDB or PostgreSQL and Redis, with a listener -------------------------------------


@pytest.fixture
def ledger(php_db_url: str, redis_url: str, tmp_path: Path) -> Iterator[tuple[Settings, Client]]:
    """Fast settings on MariaDB or PostgreSQL, and a client (which makes the table) to look at
    the rows."""
    sample_tasks.reset()
    settings = make_settings(redis_url, php_db_url, tmp_path)
    client = Client(settings)
    yield settings, client
    sample_tasks.reset()
    client.close()


@pytest.fixture
def producer(php: str, php_db_url: str, redis_url: str) -> PhpProducer:
    return PhpProducer(php, php_db_url, redis_url)


def _row(client: Client, key: str) -> TaskRow:
    row = client.store.get(key)
    assert row is not None, key
    return row


def _rows_of(client: Client, key: str) -> int:
    with client.store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).where(T.c.task_key == key)).scalar_one())


def test_php_tasks_run_once_with_the_arguments_python_gives(
    producer: PhpProducer,
    ledger: tuple[Settings, Client],
    start_listener: Callable[[Settings], Running],
) -> None:
    settings, client = ledger
    start_listener(settings)
    wakes = client.redis.pubsub(ignore_subscribe_messages=True)
    wakes.subscribe(wake_channel(0))
    written = ["19.90", "2E+1", "-0.050"]
    texts = producer.ok(*({"op": "decimal", "value": v} for v in written))
    dec = dict(zip(written, texts, strict=True))
    # (arguments PHP passes, the values Python gives for the same task)
    typed: list[tuple[list[Any], tuple[Any, ...]]] = [
        ([7, dec["19.90"], True, 0.5, "{x} y@z"], (7, Decimal("19.90"), True, 0.5, "{x} y@z")),
        ([-5, dec["2E+1"], False, 5.0, "café"], (-5, Decimal("2E+1"), False, 5.0, "café")),
        ([0, dec["-0.050"], True, 1e100, ""], (0, Decimal("-0.05"), True, 1e100, "")),
        ([2**62, "0", False, 0.1 + 0.2, "100%"], (2**62, Decimal(0), False, 0.1 + 0.2, "100%")),
        ([-(2**63), "1", True, -0.0, "日本 😀"], (-(2**63), Decimal(1), True, 0.0, "日本 😀")),
        ([123, "3.14", False, 1e-05, "a\tb\nc"], (123, Decimal("3.14"), False, 1e-05, "a\tb\nc")),
        ([1, "1", True, 1e16], (1, Decimal(1), True, 1e16)),  # `label` left to its default
    ]
    strings = [*EXAMPLES, "@", "%", "%41", 'a@b café 日本 {x} 100% "q" \\', "\x00\x1b\u2028"]
    commands = [create("Probe.typed", *php_args, ttl_ms=400) for php_args, _ in typed]
    commands += [create("Probe.record", s, ttl_ms=400) for s in strings]
    # Due already: armed at its due time, then looked up (PROTOCOL.md's arm-due).
    commands.append(
        {"op": "create_at", "task": "Probe.record", "args": ["overdue"], "due_at_ms": 1}
    )
    # Due in ten minutes: no wake message (only tasks due within two minutes get one).
    commands.append(create("Probe.record", "later", ttl_ms=600_000))
    created = producer.ok(*commands)
    *soon, overdue, later = created
    expected: dict[str, tuple[object, ...]] = {}
    spec = client.spec("Probe.typed")
    for (_, python), c in zip(typed, soon[: len(typed)], strict=True):
        assert c["key"] == client.key_for("Probe.typed", *python)
        # The args column holds the canonical texts Python would write.
        assert _row(client, c["key"]).args == spec.encode_args(python)
        expected[c["key"]] = (*python, "x") if len(python) == 4 else python
    for s, c in zip(strings, soon[len(typed) :], strict=True):
        assert c["key"] == client.key_for("Probe.record", s)
        expected[c["key"]] = (s,)
    expected[overdue["key"]] = ("overdue",)
    assert len(expected) == len(created) - 1  # every key its own task
    assert {c["outcome"] for c in created} == {"created"}
    for c in created:
        # The key expires at the row's due time exactly (unless it already has).
        assert client.redis.pexpiretime(c["key"]) in (max(c["due_at_ms"], 1), -2)
        row = _row(client, c["key"])
        if c is not overdue:
            assert row.due_at_ms == c["due_at_ms"] and row.problem is None

    for key, args in expected.items():
        row = wait_status(client, key, TaskStatus.DONE)
        assert row.attempts == 1, key
        assert sample_tasks.CALL_ARGS[key] == args, key
    assert {k: sample_tasks.CALLS[k] for k in expected} == dict.fromkeys(expected, 1)
    assert client.redis.exists(*expected) == 0
    # The far one waits, as a Python-made one does.
    pending = _row(client, later["key"])
    by_python = _row(client, client.create("Probe.record", "later by Python", ttl_ms=600_000))
    assert pending.status is TaskStatus.PENDING and pending.args == ("later",)
    assert pending.due_at_ms - pending.created_at_ms == 600_000
    assert by_python.due_at_ms - by_python.created_at_ms == 600_000
    assert client.redis.pexpiretime(later["key"]) == later["due_at_ms"]
    # Each task due soon was announced on the wake channel, as the driver reads it.
    announced = {(c["key"], c["due_at_ms"]) for c in soon}
    heard: set[tuple[str, int]] = set()

    def all_heard() -> bool:
        while (message := wakes.get_message(timeout=0.01)) is not None:
            heard.update(parse_wake(message["data"]))
        return announced <= heard

    wait_until(all_heard, 5, message="wake messages missing")
    assert (later["key"], later["due_at_ms"]) not in heard
    wakes.close()


def test_php_reschedule_moves_the_one_row_and_it_runs_once_at_the_later_time(
    producer: PhpProducer,
    ledger: tuple[Settings, Client],
    start_listener: Callable[[Settings], Running],
) -> None:
    settings, client = ledger
    start_listener(settings)
    # Three creates of one key in one PHP process (likely within one millisecond): 1, then 2, 2
    # affected rows, as PROTOCOL.md says.
    first, again, later = producer.ok(
        create("Probe.record", "moved", ttl_ms=1_000),
        create("Probe.record", "moved", ttl_ms=1_000),
        create("Probe.record", "moved", ttl_ms=2_000),
    )
    key = first["key"]
    assert again["key"] == later["key"] == key
    assert [first["outcome"], again["outcome"], later["outcome"]] == [
        "created", "replaced", "replaced",
    ]  # fmt: skip
    assert _rows_of(client, key) == 1
    assert client.redis.pexpiretime(key) == later["due_at_ms"]
    assert _row(client, key).due_at_ms == later["due_at_ms"]
    row = wait_status(client, key, TaskStatus.DONE)
    # Claimed once, for the later due time, not before it.
    assert sample_tasks.RUN_DUES[key] == [later["due_at_ms"]]
    assert row.started_at_ms is not None and row.started_at_ms >= later["due_at_ms"]
    assert row.attempts == 1 and sample_tasks.CALLS[key] == 1
    # A done task created again is a fresh pending task, and runs again.
    rerun = producer.create("Probe.record", "moved", ttl_ms=100)
    assert rerun["outcome"] == "replaced"
    wait_until(lambda: sample_tasks.CALLS[key] == 2, 10, message="the re-created task never ran")
    row = wait_status(client, key, TaskStatus.DONE)
    assert row.attempts == 1 and _rows_of(client, key) == 1
    assert sample_tasks.RUN_DUES[key] == [later["due_at_ms"], rerun["due_at_ms"]]


def test_php_cancel(
    producer: PhpProducer,
    ledger: tuple[Settings, Client],
    start_listener: Callable[[Settings], Running],
) -> None:
    settings, client = ledger
    start_listener(settings)
    far, soon, for_python = producer.ok(
        create("Probe.record", "cancel me", ttl_ms=60_000),
        # Due in 1.5 s: cancelled long before, it must still never run.
        create("Probe.record", "cancelled before due", ttl_ms=1_500),
        create("Probe.record", "cancelled by Python", ttl_ms=60_000),
    )
    made_by_python = client.create("Probe.record", "made by Python", ttl_ms=60_000)
    assert producer.ok(
        cancel("Probe.record", "cancel me"),
        cancel("Probe.record", "cancelled before due"),
        cancel("Probe.record", "cancel me"),  # not pending any more
        {"op": "cancel_key", "key": str(made_by_python)},
        cancel("Probe.record", "never created"),
    ) == [True, True, False, True, False]
    # Python finds what PHP made, by its values.
    assert client.cancel("Probe.record", "cancelled by Python")
    # Due after the cancelled one would have been: once it ran, that one had its chance.
    control = producer.create("Probe.record", "control", ttl_ms=2_000)
    wait_status(client, control["key"], TaskStatus.DONE)
    assert producer.ok(cancel("Probe.record", "control")) == [False]  # done: nothing to cancel
    reference = _row(client, str(made_by_python))
    for key in (far["key"], soon["key"], for_python["key"]):
        row = _row(client, key)
        assert row.status is TaskStatus.CANCELLED and row.finished_at_ms == row.updated_at_ms
        assert row.claimed_by is not None and re.fullmatch(r"cancel:[0-9a-f]{32}", row.claimed_by)
        # The row PHP's cancel leaves is the one Client.cancel leaves.
        assert (row.attempts, row.started_at_ms, row.lease_until_ms, row.last_error) == (
            reference.attempts, reference.started_at_ms, reference.lease_until_ms, None,
        )  # fmt: skip
        assert client.redis.exists(key) == 0
        assert sample_tasks.CALLS[key] == 0
    assert reference.status is TaskStatus.CANCELLED
    assert sample_tasks.CALLS[str(made_by_python)] == 0


def test_php_tag_and_retry_schedule_round_trip(
    producer: PhpProducer,
    ledger: tuple[Settings, Client],
    start_listener: Callable[[Settings], Running],
) -> None:
    settings, client = ledger
    tag = "order:218 café"
    created = producer.create(
        "Probe.record", "tagged", ttl_ms=60_000, tag=tag, retry_schedule=[0.05, 1.5, 300]
    )
    key = created["key"]
    row = _row(client, key)
    assert row.tag == tag and row.retry_schedule_s == (0.05, 1.5, 300.0) and row.problem is None
    assert [r.key for r in client.list_tasks(tag=tag)] == [key]
    # A reschedule without a tag keeps the row's; without a schedule it goes back to the
    # method's (NULL).
    producer.create("Probe.record", "tagged", ttl_ms=60_000)
    row = _row(client, key)
    assert row.tag == tag and row.retry_schedule_s is None
    producer.create("Probe.record", "tagged", ttl_ms=60_000, tag="order:219", retry_schedule=[])
    row = _row(client, key)
    assert row.tag == "order:219" and row.retry_schedule_s == ()
    assert client.list_tasks(tag=tag) == []
    # Refused (nothing written, no key): a bad tag, a bad schedule.
    bad = producer.run(
        create("Probe.record", "bad tag", ttl_ms=60_000, tag=" padded"),
        create("Probe.record", "bad schedule", ttl_ms=60_000, retry_schedule=[-1]),
        create("Probe.record", "negative ttl", ttl_ms=-1),
    )
    assert [a.get("error") for a in bad] == ["Keyexpiry\\ArgumentError"] * 3
    for name in ("bad tag", "bad schedule", "negative ttl"):
        assert client.get("Probe.record", name) is None
        assert client.redis.exists(client.key_for("Probe.record", name)) == 0
    # Python cancels PHP's tasks by tag.
    assert client.cancel_tag("order:219") == 1
    assert _row(client, key).status is TaskStatus.CANCELLED

    # The listener retries by the schedule PHP wrote (the method's own is [0.05, 0.05]).
    start_listener(settings)
    once_more, never = producer.ok(
        create("Probe.always_fail", "one retry", ttl_ms=100, retry_schedule=[0.05]),
        create("Probe.always_fail", "no retries", ttl_ms=100, retry_schedule=[]),
    )
    assert wait_status(client, once_more["key"], TaskStatus.DEAD).attempts == 2
    assert wait_status(client, never["key"], TaskStatus.DEAD).attempts == 1
    assert sample_tasks.CALLS[once_more["key"]] == 2 and sample_tasks.CALLS[never["key"]] == 1


def test_php_creates_and_cancels_in_a_business_transaction(
    producer: PhpProducer,
    ledger: tuple[Settings, Client],
    start_listener: Callable[[Settings], Running],
) -> None:
    settings, client = ledger
    start_listener(settings)
    kept = producer.create("Probe.record", "kept", ttl_ms=60_000)
    answers = producer.ok(
        {"op": "begin"},
        create("Probe.record", "rolled back", ttl_ms=100),
        cancel("Probe.record", "kept"),
        {"op": "rollback"},
        {"op": "begin"},
        create("Probe.record", "committed", ttl_ms=300),
        {"op": "commit"},
    )
    rolled_back, committed = answers[1]["key"], answers[5]["key"]
    # Rolled back: no row, no key; the cancel undone, its key left.
    assert client.store.get(rolled_back) is None and client.redis.exists(rolled_back) == 0
    assert _row(client, kept["key"]).status is TaskStatus.PENDING
    assert client.redis.exists(kept["key"]) == 1
    # Committed: its key set after the commit, and it runs.
    assert wait_status(client, committed, TaskStatus.DONE).attempts == 1
    assert sample_tasks.CALLS[committed] == 1 and sample_tasks.CALLS[rolled_back] == 0


def test_php_refuses_a_connection_that_is_not_utf8(
    php: str, php_db_url: str, redis_url: str, ledger: tuple[Settings, Client]
) -> None:
    """Over latin1 a non-ASCII argument would reach the row as other text than the key's."""
    _, client = ledger
    postgres = make_url(php_db_url).get_backend_name() == "postgresql"
    latin1 = PhpProducer(php, php_db_url, redis_url, charset="latin1", client_encoding="LATIN1")
    (answer,) = latin1.run(create("Probe.record", "café", ttl_ms=60_000))
    assert answer["error"] == "LogicException"
    assert ("client_encoding" if postgres else "utf8mb4") in answer["message"]
    assert client.get("Probe.record", "café") is None


def test_php_payload_travels_with_the_task(
    producer: PhpProducer,
    ledger: tuple[Settings, Client],
    start_listener: Callable[[Settings], Running],
) -> None:
    settings, client = ledger
    payload: dict[str, Any] = {
        "items": [1, 2.5, "café 日本"],
        "none": None,
        "empty": {},
        "list": [],
        "ok": True,
    }
    created = producer.create("Probe.with_payload", "p", ttl_ms=60_000, payload=payload)
    key = created["key"]
    assert key == client.key_for("Probe.with_payload", "p")
    assert _row(client, key).payload == payload
    # A reschedule without a payload keeps it; one with a payload replaces it.
    assert producer.create("Probe.with_payload", "p", ttl_ms=60_000)["outcome"] == "replaced"
    assert _row(client, key).payload == payload
    replaced = {"fail_once": True, "v": [2]}
    producer.create("Probe.with_payload", "p", ttl_ms=100, payload=replaced)
    # Too large for the listeners' KEYEXPIRY_PAYLOAD_MAX_BYTES: refused, nothing written.
    (too_big,) = producer.run(
        create("Probe.with_payload", "big", ttl_ms=100, payload={"x": "y" * 70_000})
    )
    assert too_big["error"] == "Keyexpiry\\ArgumentError"
    assert client.get("Probe.with_payload", "big") is None
    # Nested deeper than keyexpiry reads back (a listener could not decode it): refused.
    deepest: Any = []
    for _ in range(MAX_JSON_DEPTH - 1):
        deepest = [deepest]
    producer.create("Probe.with_payload", "deepest", ttl_ms=60_000, payload=deepest)
    assert _row(client, client.key_for("Probe.with_payload", "deepest")).payload == deepest
    (too_deep,) = producer.run(create("Probe.with_payload", "deep", ttl_ms=100, payload=[deepest]))
    assert too_deep["error"] == "Keyexpiry\\ArgumentError"
    assert f"nested deeper than {MAX_JSON_DEPTH} levels" in too_deep["message"]
    assert client.get("Probe.with_payload", "deep") is None
    start_listener(settings)
    # The handler gets it (by parameter and as current().payload) on each attempt.
    row = wait_status(client, key, TaskStatus.DONE)
    assert row.attempts == 2 and sample_tasks.CALLS[key] == 2
    assert sample_tasks.CALL_ARGS[key] == ("p", replaced, replaced)
