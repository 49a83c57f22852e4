"""Payloads: a JSON document stored in the task's row, never in its key, handed to the handler
on every attempt; kept or replaced by a reschedule as documented; refused when too big or not
JSON; through create, create_many, tx=, AsyncClient, the CLI and the dashboard (every engine)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import create_engine
from starlette.testclient import TestClient
from typer.testing import CliRunner

from keyexpiry import Client, Settings
from keyexpiry.aio import AsyncClient
from keyexpiry.cli import app
from keyexpiry.creates import TaskRequest
from keyexpiry.errors import ArgumentError, ConfigError
from keyexpiry.ledger.store import TaskStatus
from keyexpiry.limits import MAX_JSON_DEPTH
from keyexpiry.registry import Registry
from keyexpiry.web import create_app
from tests import sample_tasks
from tests.ke import Running, make_settings, wait_status

StartListener = Callable[[Settings], Running]
with_payload = sample_tasks.Probe.with_payload
DOC = {"template": "reminder", "items": [1, 2.5, "ü"], "nested": {"ok": True, "none": None}}


def _ran_with(key: str) -> tuple[object, ...]:
    return sample_tasks.CALL_ARGS[key]


def test_the_handler_gets_the_payload_as_a_parameter_and_from_current(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    start_listener(settings)
    key = client.create(with_payload, "a", ttl_ms=50, payload=DOC)
    assert "reminder" not in key  # never in the key
    wait_status(client, key, TaskStatus.DONE)
    assert _ran_with(key) == ("a", DOC, DOC)
    row = client.get(with_payload, "a")
    assert row is not None and row.payload == DOC and row.to_json()["payload"] == DOC


def test_every_attempt_sees_the_same_payload(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    start_listener(settings)
    doc = {"fail_once": True, "n": 7}
    key = client.create(with_payload, "retried", ttl_ms=50, payload=doc)
    row = wait_status(client, key, TaskStatus.DONE)
    assert row.attempts == 2 and sample_tasks.CALLS[key] == 2
    assert _ran_with(key) == ("retried", doc, doc)


def test_a_reschedule_keeps_or_replaces_the_payload_and_keep_leaves_it(client: Client) -> None:
    client.create(with_payload, "r", ttl_s=60, payload={"v": 1})
    client.create(with_payload, "r", ttl_s=30)  # no payload: the task's is kept
    assert (row := client.get(with_payload, "r")) is not None and row.payload == {"v": 1}
    client.create(with_payload, "r", ttl_s=30, payload={"v": 2})  # a payload: replaced
    assert (row := client.get(with_payload, "r")) is not None and row.payload == {"v": 2}
    kept = client.create(with_payload, "r", ttl_s=10, payload={"v": 3}, if_exists="keep")
    assert kept.outcome == "kept"
    assert (row := client.get(with_payload, "r")) is not None and row.payload == {"v": 2}
    # A payload that is JSON null is no payload: the task's is kept.
    client.create(with_payload, "r", ttl_s=30, payload=None)
    assert (row := client.get(with_payload, "r")) is not None and row.payload == {"v": 2}


def test_bulk_creates_carry_each_tasks_payload(client: Client) -> None:
    keys = client.create_many(
        TaskRequest(with_payload, [f"b{i}"], ttl_s=60, payload={"i": i} if i % 2 else None)
        for i in range(10)
    )
    rows = client.store.get_many(keys)
    assert [rows[k].payload for k in keys] == [{"i": i} if i % 2 else None for i in range(10)]


def test_a_payload_too_big_or_not_json_is_refused_and_nothing_is_written(
    redis_url: str, db_url: str, tmp_path: Path
) -> None:
    settings = make_settings(redis_url, db_url, tmp_path, payload_max_bytes=100)
    with Client(settings) as client:
        with pytest.raises(ArgumentError, match="more than KEYEXPIRY_PAYLOAD_MAX_BYTES"):
            client.create(with_payload, "big", ttl_s=60, payload={"x": "y" * 100})
        with pytest.raises(ArgumentError, match="not JSON-serialisable"):
            client.create(with_payload, "set", ttl_s=60, payload={1, 2})
        with pytest.raises(ArgumentError, match="not JSON-serialisable"):
            client.create(with_payload, "nan", ttl_s=60, payload=float("nan"))
        with pytest.raises(ArgumentError):
            client.create_many(
                [
                    TaskRequest(with_payload, ["fine"], ttl_s=60, payload={"ok": 1}),
                    TaskRequest(with_payload, ["bad"], ttl_s=60, payload={"x": "y" * 100}),
                ]
            )
        assert client.store.count_pending() == 0
        # Exactly the limit is accepted (bytes of UTF-8, not characters).
        fits = "é" * ((100 - len('{"x":""}')) // 2)
        client.create(with_payload, "fits", ttl_s=60, payload={"x": fits})
        assert client.store.count_pending() == 1


def test_payload_max_bytes_is_checked() -> None:
    with pytest.raises(ConfigError, match="payload_max_bytes"):
        Settings(payload_max_bytes=0)


def test_the_payload_commits_with_the_callers_transaction(
    client: Client, db_url: str, settings: Settings, start_listener: StartListener
) -> None:
    app_engine = create_engine(db_url)
    try:
        with app_engine.begin() as conn:
            key = client.create(with_payload, "tx", ttl_ms=100, payload=DOC, tx=conn)
        start_listener(settings)
        wait_status(client, key, TaskStatus.DONE)
        assert _ran_with(key) == ("tx", DOC, DOC)
    finally:
        app_engine.dispose()


def test_the_async_client_carries_the_payload(client: Client, settings: Settings) -> None:
    async def main() -> str:
        async with AsyncClient(settings) as ke:
            return await ke.create(with_payload, "aio", ttl_s=60, payload=DOC)

    key = asyncio.run(main())
    row = client.store.get(key)
    assert row is not None and row.payload == DOC


def test_retry_dead_runs_with_the_same_payload(
    client: Client, settings: Settings, start_listener: StartListener
) -> None:
    start_listener(settings)
    sample_tasks.BROKEN.add("dead")  # fails until taken out
    doc = {"order": 218}
    key = client.create(with_payload, "dead", ttl_ms=50, payload=doc, retry_schedule_s=[])
    wait_status(client, key, TaskStatus.DEAD)
    sample_tasks.BROKEN.discard("dead")
    client.retry(with_payload, "dead")
    wait_status(client, key, TaskStatus.DONE)
    assert sample_tasks.CALLS[key] == 2 and _ran_with(key) == ("dead", doc, doc)


def test_cli_create_with_payload_and_show(cli_env: dict[str, str]) -> None:
    runner = CliRunner()
    env = {**cli_env, "KEYEXPIRY_TASKS": "tests.sample_tasks"}
    doc = {"a": [1, "<b>"]}
    made = runner.invoke(
        app,
        ["create", "Probe", "with_payload", "x", "--ttl", "60", "--payload", json.dumps(doc)],
        env=env,
    )
    assert made.exit_code == 0, made.output
    shown = runner.invoke(app, ["show", "Probe", "with_payload", "x", "--json"], env=env)
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["payload"] == doc
    text = runner.invoke(app, ["show", "Probe", "with_payload", "x"], env=env)
    assert '     payload: {"a": [1, "<b>"]}' in text.output
    bad = runner.invoke(
        app, ["create", "Probe", "with_payload", "y", "--ttl", "60", "--payload", "{nope"], env=env
    )
    assert bad.exit_code == 1 and "--payload is not JSON" in bad.output


def test_the_dashboard_shows_the_payload_escaped(client: Client, settings: Settings) -> None:
    client.create(with_payload, "web", ttl_s=60, payload={"html": "<script>alert(1)</script>"})
    key = client.key_for(with_payload, "web")
    dashboard = create_app(settings)
    try:
        with TestClient(
            dashboard, base_url="http://localhost:8080", client=("127.0.0.1", 5000)
        ) as http:
            page = http.get("/task", params={"key": key})
        assert page.status_code == 200
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
        assert "<script>alert(1)" not in page.text
    finally:
        dashboard.close()  # type: ignore[attr-defined]


def test_a_payload_parameter_must_follow_the_arguments() -> None:
    class Bad:
        from keyexpiry import exposed

        @exposed
        def m(self, payload: dict, order_id: int) -> None: ...  # type: ignore[type-arg]

    with pytest.raises(ConfigError, match="payload` must come after"):
        Registry().register(Bad)

    class Good:
        from keyexpiry import exposed

        @exposed
        def m(self, order_id: int, *, payload: dict | None = None) -> None: ...  # type: ignore[type-arg]

    registry = Registry()
    registry.register(Good)
    spec = registry.resolve("Good", "m")
    assert spec.takes_payload and [p.name for p in spec.params] == ["order_id"]


def _nested(depth: int) -> object:
    """`depth` arrays, one inside the other, around a 1."""
    doc: object = 1
    for _ in range(depth):
        doc = [doc]
    return doc


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_payload_nested_too_deep_or_holding_a_lone_surrogate_is_refused(
    client: Client, settings: Settings
) -> None:
    """Python's decoder recurses once per level: a payload ~1000 deep, once stored, raised
    RecursionError in the listener on every attempt (and in `show`, `list --json`)."""
    deepest = _nested(MAX_JSON_DEPTH)
    key = client.create(with_payload, "deepest", ttl_s=60, payload=deepest)
    assert (row := client.store.get(key)) is not None and row.payload == deepest
    refused = [
        (_nested(MAX_JSON_DEPTH + 1), f"nested deeper than {MAX_JSON_DEPTH} levels"),
        ({"a": [{"b": _nested(MAX_JSON_DEPTH)}]}, "nested deeper"),
        (_nested(900), "nested deeper|not JSON-serialisable"),
        ({"text": "a\ud800b"}, "not valid text"),
        ({"\udcff": 1}, "not valid text"),
    ]
    for i, (doc, why) in enumerate(refused):
        with pytest.raises(ArgumentError, match=why):
            client.create(with_payload, f"bad{i}", ttl_s=60, payload=doc)
        with pytest.raises(ArgumentError, match=why):
            client.create_many([TaskRequest(with_payload, [f"many{i}"], ttl_s=60, payload=doc)])

    async def main() -> None:
        async with AsyncClient(settings) as ke:
            for i, (doc, why) in enumerate(refused):
                with pytest.raises(ArgumentError, match=why):
                    await ke.create(with_payload, f"aio{i}", ttl_s=60, payload=doc)

    asyncio.run(main())
    assert client.store.count_pending() == 1


def test_cli_create_refuses_a_payload_too_deep_or_not_text_in_one_line(
    cli_env: dict[str, str],
) -> None:
    runner = CliRunner()
    env = {**cli_env, "KEYEXPIRY_TASKS": "tests.sample_tasks"}
    for name, text, why in [
        ("deep", "[" * 990 + "]" * 990, f"nested deeper than {MAX_JSON_DEPTH} levels"),
        ("over", json.dumps(_nested(MAX_JSON_DEPTH + 1)), "nested deeper"),
        ("surrogate", '{"a": "\\ud800"}', "not valid text"),
    ]:
        made = runner.invoke(
            app,
            ["create", "Probe", "with_payload", name, "--ttl", "60", "--payload", text],
            env=env,
        )
        assert made.exit_code == 1 and isinstance(made.exception, SystemExit), made.output
        (line,) = made.output.splitlines()
        assert line.startswith("error: ") and why in line and len(line) < 200, line
