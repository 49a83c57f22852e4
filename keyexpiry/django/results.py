"""A ledger row as Django's `TaskResult`, and the signals sent around a run.

Statuses: pending → READY (a retry waiting too, with its errors listed), running → RUNNING,
done → SUCCESSFUL, dead and cancelled → FAILED (a cancelled run's one error is
`keyexpiry.errors.TaskCancelled`). `errors` come from the row's `last_error`, which keeps the
tracebacks of the current streak of failures, newest first (`ledger/table.py`); Django lists them
oldest first. The ledger keeps which listener made the latest claim (its token stays on the row
after the outcome), not which ran each earlier attempt: `worker_ids` has one entry per attempt,
the latest one the listener's id.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Any

from keyexpiry.context import TaskContext as RunContext
from keyexpiry.django.compat import (
    Task,
    TaskError,
    TaskResult,
    TaskResultStatus,
    task_finished,
    task_started,
)
from keyexpiry.django.keyed import keyed_of
from keyexpiry.ledger.rows import TaskRow, TaskStatus
from keyexpiry.ledger.table import EARLIER_ERRORS

UNKNOWN_WORKER = "unknown"
"""A past attempt's worker: the ledger does not keep which listener ran it."""
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::|$)")


def to_datetime(ms: int | None) -> dt.datetime | None:
    """Epoch ms as an aware UTC datetime (Django's `timezone.now()` kind)."""
    return None if ms is None else dt.datetime.fromtimestamp(ms / 1000, dt.UTC)


def result_of(task: Task[Any, Any], row: TaskRow, backend: str) -> TaskResult[Any]:
    """Django's view of the run `row` records, for `task`."""
    payload = row.payload if isinstance(row.payload, dict) else {}
    if keyed_of(task) is not None:
        payload = {"args": list(row.args), "kwargs": {}}  # the key's arguments, as text
    status = _status(row)
    errors = errors_of(row.last_error)
    if row.status is TaskStatus.CANCELLED:
        errors.append(
            TaskError(
                exception_class_path="keyexpiry.errors.TaskCancelled",
                traceback="keyexpiry.errors.TaskCancelled: cancelled before it ran\n",
            )
        )
    workers = [UNKNOWN_WORKER] * row.attempts
    if row.claimed_by and workers:
        # The claim's token stays on the row after its outcome (done, dead, or a retry
        # waiting), until the next claim: the latest attempt's listener, whatever the status.
        workers[-1] = row.claimed_by.rsplit(":", 1)[0]
    result: TaskResult[Any] = TaskResult(
        task=task,
        id=row.key,
        status=status,
        enqueued_at=to_datetime(row.created_at_ms),
        started_at=to_datetime(row.started_at_ms),
        finished_at=to_datetime(row.finished_at_ms) if status in _FINAL else None,
        last_attempted_at=to_datetime(row.started_at_ms),
        args=list(payload.get("args", [])),
        kwargs=dict(payload.get("kwargs", {})),
        backend=backend,
        errors=errors,
        worker_ids=workers,
    )
    if status == TaskResultStatus.SUCCESSFUL and row.result_json is not None:
        try:
            object.__setattr__(result, "_return_value", json.loads(row.result_json))
        except ValueError:
            pass
    return result


_FINAL = (TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED)


def _status(row: TaskRow) -> Any:
    if row.status is TaskStatus.PENDING:
        return TaskResultStatus.READY
    if row.status is TaskStatus.RUNNING:
        return TaskResultStatus.RUNNING
    if row.status is TaskStatus.DONE:
        return TaskResultStatus.SUCCESSFUL
    return TaskResultStatus.FAILED


def errors_of(last_error: str | None) -> list[Any]:
    """The failed attempts `last_error` keeps, oldest first, as Django's `TaskError`s."""
    if not last_error:
        return []
    out = []
    for text in reversed(last_error.split(EARLIER_ERRORS)):
        if not text.strip() or text.startswith("result not kept"):
            continue
        out.append(TaskError(exception_class_path=class_path(text), traceback=text))
    return out


def class_path(traceback_text: str) -> str:
    """The exception class a formatted traceback ends with (`builtins.` for a bare name)."""
    for line in reversed(traceback_text.strip().splitlines()):
        match = _EXCEPTION_LINE.match(line)
        if match and not line.startswith(" "):
            name = match.group(1)
            return name if "." in name else f"builtins.{name}"
    return "builtins.Exception"


def running_result(
    task: Task[Any, Any], run: RunContext, args: list[Any], kwargs: dict[str, Any]
) -> TaskResult[Any]:
    """The result a run in progress is (for `takes_context` and the signals)."""
    started = to_datetime(run.started_at_ms or None)
    plain = [a if isinstance(a, int | float | str | bool | None) else str(a) for a in args]
    return TaskResult(
        task=task,
        id=run.key,
        status=TaskResultStatus.RUNNING,
        enqueued_at=None,
        started_at=started,
        finished_at=None,
        last_attempted_at=started,
        args=plain,  # a @keyed function's Decimal, UUID or date as its text
        kwargs={k: v for k, v in kwargs.items() if k != "payload"},
        backend=task.backend,
        errors=[],
        worker_ids=[UNKNOWN_WORKER] * max(1, run.attempt),
    )


def _sender(result: TaskResult[Any]) -> type:
    return type(result.task.get_backend())


def started(result: TaskResult[Any]) -> None:
    """`task_started`, as a run begins."""
    task_started.send(sender=_sender(result), task_result=result)


def finished(result: TaskResult[Any], error: BaseException | None, value: Any = None) -> Any:
    """`task_finished` for an attempt that ended; returns the value as JSON keeps it."""
    import traceback

    now = dt.datetime.now(dt.UTC)
    object.__setattr__(result, "finished_at", now)
    if error is None:
        try:
            kept = json.loads(json.dumps(value))
        except (TypeError, ValueError):
            kept = value  # not JSON: keyexpiry keeps no result and says so on the row
        object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
        object.__setattr__(result, "_return_value", kept)
        task_finished.send(sender=_sender(result), task_result=result)
        return kept
    cls = type(error)
    result.errors.append(
        TaskError(
            exception_class_path=f"{cls.__module__}.{cls.__qualname__}",
            traceback="".join(traceback.format_exception(error)),
        )
    )
    object.__setattr__(result, "status", TaskResultStatus.FAILED)
    task_finished.send(sender=_sender(result), task_result=result)
    return None
