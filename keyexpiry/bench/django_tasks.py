"""The django scenario's handlers, one Django `@task` function and one native task class in one
module, so one listener (`python -m django keyexpiry listen`, the module named in
`KEYEXPIRY["TASKS"]`) runs both and they share its process, pool and threads.

Each notes `variant i ref_ms start_ms` to $KEYEXPIRY_BENCH_STARTS, where `ref_ms` is its argument
(the producer's host time just before the enqueue call, or the instant it is due at) and
`start_ms` the handler's start, on the same host clock. Imported only once Django is set up: the
`@task` decorator looks its backend up in settings.TASKS.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TextIO

from keyexpiry import exposed
from keyexpiry import task as native_task

try:  # Django 6
    from django.tasks import task
except ImportError:  # Django 5.2 with the django-tasks backport
    from django_tasks import task  # type: ignore[no-redef,unused-ignore]

_lock = threading.Lock()
_out: TextIO | None = None


def _note(variant: str, i: int, ref_ms: float, start_s: float) -> None:
    global _out
    path = os.environ.get("KEYEXPIRY_BENCH_STARTS")
    if not path:
        return
    with _lock:
        if _out is None:
            _out = open(path, "a", buffering=1)  # noqa: SIM115 - kept open for the process
        _out.write(f"{variant} {i} {ref_ms:.3f} {start_s * 1000:.3f}\n")


@task  # type: ignore[untyped-decorator,unused-ignore]  # Django ships no types
def record(variant: str, i: int, ref_ms: float) -> None:
    """Note this run's start beside `ref_ms` (through `keyexpiry.django.TasksBackend`)."""
    _note(variant, i, ref_ms, time.time())


@native_task
class BenchDjango:
    """The native API's side of the django scenario."""

    @exposed
    def record(self, variant: str, i: int, ref_ms: float) -> None:
        """Note this run's start beside `ref_ms` (created with `Client.create`)."""
        _note(variant, i, ref_ms, time.time())


NATIVE = "BenchDjango.record"
"""The native task's target, as `Client.create` takes it."""
