"""`keyexpiry.django.TasksBackend` end to end with a listener: results, errors, retries,
signals, deferred runs to the millisecond, and refusal of anything but a Django `@task`."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from keyexpiry import Client
from keyexpiry.bench.servers import wait_until
from keyexpiry.django.backend import TasksBackend
from keyexpiry.django.clients import client
from keyexpiry.django.compat import (
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_backends,
    task_enqueued,
    task_finished,
    task_started,
)
from keyexpiry.django.discovery import discover
from keyexpiry.django.settings import keyexpiry_settings
from keyexpiry.ledger.rows import TaskStatus
from keyexpiry.registry import Registry, default_registry
from tests.django.shop import tasks
from tests.django.shop.models import Order
from tests.ke import FAST, Running, wait_status

pytestmark = pytest.mark.usefixtures("django_db")


@pytest.fixture
def listener(django_db: str, start_listener: Callable[..., Running]) -> Iterator[Running]:
    found = discover(default_registry)
    assert "tests.django.shop.tasks.add" in found and "tests.django.shop.tasks.flaky" in found
    assert not any("not_a_task" in path for path in found)
    yield start_listener(keyexpiry_settings().replace(**FAST), default_registry)


def finished(result: Any, timeout_s: float = 10.0) -> Any:
    """The result once its run is finished (SUCCESSFUL or FAILED)."""
    wait_until(lambda: (result.refresh(), result.is_finished)[1], timeout_s)
    return result


def test_runs_results_errors_and_signals(listener: Running) -> None:
    seen: list[tuple[str, str, str]] = []

    def note(name: str) -> Callable[..., None]:
        def receiver(sender: type, task_result: Any, **_: Any) -> None:
            assert sender is TasksBackend
            seen.append((name, task_result.id, str(task_result.status)))

        return receiver

    receivers = {"enqueued": note("enqueued"), "started": note("started")}
    receivers["finished"] = note("finished")
    task_enqueued.connect(receivers["enqueued"])
    task_started.connect(receivers["started"])
    task_finished.connect(receivers["finished"])
    try:
        order = Order.objects.create()
        first, second = tasks.add.enqueue(2, b=3), tasks.add.enqueue(2, b=3)
        closing = tasks.close_unpaid.enqueue(order.id)
        failing = tasks.boom.enqueue("no stock")
        context = tasks.with_context.enqueue("t1")
        coroutine = tasks.add_async.enqueue(3, 4)

        assert first.id != second.id  # every enqueue is a run of its own
        assert first.status == TaskResultStatus.READY and first.backend == "default"
        for result in (first, second, closing, context, coroutine):
            assert finished(result).status == TaskResultStatus.SUCCESSFUL, result.errors
        assert first.return_value == {"sum": 5} and second.return_value == {"sum": 5}
        assert first.args == [2] and first.kwargs == {"b": 3}
        assert first.enqueued_at and first.started_at and first.finished_at
        assert first.enqueued_at <= first.started_at <= first.finished_at
        assert first.last_attempted_at == first.started_at and len(first.worker_ids) == 1
        # The latest attempt's listener, kept after the run ended.
        assert first.worker_ids[0] == listener.listener.owner
        assert closing.return_value == "closed"
        assert Order.objects.get(id=order.id).status == "closed"
        assert context.return_value == {"id": context.id, "attempt": 1, "tag": "t1"}
        assert coroutine.return_value == 7

        assert finished(failing).status == TaskResultStatus.FAILED
        [error] = failing.errors
        assert error.exception_class_path == "builtins.ValueError"
        assert error.exception_class is ValueError
        assert "no stock" in error.traceback and "Traceback" in error.traceback
        with pytest.raises(ValueError):
            failing.return_value  # noqa: B018

        got = tasks.add.get_result(first.id)
        assert got.status == TaskResultStatus.SUCCESSFUL and got.return_value == {"sum": 5}
        assert task_backends["default"].get_result(failing.id).errors[0].traceback
    finally:
        for name, receiver in receivers.items():
            {"enqueued": task_enqueued, "started": task_started, "finished": task_finished}[
                name
            ].disconnect(receiver)
    for result in (first, failing):
        names = [name for name, rid, _ in seen if rid == result.id]
        # A run due now may start before enqueue() returns and sends task_enqueued (as a
        # worker of Django's database backend may pick up a row as soon as it is saved).
        assert sorted(names) == ["enqueued", "finished", "started"], seen
        assert names.index("started") < names.index("finished"), seen
    assert ("finished", failing.id, str(TaskResultStatus.FAILED)) in seen


def test_retries_only_when_the_task_asks(listener: Running) -> None:
    result = tasks.flaky.enqueue("psp down")  # @exposed(retry_schedule_s=[0.2])
    ke = client()
    row = wait_status(ke, result.id, TaskStatus.PENDING)
    wait_until(
        lambda: (
            (ke.store.get(result.id) or row).attempts == 1
            and (result.refresh(), True)[1]
            and len(result.errors) == 1
        ),
        10,
    )
    assert result.status in (
        TaskResultStatus.READY,
        TaskResultStatus.RUNNING,
        TaskResultStatus.FAILED,
    )
    assert finished(result).status == TaskResultStatus.FAILED
    assert [e.exception_class_path for e in result.errors] == ["builtins.RuntimeError"] * 2
    assert len(result.worker_ids) == 2
    once = tasks.boom.enqueue("final")  # no @exposed: Django's contract, no retry
    assert finished(once).status == TaskResultStatus.FAILED and len(once.worker_ids) == 1


def test_run_after_is_kept_to_the_millisecond(listener: Running) -> None:
    when = dt.datetime.now(dt.UTC).replace(microsecond=123_000) + dt.timedelta(seconds=0.4)
    result = tasks.add.using(run_after=when).enqueue(1)
    row = client().store.get(result.id)
    assert row is not None and row.due_at_ms == int(when.timestamp() * 1000)
    assert finished(result).status == TaskResultStatus.SUCCESSFUL
    assert result.started_at is not None and result.started_at >= when


def test_only_django_task_functions_run(listener: Running, log_lines: list[str]) -> None:
    # A producer that knows no classes writes rows and keys naming a plain function of the
    # tasks module and a module that holds no tasks: the listener refuses both, as it refuses
    # an unexposed method of a task class (left pending, never run, said once).
    producer = Client(keyexpiry_settings(), registry=Registry(), ensure_schema=False)
    try:
        plain = producer.create("tests__django__shop__tasks.not_a_task", "x", ttl_ms=0)
        other = producer.create("os__path.join", "x", ttl_ms=0)
    finally:
        producer.close()
    ke = client()
    wait_until(
        lambda: (
            sum(
                "not_a_task is not an exposed task method" in line
                or "'os__path' is not registered" in line
                for line in log_lines
            )
            == 2
        ),
        10,
    )
    for key in (plain, other):
        row = ke.store.get(key)
        assert row is not None and row.status is TaskStatus.PENDING and row.attempts == 0
    with pytest.raises(TaskResultDoesNotExist):
        task_backends["default"].get_result(plain)
    with pytest.raises(TaskResultDoesNotExist):
        task_backends["default"].get_result("no such id")


def test_cancel_by_result_id() -> None:
    later = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=60)
    result = tasks.add.using(run_after=later).enqueue(5)
    backend = task_backends["default"]
    assert isinstance(backend, TasksBackend)
    assert backend.cancel(result.id) is True
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[-1].exception_class_path == "keyexpiry.errors.TaskCancelled"
    assert backend.cancel(result.id) is False


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_naive_run_after_is_read_in_time_zone_without_use_tz() -> None:
    from django.test import override_settings

    naive = dt.datetime(2031, 1, 2, 3, 4, 5, 678_000)
    with override_settings(USE_TZ=False):
        result = tasks.add.using(run_after=naive).enqueue(1)
    row = client().store.get(result.id)
    assert row is not None and row.due_at_ms == int(naive.replace(tzinfo=dt.UTC).timestamp() * 1000)
