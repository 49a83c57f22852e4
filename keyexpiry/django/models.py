"""Read-only models over the ledger's tables, for the admin and the ORM's queries: never
written through the ORM (keyexpiry's statements decide every change), never created by it
(the app's migration runs keyexpiry's own DDL). Times are epoch milliseconds on Redis's clock."""

from __future__ import annotations

from typing import Any

from django.db import models


class ReadOnly(models.Model):
    """A ledger table's rows: `save()` and `delete()` refuse, use the keyexpiry Client."""

    class Meta:
        abstract = True

    def save(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(f"{type(self).__name__} rows are keyexpiry's: use the keyexpiry Client")

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        raise TypeError(f"{type(self).__name__} rows are keyexpiry's: use the keyexpiry Client")


class Task(ReadOnly):
    """A row of `time_limit_task`: one task (or, for the django.tasks backend, one run)."""

    id = models.BigAutoField(primary_key=True)
    task_key = models.CharField(max_length=512, unique=True)
    class_name = models.CharField(max_length=128)
    method = models.CharField(max_length=128)
    args = models.TextField()
    status = models.CharField(max_length=16)
    attempts = models.IntegerField()
    retry_schedule_s = models.TextField(null=True)
    due_at_ms = models.BigIntegerField()
    created_at_ms = models.BigIntegerField()
    updated_at_ms = models.BigIntegerField()
    started_at_ms = models.BigIntegerField(null=True)
    finished_at_ms = models.BigIntegerField(null=True)
    claimed_by = models.CharField(max_length=96, null=True)
    lease_until_ms = models.BigIntegerField(null=True)
    last_error = models.TextField(null=True)
    tag = models.CharField(max_length=128, null=True)
    result = models.TextField(null=True)
    payload = models.TextField(null=True)
    traceparent = models.CharField(max_length=55, null=True)
    schedule_name = models.CharField(max_length=200, null=True)

    class Meta:
        managed = False
        db_table = "time_limit_task"
        ordering = ("due_at_ms",)

    def __str__(self) -> str:
        return str(self.task_key)


class Schedule(ReadOnly):
    """A row of `keyexpiry_schedule`: a recurring schedule, named."""

    name = models.CharField(max_length=200, primary_key=True)
    task_key = models.CharField(max_length=512)
    class_name = models.CharField(max_length=128)
    method = models.CharField(max_length=128)
    cron = models.CharField(max_length=200, null=True)
    every_ms = models.BigIntegerField(null=True)
    tz = models.CharField(max_length=64)

    class Meta:
        managed = False
        db_table = "keyexpiry_schedule"

    def __str__(self) -> str:
        return str(self.name)


class Listener(ReadOnly):
    """A row of `keyexpiry_listener`: a listener's heartbeat."""

    id = models.CharField(max_length=96, primary_key=True)
    host = models.CharField(max_length=255)
    pid = models.IntegerField()
    started_at_ms = models.BigIntegerField()
    heartbeat_at_ms = models.BigIntegerField()
    running = models.IntegerField()

    class Meta:
        managed = False
        db_table = "keyexpiry_listener"

    def __str__(self) -> str:
        return str(self.id)
