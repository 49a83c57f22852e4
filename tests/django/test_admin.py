"""The ledger in Django's admin: filters, search, the detail page's payload, result and error,
and the cancel and retry actions (through the keyexpiry Client)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.messages.storage.cookie import CookieStorage
from django.test import RequestFactory

from keyexpiry.django.admin import DueFilter, TaskAdmin, TaskNameFilter
from keyexpiry.django.clients import client
from keyexpiry.django.models import Task
from keyexpiry.ledger.rows import TaskStatus
from keyexpiry.registry import Registry

pytestmark = pytest.mark.usefixtures("django_db")


def request() -> Any:
    req = RequestFactory().get("/admin/keyexpiry/task/")
    req._messages = CookieStorage(req)
    return req


def test_admin_lists_filters_and_acts_through_the_client() -> None:
    from keyexpiry import Client
    from keyexpiry.django.settings import keyexpiry_settings

    producer = Client(keyexpiry_settings(), registry=Registry(), ensure_schema=False)
    try:
        soon = producer.create("Orders.close", "1", ttl_s=600, tag="order:1", payload={"n": 1})
        later = producer.create("Orders.remind", "2", ttl_s=3 * 86400)
    finally:
        producer.close()
    model_admin = admin.site._registry[Task]
    assert isinstance(model_admin, TaskAdmin)
    assert not model_admin.has_change_permission(request())
    queryset = Task.objects.all()

    by_task = TaskNameFilter(request(), {"task": ["Orders.remind"]}, Task, model_admin)
    assert [t.task_key for t in by_task.queryset(request(), queryset)] == [later]
    due_soon = DueFilter(request(), {"due": ["hour"]}, Task, model_admin)
    assert [t.task_key for t in due_soon.queryset(request(), queryset)] == [soon]
    found, _ = model_admin.get_search_results(request(), queryset, "order:1")
    assert [t.task_key for t in found] == [soon]

    row = Task.objects.get(task_key=soon)
    assert '"n": 1' in model_admin.payload_json(row)
    assert model_admin.due(row).startswith(str(dt.datetime.now(dt.UTC).year))

    model_admin.cancel_tasks(request(), Task.objects.filter(task_key=soon))
    assert client().store.get(soon).status is TaskStatus.CANCELLED  # type: ignore[union-attr]
    model_admin.retry_tasks(request(), Task.objects.filter(task_key=later))  # not dead: no-op
    assert client().store.get(later).status is TaskStatus.PENDING  # type: ignore[union-attr]
