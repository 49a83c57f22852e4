"""Logs for machines: `KEYEXPIRY_LOG_FORMAT=json` writes one JSON object per line (loguru's
serialisation) whose task lines carry the key, attempt, listener id and lateness."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

from typer.testing import CliRunner

from keyexpiry import Client, Settings
from keyexpiry.bench.servers import wait_until
from keyexpiry.cli import app
from keyexpiry.ledger.store import TaskStatus
from tests.faults.spawn import listener_env
from tests.ke import wait_status

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
