"""`keyexpiry.django.TasksBackend`: keyexpiry as a backend of `django.tasks` (Django 6) and of the
django-tasks backport (Django 5.2).

`TASKS = {"default": {"BACKEND": "keyexpiry.django.TasksBackend"}}`. Each `enqueue()` is a run of
its own: a key unique to it (its result id), the arguments as the row's JSON payload, due at
`run_after` (to the millisecond) or now. Inside `transaction.atomic()` on the ledger's alias the
row is written on Django's connection in the caller's transaction and the key set after its
commit (`connections.py`); outside one, it is one autocommitted round trip on keyexpiry's own
pool. `get_result()` reads the ledger row (`results.py`). A `@keyed` function's key is its arguments
instead (`keyed.py`): enqueueing it again reschedules it. Priorities are not supported: keyexpiry
runs tasks by due time.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterable
from typing import Any, TypeVar

from django.apps import apps
from django.core import checks
from django.utils import timezone
from django.utils.module_loading import import_string

from keyexpiry.django.compat import (
    BaseTaskBackend,
    Task,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_enqueued,
)
from keyexpiry.errors import KeyExpiryError, KeyFormatError
from keyexpiry.keys import parse_key

T = TypeVar("T")


class TasksBackend(BaseTaskBackend):
    """django.tasks backend on keyexpiry: deferred runs to the millisecond, results in the
    ledger, enqueue inside the caller's transaction."""

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = False

    def enqueue(self, task: Task[Any, T], args: Any, kwargs: Any) -> TaskResult[T]:
        """Schedule one run of `task(*args, **kwargs)`: due at `task.run_after`, else now."""
        typed_args = list(args)
        from django.db import connections

        from keyexpiry.django.clients import client
        from keyexpiry.django.functions import spec_of
        from keyexpiry.django.keyed import key_arguments, keyed_of
        from keyexpiry.django.settings import ledger_alias

        self.validate_task(task)
        ke = client()
        spec = spec_of(task, ke.registry)
        by_key = keyed_of(task)
        if by_key is not None:  # a Decimal, UUID or date of a key is shown as its text
            args = [a if isinstance(a, int | float | str | bool | None) else str(a) for a in args]
        result: TaskResult[T] = TaskResult(
            task=task,
            id="",
            status=TaskResultStatus.READY,
            enqueued_at=None,
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            args=list(args),  # checked and made JSON by TaskResult itself
            kwargs=dict(kwargs),
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        wrapper = connections[ledger_alias()]
        # In the caller's transaction when there is one; else keyexpiry's one round trip.
        tx = wrapper if wrapper.in_atomic_block else None
        run_after = task.run_after
        if run_after is not None and timezone.is_naive(run_after):
            # USE_TZ = False: Django's naive times are in TIME_ZONE.
            run_after = timezone.make_aware(run_after)
        when: dict[str, Any] = {"ttl_ms": 0} if run_after is None else {"at": run_after}
        if by_key is None:
            key = ke.create(
                spec.label,
                uuid.uuid4().hex,
                payload={"args": result.args, "kwargs": result.kwargs},
                tx=tx,
                **when,
            )
        else:
            ordered, named = key_arguments(task, typed_args, kwargs)
            key = ke.create(
                spec.label,
                *ordered,
                if_exists=by_key.if_exists,
                tag=None if by_key.tag is None else by_key.tag.format(**named),
                tx=tx,
                **when,
            )
        object.__setattr__(result, "id", str(key))
        object.__setattr__(result, "enqueued_at", dt.datetime.now(dt.UTC))
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult[Any]:
        """The run `result_id` names, as its ledger row says now."""
        from keyexpiry.django.clients import client
        from keyexpiry.django.results import result_of

        ke = client()
        try:
            parsed = parse_key(result_id, prefix=ke.settings.key_prefix)
        except KeyFormatError:
            raise TaskResultDoesNotExist(result_id) from None
        task = task_named(parsed.class_name, parsed.method)
        row = ke.store.get(result_id) if task is not None else None
        if task is None or row is None:
            raise TaskResultDoesNotExist(result_id)
        return result_of(task, row, self.alias)

    def cancel(self, result_id: str) -> bool:
        """Cancel the run `result_id` names if it has not started; True if it was pending."""
        from keyexpiry.django.clients import client

        return bool(client().cancel_keys([result_id]))

    def cancel_task(self, task: Task[Any, Any], *args: Any, **kwargs: Any) -> bool:
        """Cancel the pending task a `@keyed` function's arguments name; True if it was."""
        from django.db import connections

        from keyexpiry.django.clients import client
        from keyexpiry.django.functions import spec_of
        from keyexpiry.django.keyed import key_arguments, keyed_of
        from keyexpiry.django.settings import ledger_alias

        if keyed_of(task) is None:
            raise TypeError(f"{task.name} is not @keyed: cancel its runs by result id")
        ke = client()
        ordered, _ = key_arguments(task, args, kwargs)
        wrapper = connections[ledger_alias()]
        # As an enqueue: in the caller's transaction when there is one (a rollback keeps it).
        tx = wrapper if wrapper.in_atomic_block else None
        return ke.cancel(spec_of(task, ke.registry).label, *ordered, tx=tx)

    def cancel_tag(self, tag: str) -> int:
        """Cancel every pending task tagged `tag` (`@keyed(tag=…)`, or the native API's)."""
        from keyexpiry.django.clients import client

        return client().cancel_tag(tag)

    def check(self, **kwargs: Any) -> Iterable[checks.CheckMessage]:
        """Django's system checks: the settings keyexpiry reads from settings.py."""
        from keyexpiry.django.settings import keyexpiry_settings

        yield from super().check(**kwargs)
        try:
            keyexpiry_settings()
        except KeyExpiryError as exc:
            yield checks.Error(str(exc), id="keyexpiry.E001")


def task_named(class_name: str, method: str) -> Task[Any, Any] | None:
    """The Django task function a key's class and method name, or None: only a `@task` of an
    installed app's module is ever looked up (the module imported if need be)."""
    from keyexpiry.django.functions import known

    module = class_name.replace("__", ".")
    path = f"{module}.{method}"
    found = known(path)
    if found is not None:
        return found
    if apps.get_containing_app_config(module) is None:
        return None
    try:
        value = import_string(path)
    except ImportError:
        return None
    return value if isinstance(value, Task) else None
