"""Tags: create with `tag=`, list and cancel by tag (rows and Redis keys), tags kept by a
reschedule, bad tags refused; through the API and the CLI (SQLite and MariaDB)."""

from __future__ import annotations

import asyncio
import json

import pytest
from typer.testing import CliRunner

from keyexpiry import Client, Settings
from keyexpiry.cli import app
from keyexpiry.creates import TaskRequest
from keyexpiry.errors import ArgumentError
from keyexpiry.ledger.store import TaskStatus
from tests import sample_tasks

record = sample_tasks.Probe.record


def test_list_and_cancel_by_tag_touch_only_that_tags_pending_tasks(client: Client) -> None:
    # No listener: every row stays as the test puts it.
    later = client.create(record, "later", ttl_s=120, tag="order:218")
    keys = client.create_many(
        [
            TaskRequest(record, ["sooner"], ttl_s=60, tag="order:218"),
            TaskRequest(record, ["other"], ttl_s=60, tag="order:219"),
            TaskRequest(record, ["untagged"], ttl_s=60),
            TaskRequest(record, ["case"], ttl_s=60, tag="Order:218"),
        ]
    )
    sooner = keys[0]
    listed = client.list(tag="order:218")
    assert [r.key for r in listed] == [sooner, later]  # by due time
    assert all(r.tag == "order:218" for r in listed)
    assert client.list_tasks(TaskStatus.PENDING, 10, tag="order:219")[0].tag == "order:219"
    assert client.list(tag="order:218", limit=1)[0].key == sooner
    assert client.list(tag="order:218", status=TaskStatus.DONE) == []

    # One of the tag's tasks is no longer pending: it is neither cancelled nor counted.
    with client.store.engine.begin() as conn:
        from sqlalchemy import update

        from keyexpiry.ledger.store import T

        conn.execute(update(T).where(T.c.task_key == later).values(status="running"))
    assert client.cancel_tag("order:218") == 1
    row = client.store.get(sooner)
    assert row is not None and row.status is TaskStatus.CANCELLED
    assert client.redis.exists(sooner) == 0  # its key is gone too
    assert client.redis.exists(keys[1], keys[3]) == 2  # other tags (case counts) untouched
    assert client.cancel_tag("order:218") == 0
    assert client.cancel_tag("no such tag") == 0


def test_a_reschedule_keeps_the_tag_unless_it_gives_another(client: Client) -> None:
    key = client.create(record, "a", ttl_s=60, tag="cart:1")
    client.create(record, "a", ttl_s=90)  # a debounce that does not know the tag
    row = client.get(record, "a")
    assert row is not None and row.tag == "cart:1"
    client.create_many([TaskRequest(record, ["a"], ttl_s=30), TaskRequest(record, ["b"], ttl_s=30)])
    assert client.store.get(key).tag == "cart:1"  # type: ignore[union-attr]
    client.create(record, "a", ttl_s=60, tag="cart:2")
    assert client.store.get(key).tag == "cart:2"  # type: ignore[union-attr]
    assert [r.key for r in client.list(tag="cart:2")] == [key]
    assert client.list(tag="cart:1") == []


def test_tags_go_with_every_reschedule_rule(client: Client) -> None:
    """Rules other than replace decide under the row lock (keyexpiry.ledger.if_exists): the rows
    they insert or reset carry the tag as a replace does."""
    fresh = client.create(record, "r1", ttl_s=60, tag="cart:9", if_exists="later")
    assert fresh.outcome == "created" and client.store.get(fresh).tag == "cart:9"  # type: ignore[union-attr]
    moved = client.create(record, "r1", ttl_s=30, if_exists="earlier")
    assert moved.outcome == "moved" and client.store.get(moved).tag == "cart:9"  # type: ignore[union-attr]
    kept = client.create(record, "r1", ttl_s=90, tag="cart:10", if_exists="keep")
    assert kept.outcome == "kept" and client.store.get(kept).tag == "cart:9"  # type: ignore[union-attr]
    later = client.create(record, "r1", ttl_s=120, tag="cart:11", if_exists="later")
    assert later.outcome == "moved" and client.store.get(later).tag == "cart:11"  # type: ignore[union-attr]
    assert [r.key for r in client.list(tag="cart:11")] == [fresh]


def test_tags_of_any_script_and_full_length_are_stored_as_given(client: Client) -> None:
    long_tag = "ü" * 127 + "🎈"
    client.create(record, "x", ttl_s=60, tag=long_tag)
    client.create_many([TaskRequest(record, ["y"], ttl_s=60, tag='it\'s a "tag" 100% \\')])
    assert client.list(tag=long_tag)[0].tag == long_tag
    assert client.list(tag='it\'s a "tag" 100% \\')[0].key.endswith("@y")


@pytest.mark.parametrize(
    ("tag", "message"),
    [
        ("", "1 to 128 characters, got 0"),
        ("x" * 129, "1 to 128 characters, got 129"),
        (" order", "must not start or end with a blank"),
        ("order ", "must not start or end with a blank"),
        ("a\nb", "control characters"),
        (218, "tag must be a string, got int"),
    ],
)
def test_bad_tags_are_refused_and_nothing_is_written(
    client: Client, tag: object, message: str
) -> None:
    with pytest.raises(ArgumentError, match=message):
        client.create(record, "bad", ttl_s=60, tag=tag)  # type: ignore[arg-type]
    assert client.get(record, "bad") is None
    with pytest.raises(ArgumentError, match=message):
        client.cancel_tag(tag)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match=message):
        client.list(tag=tag)  # type: ignore[arg-type]


def test_cli_create_list_show_and_cancel_by_tag(cli_env: dict[str, str]) -> None:
    runner = CliRunner()

    def invoke(*args: str) -> tuple[int, str, str]:
        result = runner.invoke(app, list(args), env=cli_env)
        return result.exit_code, result.stdout, result.stderr

    for name in ("a", "b"):
        assert invoke("create", "Probe", "record", name, "--ttl", "60", "--tag", "order:7")[0] == 0
    assert invoke("create", "Probe", "record", "c", "--ttl", "60")[0] == 0
    code, out, _ = invoke("list", "--tag", "order:7", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["key"] for r in rows] == ["Probe@record@a", "Probe@record@b"]
    assert {r["tag"] for r in rows} == {"order:7"} and rows[0]["result"] is None
    code, out, _ = invoke("list", "--tag", "order:7")
    assert code == 0 and out.count("[order:7]") == 2 and "Probe@record@c" not in out
    code, out, _ = invoke("show", "Probe", "record", "a")
    assert code == 0 and "tag: order:7" in out
    code, out, _ = invoke("cancel", "--tag", "order:7")
    assert code == 0 and out.strip() == "cancelled 2 task(s) tagged order:7"
    code, out, _ = invoke("cancel", "--tag", "order:7")
    assert code == 0 and out.strip() == "cancelled 0 task(s) tagged order:7"
    code, _, err = invoke("cancel", "Probe", "record", "c", "--tag", "order:7")
    assert (
        code == 1 and err.strip() == "error: give either CLASS METHOD [ARG]... or --tag, not both"
    )
    code, _, err = invoke("cancel")
    assert code == 1 and err.strip() == "error: name the task (CLASS METHOD [ARG]...) or give --tag"
    code, _, err = invoke("list", "--tag", " x")
    assert code == 1 and "must not start or end with a blank" in err


def test_the_async_client_lists_and_cancels_by_tag(settings: Settings) -> None:
    from keyexpiry.aio import AsyncClient

    async def scenario() -> None:
        async with AsyncClient(settings) as ke:
            key = await ke.create(record, "a", ttl_s=60, tag="order:9")
            assert [r.key for r in await ke.list(tag="order:9")] == [key]
            assert await ke.cancel_tag("order:9") == 1
            assert [r.status for r in await ke.list(tag="order:9")] == [TaskStatus.CANCELLED]

    asyncio.run(scenario())
