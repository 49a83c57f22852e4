"""Results: a handler's return value is kept with its row as JSON, capped by
KEYEXPIRY_RESULT_MAX_BYTES; None keeps nothing; a value that cannot be kept leaves the task done
with the reason in `last_error` (SQLite and MariaDB)."""

from __future__ import annotations

import json
from collections.abc import Callable
from decimal import Decimal

import pytest
from typer.testing import CliRunner

from keyexpiry import Client, Settings
from keyexpiry.cli import app
from keyexpiry.creates import TaskRequest
from keyexpiry.errors import ConfigError
from keyexpiry.ledger.store import Outcome, Store, TaskStatus
from keyexpiry.limits import MAX_JSON_DEPTH
from keyexpiry.results import encode_result
from tests import sample_tasks
from tests.ke import Running, wait_status

StartListener = Callable[[Settings], Running]
returns = sample_tasks.Probe.returns


def test_results_are_kept_and_read_back_through_get_and_list(
    settings: Settings, start_listener: StartListener
) -> None:
    sample_tasks.reset()
    sample_tasks.RETURNS.update(
        {
            "none": None,
            "text": "ünï 🎈",
            "list": [1, 2.5, True, None, {"a": "b"}],
            "exact": "x" * 98,  # 100 bytes of JSON with its quotes: at the cap, kept
            "big": "x" * 99,
            "object": object(),
            "nan": float("nan"),
            "decimal": Decimal("1.5"),
            "deep": json.loads("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)),
            "surrogate": "a\udc80b",
        }
    )
    with Client(settings.replace(result_max_bytes=100)) as client:
        start_listener(settings.replace(result_max_bytes=100))
        names = ["plain", *sample_tasks.RETURNS]
        keys = client.create_many([TaskRequest(returns, [n], ttl_ms=20) for n in names])
        rows = {
            n: wait_status(client, k, TaskStatus.DONE) for n, k in zip(names, keys, strict=True)
        }
        assert rows["plain"].result == {"name": "plain", "attempt": 1}
        assert rows["text"].result == "ünï 🎈" and rows["list"].result == [
            1,
            2.5,
            True,
            None,
            {"a": "b"},
        ]
        assert rows["exact"].result == "x" * 98 and rows["exact"].last_error is None
        assert rows["none"].result is None and rows["none"].result_json is None
        assert rows["none"].last_error is None
        # Values that cannot be kept: done all the same (the work is done), the reason recorded.
        for name, why in [
            ("big", "101 bytes of JSON, more than KEYEXPIRY_RESULT_MAX_BYTES (100)"),
            ("object", "not JSON-serialisable: Object of type object"),
            ("nan", "not JSON-serialisable: Out of range float values"),
            ("decimal", "not JSON-serialisable: Object of type Decimal"),
            ("deep", f"it is nested deeper than {MAX_JSON_DEPTH} levels of arrays and objects"),
            ("surrogate", "it is not valid text: it holds a lone surrogate '\\udc80'"),
        ]:
            row = rows[name]
            assert row.result is None and row.attempts == 1, name
            assert row.last_error is not None and why in row.last_error, (name, row.last_error)
            assert row.last_error.startswith("result not kept: "), name
        assert sample_tasks.CALLS[keys[names.index("big")]] == 1  # not retried
        listed = {r.key: r for r in client.list_tasks(TaskStatus.DONE, 50)}
        assert listed[keys[names.index("list")]].to_json()["result"] == [
            1,
            2.5,
            True,
            None,
            {"a": "b"},
        ]
        got = client.get(returns, "plain")
        assert got is not None and got.result == {"name": "plain", "attempt": 1}

        # A new run (create again) starts without the old result.
        client.create(returns, "plain", ttl_s=60)
        again = client.get(returns, "plain")
        assert again is not None and again.status is TaskStatus.PENDING and again.result is None


def test_a_failed_attempt_keeps_no_result_and_the_retry_keeps_its_own(
    settings: Settings, client: Client, start_listener: StartListener
) -> None:
    start_listener(settings)
    key = client.create(sample_tasks.Probe.fail_once, "r", ttl_ms=20)
    row = wait_status(client, key, TaskStatus.DONE)
    assert row.attempts == 2 and row.result is None  # fail_once returns None


def test_the_batched_record_writes_each_runs_own_result(store: Store) -> None:
    # The recorder's statement for many successes at once, with and without results, across
    # claims; results big enough to take several statements.
    from keyexpiry.ledger.store import NewTask

    now = 1_900_000_000_000
    store.upsert_pending([NewTask(f"A@m@{i}", "A", "m", (str(i),), now) for i in range(40)], now)
    rows = store.claim(
        [f"A@m@{i}" for i in range(20)], now_ms=now, lease_until_ms=now + 9, token="a"
    )
    rows += store.claim(
        [f"A@m@{i}" for i in range(20, 40)], now_ms=now, lease_until_ms=now + 9, token="b"
    )
    big = "y" * 300_000
    outcomes = [
        Outcome(
            r.id, r.key, r.claimed_by or "", TaskStatus.DONE, now, r.due_at_ms, None,
            None if i % 3 == 0 else json.dumps([r.key, big if i % 5 == 0 else i]),
        )
        for i, r in enumerate(rows)
    ]  # fmt: skip
    assert store.record(outcomes, now + 1) == 40
    for o in outcomes:
        row = store.get(o.key)
        assert row is not None and row.status is TaskStatus.DONE and row.result_json == o.result


def test_encode_result_and_the_setting() -> None:
    assert encode_result(None, 10) == (None, None)
    assert encode_result({"é": 1}, 10) == ('{"é": 1}', None)  # 9 bytes in UTF-8
    assert encode_result({"é": 12}, 10) == ('{"é": 12}', None)  # 9 characters, 10 bytes
    assert encode_result({"é": 12}, 9) == (
        None,
        "result not kept: 10 bytes of JSON, more than KEYEXPIRY_RESULT_MAX_BYTES (9)",
    )
    nested: list[object] = []
    nested.append(nested)
    assert encode_result(nested, 100)[1] == (
        "result not kept: not JSON-serialisable: Circular reference detected"
    )
    with pytest.raises(ConfigError, match="result_max_bytes must be from 1 to 1048576"):
        Settings(result_max_bytes=0)
    assert Settings.from_env({"KEYEXPIRY_RESULT_MAX_BYTES": "4096"}).result_max_bytes == 4096


def test_cli_show_and_list_json_carry_the_result(
    cli_env: dict[str, str], settings: Settings, start_listener: StartListener
) -> None:
    runner = CliRunner()
    cli_settings = Settings.from_env(cli_env)
    start_listener(settings.replace(database_url=cli_settings.database_url))
    assert (
        runner.invoke(
            app, ["create", "Probe", "returns", "s", "--ttl-ms", "20"], env=cli_env
        ).exit_code
        == 0
    )
    with Client(cli_settings) as client:
        wait_status(client, "Probe@returns@s", TaskStatus.DONE)
    shown = json.loads(
        runner.invoke(app, ["show", "Probe", "returns", "s", "--json"], env=cli_env).stdout
    )
    assert shown["result"] == {"name": "s", "attempt": 1}
    text = runner.invoke(app, ["show", "Probe", "returns", "s"], env=cli_env).stdout
    assert '      result: {"name": "s", "attempt": 1}' in text
    out = runner.invoke(app, ["list", "--json", "--status", "done"], env=cli_env).stdout
    assert json.loads(out)["result"] == {"name": "s", "attempt": 1}
