"""keyexpiry as a Django project's task system: `INSTALLED_APPS += ["keyexpiry.django"]`,
`KEYEXPIRY = {...}` in settings.py, and
`TASKS = {"default": {"BACKEND": "keyexpiry.django.TasksBackend"}}`.

A thin layer over the library: `settings.py` translates settings.py's `KEYEXPIRY` and
`DATABASES` into `keyexpiry.settings.Settings`; `connections.py` lets `tx=` (and the backend)
write on Django's own connection in the caller's `transaction.atomic()`; `functions.py` makes
Django `@task` functions runnable by a listener; `backend.py` is the django.tasks backend;
`management/commands/keyexpiry.py` runs the `keyexpiry` CLI; `migrations/` create the ledger.
What decides (claims, retries, flow rules, schedules) stays in the library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keyexpiry.django.backend import TasksBackend
    from keyexpiry.django.clients import client

__all__ = ["TasksBackend", "client"]


def __getattr__(name: str) -> Any:
    # `keyexpiry.django` is imported while Django loads INSTALLED_APPS; the backend (and
    # django.tasks with it) only when TASKS names it.
    if name == "TasksBackend":
        from keyexpiry.django.backend import TasksBackend

        return TasksBackend
    if name == "client":
        from keyexpiry.django.clients import client

        return client
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
