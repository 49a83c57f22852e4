"""Running keyexpiry in your project's own tests, in-process: a listener on a thread with the
installed apps' task functions (`listener()`), and what would be due later made due now
(`run_due(within=…)`): the clock moved forward for the tasks, not for the process.

    from keyexpiry.django.testing import listener, run_due

    def test_unpaid_orders_close(db):            # pytest-django's transactional_db
        with listener():
            order = place_order()                # enqueues close_unpaid, due in 15 minutes
            run_due(within=dt.timedelta(minutes=15))
            assert Order.objects.get(id=order.id).status == "closed"

Django's immediate backend (`TASKS` in test settings) runs task functions inline instead;
`listener()` runs them as production does: enqueue inside `transaction.atomic()`, retries,
flow rules, results. It needs a ledger other connections can open (a SQLite file or a server
database, so `transactional_db` rather than `db`, whose transaction nothing else sees). Call
`close()` after each test (an autouse fixture: examples/django_shop/conftest.py), so keyexpiry's
pool holds no connection when the test database is dropped (PostgreSQL refuses while one is
open).
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from keyexpiry.errors import KeyExpiryError
from keyexpiry.ledger.rows import TaskStatus
from keyexpiry.limits import MAX_LIST_ROWS


def close() -> None:
    """Close keyexpiry's Client (and its pool) in this process; the next call opens a new one."""
    from keyexpiry.django.clients import reset

    reset()


@contextmanager
def listener(**overrides: Any) -> Iterator[Any]:
    """A listener on a thread for the duration of the block, running the installed apps'
    task functions (and `KEYEXPIRY["TASKS"]`), with settings.py's settings and `overrides`
    (`sentinel_count=0` and a short `stuck_after_s` by default, for quick tests)."""
    from keyexpiry.django.clients import client
    from keyexpiry.django.discovery import discover
    from keyexpiry.listener.listener import Listener
    from keyexpiry.registry import default_registry

    settings = client().settings
    discover(default_registry, settings.tasks)
    quick: dict[str, Any] = {"sentinel_count": 0, "stuck_after_s": 0.5, "lease_check_s": 0.3}
    running = Listener(settings.replace(**{**quick, **overrides}), default_registry)
    thread = threading.Thread(target=running.run, name="keyexpiry-test-listener", daemon=True)
    thread.start()
    try:
        if not running.subscribed.wait(15) or not running.wait_reconciled(15):
            raise KeyExpiryError("the test listener did not start within 15 s")
        yield running
    finally:
        running.stop()
        thread.join(30)


def run_due(within: dt.timedelta | float = 0.0, *, wait_s: float = 10.0) -> list[str]:
    """Make every pending task due within `within` (a timedelta or seconds) from now due now,
    and wait (at most `wait_s`) until a running `listener()` has run each once; returns their
    keys. A task that failed and waits for its retry counts as run, and so does a schedule's
    occurrence whose next one is pending."""
    from keyexpiry.django.clients import client

    ke = client()
    ahead_s = within.total_seconds() if isinstance(within, dt.timedelta) else float(within)
    horizon_ms = ke.clock.now_ms() + int(ahead_s * 1000)
    pending = ke.list_tasks(TaskStatus.PENDING, MAX_LIST_ROWS)
    due = [row for row in pending if row.due_at_ms <= horizon_ms]
    attempts = {row.key: row.attempts for row in due}
    moved_at_ms = ke.clock.now_ms()
    moved = ke.run_now(list(attempts))
    deadline = time.monotonic() + wait_s
    waiting = set(moved)
    while waiting:
        rows = ke.store.get_many(sorted(waiting))
        for key in list(waiting):
            row = rows.get(key)
            if row is None or row.status not in (TaskStatus.PENDING, TaskStatus.RUNNING):
                waiting.discard(key)
            elif row.status is TaskStatus.PENDING and row.attempts > attempts[key]:
                waiting.discard(key)  # failed, and waits for its retry
            elif row.finished_at_ms is not None and row.finished_at_ms >= moved_at_ms:
                waiting.discard(key)  # a schedule's occurrence: ran, the next one is pending
        if waiting and time.monotonic() > deadline:
            raise KeyExpiryError(f"{len(waiting)} task(s) did not run within {wait_s} s")
        if waiting:
            time.sleep(0.02)
    return moved
