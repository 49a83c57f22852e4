"""The ledger in Django's admin: tasks by status, task and due time, searched by key and tag,
each with its payload, result and error; cancel and retry as actions. Read-only: every change
goes through the keyexpiry Client (the ORM never writes a ledger row)."""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from keyexpiry.django.models import Task

_DUE_WINDOWS = {
    "overdue": ("overdue", None, 0),
    "hour": ("within an hour", 0, 3_600_000),
    "day": ("within a day", 0, 86_400_000),
    "later": ("later", 86_400_000, None),
}


def _when(ms: int | None) -> str:
    if ms is None:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat(timespec="milliseconds")


def _json(text: str | None) -> str:
    if text is None:
        return "-"
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except ValueError:
        return text


class TaskNameFilter(admin.SimpleListFilter):
    """By task: `Class.method` (for Django task functions, `module__path.function`)."""

    title = "task"
    parameter_name = "task"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        pairs = Task.objects.values_list("class_name", "method").distinct()
        names = sorted({f"{c}.{m}" for c, m in pairs})
        return [(name, name) for name in names[:200]]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Task]) -> QuerySet[Task]:
        value = self.value()
        if not value or "." not in value:
            return queryset
        class_name, _, method = value.rpartition(".")
        return queryset.filter(class_name=class_name, method=method)


class DueFilter(admin.SimpleListFilter):
    """By due time, against now (the web host's clock)."""

    title = "due"
    parameter_name = "due"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(key, label) for key, (label, _, _) in _DUE_WINDOWS.items()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Task]) -> QuerySet[Task]:
        window = _DUE_WINDOWS.get(self.value() or "")
        if window is None:
            return queryset
        now_ms = int(time.time() * 1000)
        _, start, end = window
        if start is not None:
            queryset = queryset.filter(due_at_ms__gte=now_ms + start)
        if end is not None:
            queryset = queryset.filter(due_at_ms__lt=now_ms + end)
        return queryset


@admin.register(Task)
class TaskAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Read-only list and detail of ledger rows, with cancel and retry actions."""

    list_display = ("task_key", "status", "due", "attempts", "tag")
    list_filter = ("status", TaskNameFilter, DueFilter)
    search_fields = ("task_key", "tag")
    ordering = ("due_at_ms",)
    actions = ("cancel_tasks", "retry_tasks")
    fields = (
        "task_key", "status", "attempts", "tag", "due", "created", "started", "finished",
        "claimed_by", "schedule_name", "payload_json", "result_json", "error",
    )  # fmt: skip
    readonly_fields = fields

    @admin.display(description="due", ordering="due_at_ms")
    def due(self, obj: Task) -> str:
        return _when(obj.due_at_ms)

    @admin.display(description="created")
    def created(self, obj: Task) -> str:
        return _when(obj.created_at_ms)

    @admin.display(description="started")
    def started(self, obj: Task) -> str:
        return _when(obj.started_at_ms)

    @admin.display(description="finished")
    def finished(self, obj: Task) -> str:
        return _when(obj.finished_at_ms)

    @admin.display(description="payload")
    def payload_json(self, obj: Task) -> str:
        return _json(obj.payload)

    @admin.display(description="result")
    def result_json(self, obj: Task) -> str:
        return _json(obj.result)

    @admin.display(description="error")
    def error(self, obj: Task) -> str:
        return str(obj.last_error or "-")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.action(description="Cancel the selected tasks (those still pending)")
    def cancel_tasks(self, request: HttpRequest, queryset: QuerySet[Task]) -> None:
        from keyexpiry.django.clients import client

        keys = list(queryset.values_list("task_key", flat=True))
        done = client().cancel_keys(keys)
        self.message_user(request, f"cancelled {len(done)} of {len(keys)}", messages.SUCCESS)

    @admin.action(description="Retry the selected tasks now (dead, or failed and waiting)")
    def retry_tasks(self, request: HttpRequest, queryset: QuerySet[Task]) -> None:
        from keyexpiry.django.clients import client

        keys = list(queryset.values_list("task_key", flat=True))
        done = client().retry_keys(keys)
        self.message_user(request, f"requeued {len(done)} of {len(keys)}", messages.SUCCESS)
