"""Ledger rows keyexpiry would never write (another producer, a bug, a hand edit), inserted with
raw SQL on SQLite and MariaDB: `list`, `show`, `reconcile`, the dashboard and a running listener
all keep working, show the row marked malformed, and report it; none of them fails for everyone.
And text from outside (a handler's error, a tag) never reaches a terminal or the text log with
its control characters raw."""

from __future__ import annotations

import contextlib
import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from loguru import logger
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from starlette.testclient import TestClient
from typer.testing import CliRunner

from keyexpiry import Client, Settings
from keyexpiry.bench.servers import wait_until
from keyexpiry.cli import app
from keyexpiry.clock import monotonic_s
from keyexpiry.errors import ConfigError, StoreError
from keyexpiry.keys import sentinel_key
from keyexpiry.ledger.recurring import MALFORMED_SCHEDULES
from keyexpiry.ledger.store import Store, TaskStatus, make_engine
from keyexpiry.limits import MAX_JSON_DEPTH, MIN_DUE_MS
from keyexpiry.listener.maintenance import FAILING_AFTER, Maintenance
from keyexpiry.listener.reconcile import PendingWalk, Reconciler
from keyexpiry.log import _format
from keyexpiry.threads import REPEAT_WINDOW_S, REPEATS, ThreadErrors
from keyexpiry.web import create_app
from tests import sample_tasks
from tests.ke import Running, wait_status

_NOW_MS = int(time.time() * 1000)
"""When this module was loaded: a finish time within every retention."""

StartListener = Callable[[Settings], Running]
TOKEN = "s3cret-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FORGED = "2024-01-01 00:00:00.000 ERROR   forged"
"""A line a handler's error text would like to pass for a log line (or a `show` field)."""
RAW_CONTROLS = ("\x1b", "\x07", "\r")
CLAIMED_DEAD = "malformed ledger row (recorded dead, not run)"
"""What a listener says, once, of a malformed row it claims."""
DEEP = "[" * 990 + "]" * 990
"""JSON that Python's decoder cannot read from any depth of the stack (RecursionError)."""


@contextlib.contextmanager
def _logged() -> Iterator[list[str]]:
    """Every line keyexpiry logs at INFO and above meanwhile, as the text log shows it (a
    `keyexpiry` command sets logging up afresh: started after those)."""
    lines: list[str] = []
    sink = logger.add(lines.append, level="INFO", format=_format, colorize=False)
    try:
        yield lines
    finally:
        with contextlib.suppress(ValueError):  # removed already by a command run meanwhile
            logger.remove(sink)


@pytest.fixture
def log_lines() -> Iterator[list[str]]:
    """`_logged` for the whole test."""
    with _logged() as lines:
        yield lines


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@dataclass(frozen=True)
class BadRow:
    """A row as another producer wrote it, and what keyexpiry must make of it."""

    name: str
    values: dict[str, Any]
    """Columns that differ from a sound pending row of `Probe.record(name)` due now."""
    ends: str
    """What a listener leaves it as: its status (unknown ones stay as they are)."""
    listed: tuple[str, ...] = ()
    """What `list` shows on the row's line besides its key."""
    reported: str | None = "malformed ledger row"
    """What a log line naming its key says (None: nothing to report, it just runs)."""
    reconcile_says: str = ""
    shown: dict[str, str] = field(default_factory=dict)
    """`show` lines (label: text they contain)."""


BAD_ROWS = [
    BadRow(
        "status-upper",
        {"status": "DEAD"},
        ends="DEAD",
        listed=("DEAD", "MALFORMED: its status 'DEAD'"),
        reconcile_says="1 malformed row(s)",
        shown={"status": "DEAD", "problem": "is none of"},
    ),
    BadRow(
        "status-evil",
        {"status": "evil"},
        ends="evil",
        listed=("evil", "MALFORMED"),
        reconcile_says="1 malformed row(s)",
        shown={"status": "evil", "problem": "its status 'evil' is none of pending"},
    ),
    BadRow(
        "due-text",
        {"due_at_ms": "tomorrow"},
        ends="pending",
        listed=("not a time", "MALFORMED: its due_at_ms column holds str 'tomorrow'"),
        reconcile_says="1 malformed row(s)",
        shown={"due_at": "None", "problem": "'tomorrow', not a number"},
    ),
    BadRow(
        "due-before-1970",
        {"due_at_ms": -9 * 10**18},
        ends="done",
        listed=("(not a date)",),
        reported="is before 1970",
        reconcile_says="1 overdue",
    ),
    BadRow(
        "running-no-lease",
        {"status": "running", "attempts": 1, "claimed_by": "gone:1:abc:1", "started_at_ms": 1},
        ends="done",
        listed=("running",),
        reported="running with no lease",
        reconcile_says="1 expired lease(s) requeued",
    ),
    BadRow(
        "method-not-the-keys",
        {"method": "always_fail"},
        ends="dead",
        listed=("MALFORMED: its class_name/method columns say 'Probe.always_fail'",),
        reported=CLAIMED_DEAD,  # said when it is claimed
        shown={"method": "record", "problem": "but its key names 'Probe.record'"},
    ),
    BadRow(
        "class-a-suffix-of-the-keys",
        {"class_name": "robe"},
        ends="dead",
        listed=("MALFORMED: its class_name/method columns say 'robe.record'",),
        reported=CLAIMED_DEAD,  # said when it is claimed
        shown={"class": "Probe", "problem": "but its key names 'Probe.record'"},
    ),
    BadRow(
        "args-not-the-keys",
        {"args": json.dumps(["someone-else"])},
        ends="dead",
        listed=("MALFORMED: its args column says ['someone-else'] but its key",),
        reported=CLAIMED_DEAD,  # said when it is claimed
        shown={"args": "args-not-the-keys", "problem": "(the key is the task's identity)"},
    ),
    BadRow(
        "args-too-deep",
        {"args": DEEP},
        ends="dead",
        listed=("MALFORMED: its args column holds JSON nested deeper than",),
        reported=CLAIMED_DEAD,
        shown={"args": "args-too-deep", "problem": f"deeper than {MAX_JSON_DEPTH} levels"},
    ),
    BadRow(
        "payload-too-deep",
        {"payload": DEEP},
        ends="dead",
        listed=("MALFORMED: its payload column holds JSON nested deeper than",),
        reported=CLAIMED_DEAD,
        shown={"payload": '"[[[[', "problem": f"deeper than {MAX_JSON_DEPTH} levels"},
    ),
    BadRow(
        "result-too-deep",
        # Finished now, not in 1970: past its retention the listener's first prune deletes it.
        {"status": "done", "attempts": 1, "finished_at_ms": _NOW_MS, "result": DEEP},
        ends="done",
        listed=("done",),
        reported=None,
        shown={"result": '"[[[['},
    ),
    BadRow(
        "control-characters",
        {
            "status": "dead",
            "attempts": 1,
            "last_error": f"Traceback\nRuntimeError: boom\x1b[2J\x07\r\n{FORGED}",
            "tag": "order\x1b]0;pwned\x07:1\n" + FORGED,
        },
        ends="dead",
        listed=("[order\\x1b]0;pwned\\x07:1\\n2024-01-01",),
        reported=None,
        shown={"tag": "order\\x1b]0;pwned\\x07:1\\n2024", "last_error": "boom\\x1b[2J\\x07\\r"},
    ),
]


def _insert(client: Client, bad: BadRow) -> str:
    """Write `bad` with raw SQL (no keyexpiry code between the values and the table)."""
    now = client.clock.now_ms()
    key = f"{client.settings.key_prefix}Probe@record@{bad.name}"
    row: dict[str, Any] = {
        "task_key": key, "class_name": "Probe", "method": "record",
        "args": json.dumps([bad.name]), "status": "pending", "attempts": 0, "due_at_ms": now,
        "created_at_ms": now, "updated_at_ms": now, "started_at_ms": None,
        "finished_at_ms": None, "claimed_by": None, "lease_until_ms": None,
        "last_error": None, "tag": None,
    }  # fmt: skip
    row.update(bad.values)
    columns = ", ".join(row)
    values = ", ".join(f":{c}" for c in row)
    with client.store.engine.begin() as conn:
        conn.execute(text(f"INSERT INTO time_limit_task ({columns}) VALUES ({values})"), row)
    return key


def _no_raw_controls(output: str) -> None:
    assert not any(c in output for c in RAW_CONTROLS), repr(output)
    assert not any(line.startswith(FORGED) for line in output.splitlines()), output


@pytest.mark.parametrize("bad", BAD_ROWS, ids=[b.name for b in BAD_ROWS])
def test_a_row_written_outside_keyexpiry_is_shown_reported_and_breaks_nothing(
    bad: BadRow,
    client: Client,
    settings: Settings,
    start_listener: StartListener,
    redis_url: str,
    db_url: str,
    tmp_path: Path,
) -> None:
    try:
        key = _insert(client, bad)
    except DBAPIError:
        # MariaDB (strict mode) and PostgreSQL refuse text in a BIGINT column: such a row
        # cannot exist there.
        assert not db_url.startswith("sqlite") and isinstance(bad.values.get("due_at_ms"), str)
        return
    if db_url.startswith("mysql") and bad.values.get("status") == "DEAD":
        # MariaDB's default collation compares case-insensitively: every query there takes
        # 'DEAD' for 'dead' (retry, retention, counts), so it is no unseen row to report.
        # Shown, it is still marked: keyexpiry writes 'dead'.
        bad = replace(bad, reported=None, reconcile_says="")
    env = {
        "KEYEXPIRY_REDIS_URL": redis_url,
        "KEYEXPIRY_DATABASE_URL": db_url,
        "KEYEXPIRY_STATE_DIR": str(tmp_path / "state"),
        "KEYEXPIRY_TASKS": "tests.sample_tasks",
        "KEYEXPIRY_SENTINEL_COUNT": "0",
    }
    cli = CliRunner()

    # The CLI: every command prints the row (marked), none prints a traceback.
    listed = cli.invoke(app, ["list"], env=env)
    assert listed.exit_code == 0 and listed.exception is None, listed.output
    (line,) = [ln for ln in listed.stdout.splitlines() if key in ln]
    assert all(part in line for part in bad.listed), line
    _no_raw_controls(listed.stdout)
    shown = cli.invoke(app, ["show", "Probe", "record", bad.name], env=env)
    assert shown.exit_code == 0 and shown.exception is None, shown.output
    fields = {ln.split(":", 1)[0].strip(): ln for ln in shown.stdout.splitlines() if ":" in ln}
    for label, part in bad.shown.items():
        # An error's traceback is a block of lines under its label.
        assert part in (shown.stdout if label == "last_error" else fields[label]), shown.stdout
    _no_raw_controls(shown.stdout)
    as_json = cli.invoke(app, ["show", "Probe", "record", bad.name, "--json"], env=env)
    assert as_json.exit_code == 0, as_json.output
    data = json.loads(as_json.stdout)
    listed_json = cli.invoke(app, ["list", "--json"], env=env)
    assert listed_json.exit_code == 0 and listed_json.exception is None, listed_json.output
    assert any(json.loads(ln)["key"] == key for ln in listed_json.stdout.splitlines())
    for column in ("last_error", "tag"):
        if column in bad.values:  # JSON keeps the text exact
            assert data[column] == bad.values[column]
    reconciled = cli.invoke(app, ["reconcile", "--dry-run"], env=env)
    assert reconciled.exit_code == 0 and reconciled.exception is None, reconciled.output
    assert bad.reconcile_says in reconciled.stdout, reconciled.stdout

    # The dashboard: the home page, the task page and the class search.
    with TestClient(create_app(settings, token=TOKEN, client=client), headers=AUTH) as web:
        home = web.get("/")
        assert home.status_code == 200, home.text
        page = web.get("/task", params={"key": key})
        assert page.status_code == 200, page.text
        search = web.get("/tasks", params={"q": "Probe"})
        assert search.status_code == 200 and key in search.text, search.text
        for html in (home.text, page.text, search.text):
            assert not any(c in html for c in RAW_CONTROLS)
        if bad.shown.get("problem"):
            assert "malformed" in page.text and "malformed" in search.text

    # A listener: the row ends as it must, the listener stays ready and runs the next task.
    with _logged() as log_lines:
        _listen(bad, key, client, settings, start_listener, log_lines)


def _listen(
    bad: BadRow,
    key: str,
    client: Client,
    settings: Settings,
    start_listener: StartListener,
    log_lines: list[str],
) -> None:
    running = start_listener(settings.replace(http="127.0.0.1:0"))
    listener = running.listener
    assert listener.endpoints is not None
    url = f"http://127.0.0.1:{listener.endpoints.port}"
    if bad.ends in {s.value for s in TaskStatus}:
        wait_status(client, key, TaskStatus(bad.ends), timeout_s=15)
    if bad.reported is not None:
        wait_until(
            lambda: any(key in ln and bad.reported in ln for ln in log_lines),
            10,
            message=f"no line reports {key}",
        )
    after = client.create(sample_tasks.Probe.record, f"after-{bad.name}", ttl_ms=20)
    wait_status(client, after, TaskStatus.DONE)
    row = client.store.get(key)
    assert row is not None and str(row.status) == bad.ends
    if bad.name in (
        "method-not-the-keys", "class-a-suffix-of-the-keys", "args-not-the-keys",
        "args-too-deep", "payload-too-deep",
    ):  # fmt: skip
        assert row.last_error is not None and "not runnable" in row.last_error
        assert key not in sample_tasks.CALLS  # neither the key's method nor the column's ran
    if bad.name == "running-no-lease":
        assert row.attempts == 2  # taken over as an expired lease, and run again
    assert listener.thread_errors.count == 0
    assert listener.failing() == []
    assert _get(f"{url}/readyz")[0] == 200
    reports = [ln for ln in log_lines if "malformed ledger row" in ln and key in ln]
    assert len(reports) <= 1, reports  # once per row, however many passes meet it
    metrics = _get(f"{url}/metrics")[1]
    counted = listener.reconciler.malformed.count
    # The metric also counts malformed pause rows (this listener's gate) and schedule rows (a
    # process-wide count: earlier tests in this worker may have met some).
    shown = counted + listener.dispatcher.gate.malformed.count + MALFORMED_SCHEDULES.count
    assert f"keyexpiry_malformed_rows_total {float(shown)}" in metrics
    assert counted >= len(reports)
    for ln in log_lines:
        _no_raw_controls(ln)


def test_a_key_prefix_is_no_part_of_a_rows_class(
    settings: Settings, start_listener: StartListener
) -> None:
    """A prefix ending in a name character (`app_`): the class column must be the class after
    the prefix, exactly; the prefix and class together, or a suffix of the class, are not."""
    prefixed = settings.replace(key_prefix="app_")
    sample_tasks.reset()
    with Client(prefixed) as client:
        sound = _insert(client, BadRow("sound", {}, ends="done"))
        whole = _insert(client, BadRow("whole", {"class_name": "app_Probe"}, ends="dead"))
        suffix = _insert(client, BadRow("suffix", {"class_name": "robe"}, ends="dead"))
        other = _insert(client, BadRow("other", {"class_name": "Other"}, ends="dead"))
        for key in (whole, suffix, other):
            row = client.store.get(key)
            assert row is not None and row.problem is not None, key
            assert (row.class_name, row.method) == ("Probe", "record"), row
            assert "its key names 'Probe.record'" in row.problem, row.problem
        row = client.store.get(sound)
        assert row is not None and row.problem is None and row.class_name == "Probe", row

        start_listener(prefixed)
        wait_status(client, sound, TaskStatus.DONE)
        for key in (whole, suffix, other):
            row = wait_status(client, key, TaskStatus.DEAD)
            assert row.last_error is not None and "not runnable" in row.last_error, row
            assert key not in sample_tasks.CALLS
        assert sound in sample_tasks.CALLS


def test_a_store_of_another_key_prefix_is_refused(settings: Settings) -> None:
    """A `Store` handed to a client reads classes after its own prefix: it must be the
    settings' one, or every row would read as malformed (or a malformed one as sound)."""
    store = Store(make_engine("sqlite://"))
    try:
        with pytest.raises(ConfigError, match="the store's key_prefix '' is not the settings'"):
            Client(settings.replace(key_prefix="app_"), store=store)
    finally:
        store.engine.dispose()


def test_a_handlers_error_text_cannot_forge_a_log_line_or_reach_the_terminal(
    client: Client, settings: Settings, start_listener: StartListener, log_lines: list[str]
) -> None:
    running = start_listener(settings)
    name = f"x\x1b]0;pwned\x07\r\n{FORGED}"
    key = client.create(sample_tasks.Probe.always_fail, name, ttl_ms=20)
    wait_status(client, key, TaskStatus.DEAD)
    wait_until(lambda: any("handler raised" in ln for ln in log_lines), 5, message="no line")
    text_log = "".join(log_lines)
    assert "boom x\\x1b]0;pwned\\x07\\r\\n2024-01-01" in text_log, text_log
    for line in text_log.splitlines():
        assert not line.startswith(FORGED), text_log
        assert not any(c in line for c in RAW_CONTROLS), repr(line)
    row = client.store.get(key)
    assert row is not None and row.last_error is not None and name in row.last_error  # exact
    assert running.listener.thread_errors.count == 0


def test_readyz_turns_false_while_a_loop_keeps_failing_and_true_once_it_works(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    """The ledger answers (`SELECT 1`), but the listener's self-check fails on every pass:
    threads alive and the ledger up is not ready."""
    running = start_listener(settings.replace(http="127.0.0.1:0"))
    assert running.listener.endpoints is not None
    url = f"http://127.0.0.1:{running.listener.endpoints.port}/readyz"
    assert _get(url)[0] == 200
    with client.store.engine.begin() as conn:
        conn.execute(text("ALTER TABLE time_limit_task RENAME TO time_limit_task_away"))
    try:
        wait_until(lambda: _get(url)[0] == 503, 15, message="readyz stayed 200")
        body = _get(url)[1]
        failed = re.search(r"self-check failed (\d+) times in a row \(last: StoreError", body)
        assert failed is not None and int(failed.group(1)) >= FAILING_AFTER, body
    finally:
        with client.store.engine.begin() as conn:
            conn.execute(text("ALTER TABLE time_limit_task_away RENAME TO time_limit_task"))
    wait_until(lambda: _get(url)[0] == 200, 15, message="readyz never came back")
    assert running.listener.failing() == []


def test_readyz_stays_false_while_the_walk_keeps_failing_however_often_one_starts(
    client: Client,
    settings: Settings,
    start_listener: StartListener,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each reconciliation's urgent part works, then every page of its walk over rows due
    later fails: a sentinel publish (anyone can send one) starts another reconciliation, and
    its working start must not count for the walk that keeps failing."""
    listener = start_listener(settings).listener
    starts: list[bool] = []
    readiness: list[list[str]] = []
    real_start, real_step = Reconciler.start, PendingWalk.step
    real_walk_step = Maintenance._walk_step

    def start(self: Reconciler, **kw: Any) -> PendingWalk:
        walk = real_start(self, **kw)
        starts.append(True)
        return walk

    def step(self: PendingWalk) -> bool:
        if self._upto_ms is None:  # the walk over rows due later, not the urgent part
            raise StoreError("a page of the walk failed")
        return real_step(self)

    def walk_step(self: Maintenance, backoff: Any) -> None:
        readiness.append(self.failing())
        real_walk_step(self, backoff)

    monkeypatch.setattr(Reconciler, "start", start)
    monkeypatch.setattr(PendingWalk, "step", step)
    monkeypatch.setattr(Maintenance, "_walk_step", walk_step)
    listener.request_reconcile("test")
    wait_until(lambda: listener.failing() != [], 15, message="never failing")
    readiness.clear()
    for _ in range(4):
        started = len(starts)
        client.redis.publish("__keyevent@0__:expired", sentinel_key(1))
        wait_until(lambda n=started: len(starts) > n, 10, message="no reconciliation started")
        stepped = len(readiness)
        wait_until(lambda n=stepped: len(readiness) > n + 1, 10, message="the walk stopped")
    assert readiness and all(readiness), readiness
    (why,) = listener.failing()
    assert why.startswith("reconciliation walk failed"), why
    assert "StoreError: a page of the walk failed" in why, why


def test_a_row_due_before_1970_runs_without_a_lateness_of_centuries(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    """Run as due now, as an overdue row is: the handler sees the earliest due time keyexpiry
    accepts (not -9e18), and no lateness of ~9e18 ms goes into the histogram, whose sum it
    would swamp for good (a later run's milliseconds vanish beside 9e15 s)."""
    key = _insert(client, BadRow("ancient", {"due_at_ms": -9 * 10**18}, ends="done"))
    listener = start_listener(settings.replace(http="127.0.0.1:0")).listener
    wait_status(client, key, TaskStatus.DONE)
    assert sample_tasks.RUN_DUES[key] == [MIN_DUE_MS]
    after = client.create(sample_tasks.Probe.record, "after-ancient", ttl_ms=20)
    wait_status(client, after, TaskStatus.DONE)
    (lateness,) = [f for f in listener.rt.metrics.collect() if f.name.startswith("keyexpiry_late")]
    observed = {s.name: s.value for s in lateness.samples if s.labels["task"] == "Probe.record"}
    assert observed["keyexpiry_lateness_seconds_count"] == 1, observed  # `after` only
    assert 0 <= observed["keyexpiry_lateness_seconds_sum"] < 60, observed


def test_a_thread_that_keeps_raising_is_failing_and_one_error_is_not() -> None:
    errors = ThreadErrors()
    errors.add("claimer")
    assert errors.repeating() == []
    for _ in range(REPEATS - 1):
        errors.add("claimer")
    assert errors.repeating() == ["claimer"]
    # Errors that stopped long ago are a thread that recovered.
    assert errors.repeating(now_s=monotonic_s() + REPEAT_WINDOW_S + 1) == []
