"""Logs for machines: `KEYEXPIRY_LOG_FORMAT=json` writes one JSON object per line (loguru's
serialisation) whose task lines carry the key, attempt, listener id and lateness."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from typer.testing import CliRunner

from keyexpiry import Client, Settings
from keyexpiry.bench.servers import wait_until
from keyexpiry.cli import app
from keyexpiry.ledger.store import TaskStatus
from keyexpiry.registry import Registry
from tests import sample_tasks
from tests.faults.spawn import listener_env
from tests.ke import Running, make_settings, wait_status
from tests.schedule_tasks import Tick
from tests.test_hostile_rows import BadRow, _insert

ROOT = Path(__file__).resolve().parents[1]


def test_json_logs_carry_key_attempt_listener_and_lateness(
    client: Client, settings: Settings
) -> None:
    env = {**listener_env(settings), "KEYEXPIRY_LOG_FORMAT": "json"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "keyexpiry", "listen"],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr or []), daemon=True)
    reader.start()
    try:
        wait_until(lambda: any("subscribed" in line for line in lines), 20, message="no start")
        key = client.create("Probe.record", "json-log", ttl_ms=30)
        wait_status(client, key, TaskStatus.DONE)
        wait_until(lambda: any("done in" in line for line in lines), 10, message="no done line")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        reader.join(timeout=10)
        if proc.stderr is not None:
            proc.stderr.close()
    records = [json.loads(line)["record"] for line in lines if line.strip()]
    done = next(r for r in records if r["message"].startswith("done in"))
    extra = done["extra"]
    assert extra["key"] == key and extra["attempt"] == 1
    assert extra["listener"].count(":") == 2  # host:pid:random
    assert isinstance(extra["late_ms"], int) and extra["late_ms"] >= 0
    assert all(r["extra"].get("listener") == extra["listener"] for r in records)


def test_an_unknown_log_format_is_one_line() -> None:
    result = CliRunner().invoke(app, ["--log-format", "xml", "init-db"])
    assert result.exit_code == 1
    assert result.stderr == "error: log format 'xml': use one of text, json\n"


EPOCH_MS = re.compile(r"(?<![\d.])\d{13}(?![\d.])")
"""Epoch milliseconds of 2001-2286: what a log line must never show a reader for a time."""
ISO_UTC = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00"


def test_log_lines_show_times_as_iso_8601_never_epoch_ms(
    redis_url: str,
    sqlite_url: str,
    tmp_path: Path,
    log_lines: list[str],
    start_listener: Callable[..., Running],
) -> None:
    settings = make_settings(redis_url, sqlite_url, tmp_path)
    registry = Registry()
    registry.register(Tick)  # a schedule declared in code: logged with its next time
    registry.register(sample_tasks.Probe)
    with Client(settings, registry=registry) as client:
        # Due in 2200, past the 100-year horizon: reported by the start-up reconciliation.
        far = _insert(client, BadRow("far", {"due_at_ms": 7_258_118_400_000}, ends="pending"))
        start_listener(settings, registry)
        wait_until(lambda: any(far in line for line in log_lines), 10, message="not reported")
        retried = client.create(sample_tasks.Probe.fail_once, "iso", ttl_ms=20)
        wait_status(client, retried, TaskStatus.DONE)
        client.pause("Probe", for_s=60)
        wait_until(lambda: any("Probe is paused" in line for line in log_lines), 10)
        client.resume("Probe")
        wait_until(lambda: any("Probe is resumed" in line for line in log_lines), 10)
    assert [line for line in log_lines if re.search(f"next at {ISO_UTC}$", line)], log_lines
    assert [line for line in log_lines if re.search(f"due time {ISO_UTC} is past", line)]
    assert any("will retry in" in line for line in log_lines), log_lines
    epochs = [line for line in log_lines if EPOCH_MS.search(line)]
    assert not epochs, epochs
    # Each line's own time too: ISO 8601 with the offset, whatever the process's zone.
    stamps = [line.split(" ", 1)[0] for line in log_lines]
    assert all(
        re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d", t) for t in stamps
    ), stamps
