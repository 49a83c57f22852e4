"""`@keyed` Django task functions: addressed by their arguments (a business key), rescheduled by
an enqueue with the same arguments under their `if_exists` rule, tagged, cancelled by arguments
or tag, and scheduled (`@exposed(every_s=…)`) without a beat process."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

import pytest

from keyexpiry.bench.servers import wait_until
from keyexpiry.django.backend import TasksBackend
from keyexpiry.django.clients import client
from keyexpiry.django.compat import TaskResultStatus, task_backends
from keyexpiry.django.discovery import discover
from keyexpiry.django.settings import keyexpiry_settings
from keyexpiry.ledger.rows import TaskStatus
from keyexpiry.registry import default_registry
from tests.django.shop import tasks
from tests.ke import FAST, Running

pytestmark = pytest.mark.usefixtures("django_db")


def later(seconds: float) -> dt.datetime:
    return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds)


def test_same_arguments_name_one_task() -> None:
    backend = task_backends["default"]
    assert isinstance(backend, TasksBackend)
    first = tasks.remind.using(run_after=later(60)).enqueue(218)
    again = tasks.remind.using(run_after=later(600)).enqueue(order_id=218, kind="email")
    assert first.id == again.id == "tests__django__shop__tasks@remind@218@email"
    row = client().store.get(first.id)
    assert row is not None and row.tag == "order:218"
    # if_exists="keep": the pending reminder kept its due time.
    assert abs(row.due_at_ms - first.task.run_after.timestamp() * 1000) < 1000  # type: ignore[union-attr]
    other = tasks.remind.using(run_after=later(60)).enqueue(218, "sms")
    assert other.id != first.id
    assert tasks.remind.get_result(first.id).args == ["218", "email"]
    assert backend.cancel_task(tasks.remind, 218) is True
    assert backend.cancel_task(tasks.remind, 218) is False
    assert backend.cancel_tag("order:218") == 1  # the sms one
    assert client().store.get(other.id).status is TaskStatus.CANCELLED  # type: ignore[union-attr]


def test_keyed_tasks_run_and_schedules_need_no_beat(
    start_listener: Callable[..., Running],
) -> None:
    discover(default_registry)
    start_listener(keyexpiry_settings().replace(**FAST), default_registry)
    result = tasks.remind.enqueue(7, "push")
    wait_until(lambda: (result.refresh(), result.is_finished)[1], 10)
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == "push:7"
    ke = client()

    def beat_done() -> bool:
        rows = [s for s in ke.schedules() if s.name == "tests__django__shop__tasks.heartbeat"]
        return bool(rows) and rows[0].last_success_ms is not None

    wait_until(beat_done, 10, message="the heartbeat schedule never ran")
