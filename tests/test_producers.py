"""Producer mode: a process without the handlers' code creates, cancels and inspects tasks by
name; arguments are encoded by their own types with the canonical rules (the same keys a
process with the code makes), and the listener that runs them checks them against the
handler: a task that does not fit ends dead with a one-line reason, once. A declared signature
(`keyexpiry.signature`) gives the checks at create time. The CLI works the same without
`--tasks` (every engine)."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal

import pytest
from typer.testing import CliRunner

from keyexpiry import Client, Settings
from keyexpiry.cli import app
from keyexpiry.errors import ArgumentError, UnknownTaskError
from keyexpiry.ledger.store import TaskStatus
from keyexpiry.registry import Registry
from tests import sample_tasks
from tests.ke import Running, wait_status

StartListener = Callable[[Settings], Running]


@pytest.fixture
def producer(settings: Settings) -> Iterator[Client]:
    """A client whose registry has no task class: a process that imported no handler code."""
    with Client(settings, registry=Registry()) as c:
        yield c


def test_a_producer_without_the_code_makes_the_same_keys_and_the_listener_runs_them(
    producer: Client, client: Client, settings: Settings, start_listener: StartListener
) -> None:
    args = (5, Decimal("19.90"), True, 0.5, "a b@c")
    key = producer.create("Probe.typed", *args, ttl_ms=50)
    assert key == client.key_for(sample_tasks.Probe.typed, *args)  # canonical: 19.9, 0.5
    start_listener(settings)
    wait_status(client, key, TaskStatus.DONE)
    assert sample_tasks.CALL_ARGS[key] == (5, Decimal("19.9"), True, 0.5, "a b@c")


def test_arguments_that_do_not_fit_end_dead_once_with_one_line(
    producer: Client, client: Client, settings: Settings, start_listener: StartListener
) -> None:
    wrong_type = producer.create("Probe.typed", "five", Decimal(1), True, 0.5, ttl_ms=50)
    wrong_count = producer.create("Probe.record", "a", "b", ttl_ms=50)
    no_method = producer.create("Probe.not_exposed", "x", ttl_ms=50)
    start_listener(settings)
    for key, says in (
        (wrong_type, "argument 'n' must be int"),
        (wrong_count, "takes 1 argument(s), got 2"),
    ):
        row = wait_status(client, key, TaskStatus.DEAD)
        assert row.attempts == 1 and row.last_error is not None
        assert "not runnable" in row.last_error and says in row.last_error, row.last_error
        assert "\n" not in row.last_error
        assert sample_tasks.CALLS[key] == 0
    # A method the class does not expose is never run, whoever created it.
    assert sample_tasks.CALLS[no_method] == 0


def test_a_producer_cancels_and_reads_by_name(producer: Client, client: Client) -> None:
    key = producer.create("Probe.record", "c", ttl_s=60, tag="order:1", payload={"x": 1})
    row = producer.get("Probe.record", "c")
    assert row is not None and row.key == key and row.payload == {"x": 1}
    assert producer.ttl_ms("Probe.record", "c") > 0
    assert producer.cancel("Probe.record", "c") is True
    assert (got := client.store.get(key)) is not None and got.status is TaskStatus.CANCELLED


def test_values_are_encoded_by_their_own_types(producer: Client, client: Client) -> None:
    day = dt.date(2026, 11, 25)
    ident = uuid.UUID(int=7)
    key = producer.key_for("Any.thing", 1, 1.0, False, day, ident, Decimal("1.50"), "x%y")
    assert key == "Any@thing@1@1.0@false@2026-11-25@00000000-0000-0000-0000-000000000007@1.5@x%25y"
    with pytest.raises(ArgumentError, match=r"is a list.*keyexpiry\.signature"):
        producer.create("Any.thing", [1, 2], ttl_s=60)
    with pytest.raises(ArgumentError, match="argument 1"):
        producer.create("Any.thing", float("nan"), ttl_s=60)
    with pytest.raises(UnknownTaskError, match="is not allowed"):
        producer.create("os.__init__", ttl_s=60)
    assert client.store.counts() == {}


def test_a_declared_signature_checks_at_create_time(producer: Client, client: Client) -> None:
    producer.registry.declare(
        "Probe.typed", n=int, price=Decimal, flag=bool, ratio=float, label=str
    )
    with pytest.raises(ArgumentError, match="'n' must be int"):
        producer.create("Probe.typed", "five", 1, True, 0.5, "x", ttl_s=60)
    with pytest.raises(ArgumentError, match="takes 5 argument"):
        producer.create("Probe.typed", 1, ttl_s=60)
    # Converted as the handler would: an int given for the float, text for the Decimal.
    key = producer.create("Probe.typed", 5, "19.90", True, 1, "x", ttl_s=60)
    assert key == client.key_for(sample_tasks.Probe.typed, 5, Decimal("19.9"), True, 1.0, "x")


def test_a_process_with_task_classes_still_refuses_names_it_does_not_know(
    client: Client,
) -> None:
    with pytest.raises(UnknownTaskError, match="'OrderTimout' is not registered"):
        client.create("OrderTimout.close_unpaid", 218, ttl_s=60)
    client.registry.declare("OrderTimout.close_unpaid", order_id=int)
    try:
        assert client.create("OrderTimout.close_unpaid", 218, ttl_s=60).outcome == "created"
    finally:
        client.registry._declared.clear()  # the suite's shared registry


def test_the_cli_creates_by_name_without_tasks(
    cli_env: dict[str, str], client: Client, settings: Settings, start_listener: StartListener
) -> None:
    env = {**cli_env, "KEYEXPIRY_TASKS": "", "KEYEXPIRY_DATABASE_URL": settings.database_url}
    made = CliRunner().invoke(app, ["create", "Probe", "record", "cli", "--ttl-ms", "50"], env=env)
    assert made.exit_code == 0, made.output
    key = made.stdout.strip()
    assert key == client.key_for(sample_tasks.Probe.record, "cli")
    start_listener(settings)
    wait_status(client, key, TaskStatus.DONE)
